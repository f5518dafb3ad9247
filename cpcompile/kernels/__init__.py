"""Attention kernels that compute only the visible (query block, key block) pairs of a CP rank.

Main API: :func:`cp_attention` (the op ``torch.ops.cpcompile.cp_attention``, with autograd), its dense
reference :func:`dense_cp_attention`, :func:`flex_cp_attention` (a flex_attention site's mods in the same
loop), :func:`block_schedule` (the block pairs the CPU kernel visits) and :func:`varlen_layout` (the flash-attn
varlen segments of the CUDA path). The package exports exactly what :mod:`cpcompile.kernels.attention` declares
in its ``__all__``.
"""

from cpcompile.kernels import attention
from cpcompile.kernels.attention import *  # noqa: F403 - one list of public names, in attention.py

__all__ = attention.__all__
