"""The ``mask_mod`` and ``score_mod`` of rewritten flex_attention sites, evaluated per block at global indices.

The flex pass (:mod:`cpcompile.passes.flex_cp`) registers every site's mods (:func:`register_flex_mods`);
``cpcompile::flex_cp_attention`` (:mod:`cpcompile.kernels.flex_site`) binds them to one call's buffers
(:func:`bind_mods`) and the block loop asks the bound mods (:class:`BoundMods`) for each block's mask and scores.
"""

from __future__ import annotations

import dataclasses

import torch

from cpcompile import _compat

__all__ = ["BoundMods", "FlexMods", "bind_mods", "register_flex_mods"]


@dataclasses.dataclass(frozen=True)
class FlexMods:
    """The ``mask_mod`` and ``score_mod`` of one rewritten flex_attention site, as flex calls them.

    ``mask_mod(b, h, q_idx, kv_idx, *mask_buffers) -> bool`` and ``score_mod(score, b, h, q_idx, kv_idx,
    *score_buffers) -> score`` are functions of scalars (flex vmaps them; so does :meth:`BoundMods.mask`).
    ``mask_slots``/``score_slots`` say, for every extra argument, ``("tensor", i)`` (the op's ``i``-th buffer
    tensor) or ``("const", value)`` (a number fixed at compile time, or ``None`` for a size the mod does not
    read). ``None``: no mask (every key visible) or no score_mod.
    """

    mask_mod: object | None
    score_mod: object | None
    mask_slots: tuple[tuple[str, int], ...] = ()
    score_slots: tuple[tuple[str, int], ...] = ()


_FLEX_MODS: dict[str, FlexMods] = {}


def register_flex_mods(key: str, mods: FlexMods) -> str:
    """Make ``mods`` known to ``cpcompile::flex_cp_attention`` under ``key`` (the pass's site id)."""
    _FLEX_MODS[key] = mods
    return key


def _vmap_scalar_fn(fn, first: tuple, n_extra: int):
    """``fn`` mapped over ``[H, rows, L]``: ``first`` holds, per leading argument, its in_dims at the (head, query,
    key) levels or ``None`` (not mapped), like flex's own ``_vmap_for_bhqkv``; extra arguments are not mapped."""
    for level in (3, 2, 1):  # innermost (keys) first
        dims = tuple(d[level - 1] if d is not None else None for d in first) + (None,) * n_extra
        fn = torch.vmap(fn, in_dims=dims)
    return fn


@dataclasses.dataclass
class BoundMods:
    """:class:`FlexMods` with one call's buffers, evaluated per block at global indices.

    Indices at or past ``seq_len`` (padding the plan appends) are clamped into the sequence for the mods, and
    the mask_mod decides only pairs of real tokens: a real token never sees padding, whatever the mask_mod says,
    and a padding query sees the padding keys up to itself (finite values that no real token reads).
    """

    mods: FlexMods
    mask_args: tuple
    score_args: tuple
    seq_len: int
    heads: int

    @property
    def score_mod(self):
        return self.mods.score_mod

    def _indices(self, b: int, q_pos: torch.Tensor, kv_pos: torch.Tensor):
        dev = q_pos.device
        last = self.seq_len - 1
        return (
            torch.tensor(b, dtype=torch.int32, device=dev),
            torch.arange(self.heads, dtype=torch.int32, device=dev),
            q_pos.clamp(max=last).to(torch.int32),
            kv_pos.clamp(min=0, max=last).to(torch.int32),
        )

    def mask(self, b: int, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
        """``[H, rows, L]`` bool: the visible pairs of queries at ``q_pos`` and keys at ``kv_pos`` in row ``b``."""
        bi, h, qi, ki = self._indices(b, q_pos, kv_pos)
        q_pad, kv_pad = q_pos >= self.seq_len, (kv_pos >= self.seq_len) | (kv_pos < 0)
        real = ~q_pad[:, None] & ~kv_pad[None, :]
        # padding queries see the padding keys up to themselves: finite outputs that no real token reads
        pad = q_pad[:, None] & (kv_pos >= self.seq_len)[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if self.mods.mask_mod is None:
            return (real | pad).expand(self.heads, -1, -1)
        dims = (None, (0, None, None), (None, 0, None), (None, None, 0))
        fn = _vmap_scalar_fn(self.mods.mask_mod, dims, len(self.mask_args))
        with _compat.vmap_inside_custom_op():
            return (fn(bi, h, qi, ki, *self.mask_args).to(torch.bool) & real) | pad

    def keys_seen(self, rows: int, q_pos: torch.Tensor, kv_pos: torch.Tensor, block_q: int, block_k: int):
        """Bool ``[len(kv_pos)]``: whether some real query at ``q_pos``, in some head of one of the ``rows`` batch
        rows, sees the real key at ``kv_pos`` under the mask_mod (what a selective exchange must deliver);
        evaluated ``block_q`` queries by ``block_k`` keys at a time."""
        seen = torch.zeros(kv_pos.shape[0], dtype=torch.bool, device=kv_pos.device)
        queries = q_pos[q_pos < self.seq_len]
        real = (kv_pos >= 0) & (kv_pos < self.seq_len)
        if self.mods.mask_mod is None:
            return real
        for ks in range(0, kv_pos.shape[0], block_k):
            keys = kv_pos[ks : ks + block_k]
            hit = seen[ks : ks + block_k]
            for b in range(rows):
                if bool(hit.all()):
                    break
                for qs in range(0, queries.shape[0], block_q):
                    hit |= self.mask(b, queries[qs : qs + block_q], keys).flatten(0, 1).any(0)
        return seen & real

    def score(self, s: torch.Tensor, b: int, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
        """``score_mod`` applied to the ``[H, rows, L]`` scaled scores ``s``."""
        bi, h, qi, ki = self._indices(b, q_pos, kv_pos)
        dims = ((0, 0, 0), None, (0, None, None), (None, 0, None), (None, None, 0))
        fn = _vmap_scalar_fn(self.mods.score_mod, dims, len(self.score_args))
        with _compat.vmap_inside_custom_op():
            return fn(s, bi, h, qi, ki, *self.score_args)


def bind_mods(key: str, tensors: list, seq_len: int, heads: int) -> BoundMods:
    """The :class:`FlexMods` registered under ``key`` with this call's buffer ``tensors``."""
    mods = _FLEX_MODS.get(key)
    if mods is None:
        raise RuntimeError(
            f"cpcompile::flex_cp_attention: no mask_mod/score_mod registered under {key!r}; compile the model with "
            "cpcompile.backend in the process that runs it"
        )

    def args(slots):
        return tuple(tensors[i].contiguous() if kind == "tensor" else i for kind, i in slots)

    return BoundMods(mods, args(mods.mask_slots), args(mods.score_slots), seq_len, heads)
