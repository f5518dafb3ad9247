"""flex_attention BlockMasks in the batch handed to :func:`cpcompile.shard`, built for the whole sequence.

torchtitan's trainer builds its attention masks outside the model, from the global ``positions``
(``model.get_attention_masks(positions)``: a ``BlockMask``, or a dict of them for models with several mask
kinds). Such a mask means, through its ``mask_mod`` and the tensors it reads (document ids, document starts or
ends by token, all of the global length), exactly what the one-process run means, *at global indices*: which is
how a rewritten flex site (:mod:`cpcompile.passes.flex_cp`) evaluates it. What does not fit a rank is the mask's
length: flex refuses a BlockMask built for ``T`` tokens on queries of ``c``, and its block tables describe the
whole sequence's blocks, not a rank's.

So :func:`shard` hands the model, for every such value, a BlockMask of the same ``mask_mod`` over one block as
long as any sequence (flex's own "no block tables" form: flex then checks no length against it, so changing
lengths compile nothing new), and the rewritten site evaluates the ``mask_mod`` at the global indices of this
rank's queries and of every key. :func:`check_block_masks` refuses, before anything is communicated, the masks
that cannot be read this way: one built for another length or batch size, a BlockMask whose mask lives only in
its block tables (``BlockMask.from_kv_blocks`` without a ``mask_mod``) and a sliced one.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import torch

from cpcompile import _compat

__all__ = ["block_mask_tensors", "check_block_masks", "is_block_masks", "local_block_masks"]

#: The fix every refusal of :func:`check_block_masks` names.
_FIX = (
    "build it for the whole global batch before cpcompile.shard, from the batch's global position_ids (torchtitan: "
    "model.get_attention_masks(batch['position_ids'])), or build it inside the compiled forward from the local "
    "batch (docs/flex.md)"
)


def _block_mask_type() -> type | None:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # pragma: no cover - torch without flex attention
        return None
    return BlockMask


def _masks(value: object) -> dict[str, object] | None:
    """``{suffix: BlockMask}`` of a BlockMask (suffix ``""``) or of a non-empty dict of them, else ``None``."""
    kind = _block_mask_type()
    if kind is None:
        return None
    if isinstance(value, kind):
        return {"": value}
    if isinstance(value, Mapping) and value and all(isinstance(v, kind) for v in value.values()):
        return {f"[{k!r}]": v for k, v in value.items()}
    return None


def is_block_masks(value: object) -> bool:
    """Whether a batch value is a flex_attention ``BlockMask`` or a non-empty dict of them (torchtitan's
    ``AttentionMasksType`` for models with several mask kinds)."""
    return _masks(value) is not None


def check_block_masks(batch: Mapping[str, object], batch_size: int, seq_len: int) -> None:
    """Raise ``ValueError`` when a BlockMask of ``batch`` cannot be evaluated at global indices: built for a
    length other than the batch's ``seq_len`` (both ways), for another batch size than ``batch_size`` (or 1),
    without a ``mask_mod``, or sliced."""
    for key, value in batch.items():
        for suffix, mask in (_masks(value) or {}).items():
            _check(f"batch[{key!r}]{suffix}", mask, batch_size, seq_len)


def _check(name: str, mask, batch_size: int, seq_len: int) -> None:
    from torch.nn.attention.flex_attention import noop_mask

    if _compat.is_sliced_block_mask(mask):
        raise ValueError(f"{name} is a sliced BlockMask, whose mask_mod is gone; {_FIX}")
    if mask.mask_mod is noop_mask and tuple(mask.BLOCK_SIZE) != (_compat.FLEX_NO_TABLES_BLOCK,) * 2:
        raise ValueError(
            f"{name} is a BlockMask without a mask_mod (BlockMask.from_kv_blocks): its mask lives only in its "
            "block tables, which cpcompile cannot map to this rank's tokens; build it with "
            "create_block_mask(mask_mod, ...) so that its mask_mod says which keys each query sees"
        )
    if tuple(mask.seq_lengths) != (seq_len, seq_len):
        raise ValueError(
            f"{name} is a BlockMask for (q_len, kv_len) = {tuple(mask.seq_lengths)}, but the batch holds "
            f"{seq_len} tokens per row; cpcompile evaluates its mask_mod at the global indices of every rank's "
            f"tokens, so it must be built for ({seq_len}, {seq_len}): {_FIX}"
        )
    rows = mask.kv_num_blocks.shape[0]
    if rows not in (1, batch_size):
        raise ValueError(
            f"{name} is a BlockMask for {rows} rows, but the batch has {batch_size}; build it for the batch's "
            f"rows (or for 1, shared by all rows): {_FIX}"
        )


def local_block_masks(value: object) -> object:
    """``value`` (a BlockMask or a dict of them, checked by :func:`check_block_masks`) with every BlockMask
    replaced by one of the same ``mask_mod`` over a single block as long as any sequence (flex's form for "no
    block tables"), which flex accepts for this rank's queries of any length."""

    def local(mask):
        rows, heads = mask.kv_num_blocks.shape[:2]
        return _compat.flex_no_tables_mask(mask.mask_mod, rows, heads, mask.kv_num_blocks.device)

    if isinstance(value, Mapping):
        return {k: local(v) for k, v in value.items()}
    return local(value)


def block_mask_tensors(key: str, value: object) -> dict[str, torch.Tensor]:
    """The tensors that decide what ``batch[key]``'s BlockMasks mean, by name, for the batch fingerprint: the
    block tables and every tensor the ``mask_mod`` reads through its closure (document ids, document starts)."""
    found: dict[str, torch.Tensor] = {}
    for suffix, mask in (_masks(value) or {}).items():
        name = f"{key}{suffix}"
        for table in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            t = getattr(mask, table, None)
            if isinstance(t, torch.Tensor):
                found[f"{name}.{table}"] = t
        for i, t in enumerate(_closure_tensors(mask.mask_mod)):
            found[f"{name}.mask_mod[{i}]"] = t
    return found


def _closure_tensors(fn: object, depth: int = 0) -> list[torch.Tensor]:
    """Tensors a function reads through its closure, and through the closures of functions it closes over (the
    mask mods ``and_masks``/``or_masks`` combine), in a fixed order."""
    if depth > 8 or not isinstance(fn, types.FunctionType) or not fn.__closure__:
        return []
    found: list[torch.Tensor] = []
    for cell in fn.__closure__:
        try:
            items = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        for item in items if isinstance(items, (tuple, list)) else (items,):
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif isinstance(item, types.FunctionType):
                found.extend(_closure_tensors(item, depth + 1))
    return found
