"""The per-batch context-parallel plan: how a global batch is cut into per-rank chunks.

A :class:`CPPlan` is pure tensor bookkeeping with no collectives, so everything in this module can be
unit-tested in one process. The runtime shim (:mod:`cpcompile.runtime`) builds one plan per batch and the
compiled graph reads it while it runs.

Layout: the sequence dimension ``T`` of every row is padded to ``T_pad``, a multiple of the CP size ``N``,
and rank ``r`` holds the contiguous chunk ``[r * c, (r + 1) * c)`` with ``c = T_pad // N``. Padding tokens
form a separate document (their position ids restart at 0) and carry the ignore label, so they never
influence a real token.

Attention masks follow transformers' index-based definitions exactly: query ``i`` may see key ``j`` iff
``j <= i`` (global causal order), and, for the document form, both lie in the same document, where a new
document starts wherever ``position_ids[t] - position_ids[t - 1] != 1``
(``transformers.masking_utils.find_packed_sequence_indices``); with a sliding window ``w`` additionally
``j > i - w``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

__all__ = ["IGNORE_INDEX", "CPPlan", "VisibleBlocks", "document_ids", "build_plan", "visible_blocks"]

#: The label value that transformers' cross entropy ignores.
IGNORE_INDEX = -100


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document index of every token of ``[B, T]`` position ids (new document where the step is not +1).

    The same rule transformers uses to detect packed sequences, so that our masks agree with the model's.
    """
    first = position_ids[:, :1] - 1
    step = torch.diff(position_ids, prepend=first, dim=-1)
    return (step != 1).cumsum(-1)


@dataclasses.dataclass(frozen=True)
class VisibleBlocks:
    """Which (query block, key block) pairs of one rank's attention hold at least one visible pair.

    Queries are this rank's ``c`` local tokens cut into blocks of ``block_q``; keys are the ``kv_len`` global
    tokens cut into blocks of ``block_k``. For query block ``i`` of row ``b`` the visible keys form the token
    interval ``[lo[b, i], hi[b, i])`` (the start of the block's earliest document, or of the window, up to the
    block's last query), and every query of the block sees every key of ``[full_lo[b, i], full_hi[b, i])``
    (empty when ``full_lo >= full_hi``). A key block is computed iff it intersects ``[lo, hi)``; it needs no
    mask iff it lies inside ``[full_lo, full_hi)``. All four are ``[B, num_q_blocks]`` int64 tensors.
    """

    block_q: int
    block_k: int
    #: Number of local queries (the chunk length).
    q_len: int
    #: Number of keys (the padded global length).
    kv_len: int
    lo: torch.Tensor
    hi: torch.Tensor
    full_lo: torch.Tensor
    full_hi: torch.Tensor

    def key_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(first, end)``: the computed key blocks of query block ``i`` are ``range(first[b, i], end[b, i])``."""
        return self.lo // self.block_k, -(-self.hi // self.block_k)

    def computed_pairs(self) -> int:
        """Number of (query, key) pairs a kernel computes when it visits exactly the computed block pairs."""
        first, end = self.key_blocks()
        keys = (end * self.block_k).clamp(max=self.kv_len) - first * self.block_k  # [B, nQ]
        rows = torch.full((self.lo.shape[1],), self.block_q, dtype=torch.long)
        rows[-1] = self.q_len - self.block_q * (self.lo.shape[1] - 1)
        return int((keys * rows.to(keys.device)).sum())


def visible_blocks(
    kv_doc: torch.Tensor, q_offset: int, q_len: int, block_q: int, block_k: int, window: int | None = None
) -> VisibleBlocks:
    """Block visibility of queries ``[q_offset, q_offset + q_len)`` against all keys of ``[B, T]`` doc ids.

    ``kv_doc`` must be non-decreasing along each row (documents are contiguous, as :func:`document_ids`
    makes them); a constant ``kv_doc`` means no document condition. Semantics are those of
    :meth:`CPPlan.mask`: key ``j`` visible to query ``i`` iff ``j <= i``, same document and ``j > i - window``.
    """
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
    B, T = kv_doc.shape
    device = kv_doc.device
    idx = torch.arange(T, device=device)
    starts = torch.ones_like(kv_doc, dtype=torch.bool)
    starts[:, 1:] = kv_doc[:, 1:] != kv_doc[:, :-1]
    doc_start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # [B, T]
    first_q = torch.arange(0, q_len, block_q, device=device) + q_offset  # [nQ] global index of each block's first query
    last_q = (first_q + block_q).clamp(max=q_offset + q_len) - 1
    lo = doc_start[:, first_q]
    full_lo = doc_start[:, last_q]
    if window is not None:
        lo = lo.clamp(min=first_q - window + 1)
        full_lo = full_lo.clamp(min=last_q - window + 1)
    hi = (last_q + 1).expand(B, -1)
    full_hi = (first_q + 1).expand(B, -1)
    return VisibleBlocks(block_q, block_k, q_len, T, lo, hi.contiguous(), full_lo, full_hi.contiguous())


@dataclasses.dataclass(frozen=True, eq=False)
class CPPlan:
    """Everything the shim and the rewritten attention need to know about one global batch.

    Built by :func:`build_plan`; the fields are read-only.
    """

    #: CP group size (number of chunks).
    cp_size: int
    #: This rank's index inside the CP group.
    cp_rank: int
    #: Batch size.
    batch_size: int
    #: Global sequence length before padding.
    seq_len: int
    #: Global sequence length after padding to a multiple of ``cp_size``.
    padded_len: int
    #: Global position ids, ``[B, padded_len]`` (padding restarts at 0).
    position_ids: torch.Tensor
    #: Global document ids, ``[B, padded_len]`` (padding is its own document).
    doc_ids: torch.Tensor
    #: Name of the CP process group (``""`` when built without a group, e.g. in unit tests).
    group_name: str = ""
    #: Masks built so far for this batch, keyed by ``(documents, window)``.
    _mask_cache: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def chunk_len(self) -> int:
        """Number of tokens of every row held by one rank."""
        return self.padded_len // self.cp_size

    @property
    def num_padding(self) -> int:
        """Number of padding tokens appended to every row."""
        return self.padded_len - self.seq_len

    def chunk_slice(self, rank: int | None = None) -> slice:
        """The global token range ``[r*c, (r+1)*c)`` of ``rank`` (this rank by default)."""
        r = self.cp_rank if rank is None else rank
        c = self.chunk_len
        return slice(r * c, (r + 1) * c)

    def token_indices(self, rank: int | None = None) -> torch.Tensor:
        """The global token index of every local token of ``rank`` (this rank by default): int64 ``[c]``.

        Index ``i`` of the result is the position in the padded global sequence of the ``i``-th token this
        rank holds; indices ``>= seq_len`` are padding. Position sources the pass rewrites read these indices
        at run time (``torch.ops.cpcompile.token_positions``), so they follow the plan's layout.
        """
        r = self.cp_rank if rank is None else rank
        c = self.chunk_len
        return torch.arange(r * c, (r + 1) * c, device=self.position_ids.device, dtype=torch.long)

    def real_tokens(self, rank: int | None = None) -> torch.Tensor:
        """Bool ``[B, c]``: True where ``rank``'s local token is a token of the batch, False on padding."""
        real = self.token_indices(rank) < self.seq_len
        return real.expand(self.batch_size, -1).contiguous()

    # -- slicing ---------------------------------------------------------------------------------------
    def pad(self, t: torch.Tensor, value: int | float | bool) -> torch.Tensor:
        """Pad the sequence dim (dim 1) of a global ``[B, T, ...]`` tensor to ``padded_len`` with ``value``."""
        if self.num_padding == 0:
            return t
        shape = (t.shape[0], self.num_padding, *t.shape[2:])
        return torch.cat([t, t.new_full(shape, value)], dim=1)

    def local(self, t: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """This rank's contiguous chunk of an already padded global ``[B, padded_len, ...]`` tensor."""
        return t[:, self.chunk_slice(rank)].contiguous()

    def unpad(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Drop the padding from a gathered ``padded_len`` dimension."""
        return t.narrow(dim, 0, self.seq_len)

    # -- masks -----------------------------------------------------------------------------------------
    def mask(
        self, *, documents: bool, window: int | None = None, rank: int | None = None, keys: slice | None = None
    ) -> torch.Tensor:
        """Boolean ``[B, 1, c, padded_len]`` mask of the local queries against all keys (True = attend).

        Query ``i`` of rank ``r`` sits at global index ``r*c + i``. ``documents`` adds the same-document
        condition (transformers' packed-document mask); ``window`` a sliding window of that many tokens.
        ``keys`` restricts the mask to that global key range (e.g. ``chunk_slice()`` for the diagonal block).
        Full masks of this rank are cached on the plan, so every layer of one step shares them; restricted
        ones are not cached.
        """
        key = (documents, window, self.cp_rank if rank is None else rank)
        cached = self._mask_cache.get(key) if keys is None else None
        if cached is not None:
            return cached
        device = self.position_ids.device
        keys = slice(None) if keys is None else keys
        cache = keys == slice(None)
        q_idx = torch.arange(self.padded_len, device=device)[self.chunk_slice(rank)]
        kv_idx = torch.arange(self.padded_len, device=device)[keys]
        m = kv_idx[None, :] <= q_idx[:, None]  # [c, K]
        if window is not None:
            m = m & (kv_idx[None, :] > q_idx[:, None] - window)
        m = m[None].expand(self.batch_size, -1, -1)
        if documents:
            doc_q = self.doc_ids[:, self.chunk_slice(rank)]
            m = m & (doc_q[:, :, None] == self.doc_ids[:, None, keys])
        m = m[:, None].contiguous()
        if cache:
            self._mask_cache[key] = m
        return m

    def visible_blocks(
        self, block_q: int, block_k: int, *, documents: bool = True, window: int | None = None, rank: int | None = None
    ) -> VisibleBlocks:
        """The (query block, key block) pairs of ``rank``'s attention that are not fully masked.

        Same visibility as :meth:`mask` with the same ``documents``/``window``, at block granularity; no
        ``[c, padded_len]`` mask is built.
        """
        r = self.cp_rank if rank is None else rank
        kv_doc = self.doc_ids if documents else torch.zeros_like(self.doc_ids)
        return visible_blocks(kv_doc, r * self.chunk_len, self.chunk_len, block_q, block_k, window)

    def labels_shifted(self, labels: torch.Tensor) -> torch.Tensor:
        """Shift ``[B, T]`` labels left by one over the whole row (transformers' convention), then pad.

        ``shifted[:, t] = labels[:, t + 1]``; the last real token and all padding get ``IGNORE_INDEX``.
        """
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
        return self.pad(shifted, IGNORE_INDEX)


def _check_batch(batch: Mapping[str, object]) -> tuple[int, int, torch.device]:
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"batch must be a dict of [B, T] tensors, got {type(batch).__name__}; "
            "pass e.g. {'input_ids': ids, 'position_ids': pos, 'labels': labels}"
        )
    if "input_ids" not in batch:
        raise ValueError(
            f"batch has no 'input_ids' (keys: {sorted(batch)}); cpcompile.shard needs the token ids of the "
            "whole global batch under 'input_ids'"
        )
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"batch['input_ids'] must be a [B, T] tensor, got {shape}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"batch['input_ids'] must hold integer token ids, got dtype {ids.dtype}")
    B, T = ids.shape
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            continue
        if value.dim() < 2 or value.shape[0] != B or value.shape[1] != T:
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(value.shape)}, expected [B, T, ...] = [{B}, {T}, ...] like "
                "input_ids; every per-token tensor of the batch must have the same batch size and length"
            )
        if value.device != ids.device:
            raise ValueError(
                f"batch[{key!r}] is on {value.device} but input_ids is on {ids.device}; move the whole batch "
                "to one device"
            )
    return B, T, ids.device


def build_plan(
    batch: Mapping[str, torch.Tensor],
    cp_size: int,
    cp_rank: int,
    *,
    group_name: str = "",
) -> CPPlan:
    """Validate a global batch and build the plan of chunk ``cp_rank`` of ``cp_size``.

    Raises ``ValueError``/``TypeError`` for malformed batches (before any collective can run).
    """
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank!r}")
    B, T, device = _check_batch(batch)
    if T < cp_size:
        raise ValueError(
            f"sequence length {T} is shorter than the CP size {cp_size}: every rank needs at least one token; "
            "use a smaller CP group or a longer (packed) sequence"
        )
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(T, device=device).expand(B, T)
    else:
        if not isinstance(pos, torch.Tensor) or pos.dim() != 2:
            raise ValueError(
                f"batch['position_ids'] must be a [B, T] = [{B}, {T}] tensor, "
                f"got {getattr(pos, 'shape', type(pos).__name__)}"
            )
        if pos.dtype.is_floating_point or pos.dtype == torch.bool:
            raise TypeError(f"batch['position_ids'] must be an integer tensor, got dtype {pos.dtype}")
        if bool((pos < 0).any()):
            raise ValueError(
                f"batch['position_ids'] holds negative values (min {int(pos.min())}); positions count from 0 "
                "and restart at 0 at each packed document"
            )
    labels = batch.get("labels")
    if labels is not None:
        if labels.dtype.is_floating_point or labels.dtype == torch.bool:
            raise TypeError(f"batch['labels'] must be an integer tensor, got dtype {labels.dtype}")
        if labels.dim() != 2:
            raise ValueError(f"batch['labels'] must be [B, T] = [{B}, {T}], got {tuple(labels.shape)}")
    padded = -(-T // cp_size) * cp_size
    num_pad = padded - T
    pos = pos.to(torch.long)
    if num_pad:
        pad_pos = torch.arange(num_pad, device=device, dtype=torch.long).expand(B, num_pad)
        pos = torch.cat([pos, pad_pos], dim=1)
    pos = pos.contiguous()
    return CPPlan(
        cp_size=cp_size,
        cp_rank=cp_rank,
        batch_size=B,
        seq_len=T,
        padded_len=padded,
        position_ids=pos,
        doc_ids=document_ids(pos),
        group_name=group_name,
    )
