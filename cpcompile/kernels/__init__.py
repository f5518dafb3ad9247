"""Attention kernels that compute only the visible (query block, key block) pairs of a CP rank.

Main API: :func:`cp_attention` (the op ``torch.ops.cpcompile.cp_attention``, with autograd), its dense
reference :func:`dense_cp_attention`, :func:`block_schedule` (the block pairs the CPU kernel visits) and
:func:`varlen_layout` (the flash-attn varlen segments of the CUDA path).
"""

from cpcompile.kernels.attention import (
    BlockPiece,
    VarlenLayout,
    block_schedule,
    computed_pairs,
    cp_attention,
    dense_cp_attention,
    varlen_layout,
)

__all__ = [
    "BlockPiece",
    "VarlenLayout",
    "block_schedule",
    "computed_pairs",
    "cp_attention",
    "dense_cp_attention",
    "varlen_layout",
]
