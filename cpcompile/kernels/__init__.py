"""Attention kernels that compute only the visible (query block, key block) pairs of a CP rank.

Main API: :func:`cp_attention` (the op ``torch.ops.cpcompile.cp_attention``, with autograd), its dense
reference :func:`dense_cp_attention`, and :func:`block_schedule` (the block pairs the CPU kernel visits).
"""

from cpcompile.kernels.attention import BlockPiece, block_schedule, computed_pairs, cp_attention, dense_cp_attention

__all__ = ["BlockPiece", "block_schedule", "computed_pairs", "cp_attention", "dense_cp_attention"]
