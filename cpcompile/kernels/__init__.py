"""Attention kernels that compute only the visible (query block, key block) pairs of a CP rank.

Main API: :func:`cp_attention` (the op ``torch.ops.cpcompile.cp_attention``, with autograd), its dense
reference :func:`dense_cp_attention`, :func:`flex_cp_attention` (a flex_attention site's mods in the same
loop), :func:`block_schedule` (the block pairs the CPU kernel visits) and :func:`varlen_layout` (the flash-attn
varlen segments of the CUDA path). Modules: :mod:`~cpcompile.kernels.attention` (the block loop and the op),
:mod:`~cpcompile.kernels.library` (flex_attention and flash-attn varlen on CUDA),
:mod:`~cpcompile.kernels.flex_mods` and :mod:`~cpcompile.kernels.flex_site` (flex_attention sites). The package
exports the union of their ``__all__``.
"""

from cpcompile.kernels import attention, flex_mods, flex_site, library
from cpcompile.kernels.attention import *  # noqa: F403
from cpcompile.kernels.flex_mods import *  # noqa: F403
from cpcompile.kernels.flex_site import *  # noqa: F403
from cpcompile.kernels.library import *  # noqa: F403

__all__ = [*attention.__all__, *flex_mods.__all__, *flex_site.__all__, *library.__all__]
