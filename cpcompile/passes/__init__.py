"""Graph passes of cpcompile.

Shared plumbing (:mod:`cpcompile.passes.common`): :class:`PassContext`, :data:`counters`.

Main API: :func:`cp_attention_pass` (rewrite every SDPA call into all-gather-KV context-parallel attention)
and its building blocks :func:`find_sdpa_sites`, :func:`check_site`, :func:`site_window`, :func:`rewrite_site`,
plus :func:`find_non_sdpa_attention` (attention the pass refuses under CP), with the model's masks proved or
refused by :mod:`cpcompile.passes.mask_rules` (the pass is :mod:`cpcompile.passes.sdpa_cp`, its find, check and
reports :mod:`~cpcompile.passes.sdpa_sites`, :mod:`~cpcompile.passes.sdpa_check`,
:mod:`~cpcompile.passes.sdpa_report`); :func:`positions_pass` (positions
the model computes from the local sequence length: rewritten to global token indices, left to the mask, or
refused) and its building blocks :func:`sequence_length`, :func:`find_position_sources`, :func:`check_source`,
:func:`rewrite_source`; :func:`mixing_pass` (every other op that mixes tokens along the sequence: run on the
whole sequence, accounted for, or refused) and its building blocks :func:`find_mixing_ops`, :func:`check_op`,
:func:`rewrite_region` (the package :mod:`cpcompile.passes.mixing`: find, causal regions, check), with the op
tables of :mod:`cpcompile.passes.vocabulary` and the sequence dims of :mod:`cpcompile.passes.sequence_dims`;
:func:`flex_cp_pass` (every flex_attention call: its mods at global indices, or refused) with
:func:`find_flex_sites` (its ``check_site``/``rewrite_site`` stay in :mod:`cpcompile.passes.flex_cp`, apart from
the SDPA pass's).
"""

from cpcompile.passes import mixing, positions, sdpa_cp
from cpcompile.passes.common import PassContext, counters
from cpcompile.passes.flex_cp import FlexSite, find_flex_sites, flex_cp_pass
from cpcompile.passes.mixing import *  # noqa: F403
from cpcompile.passes.positions import *  # noqa: F403 - the package exports what its modules declare
from cpcompile.passes.sdpa_cp import *  # noqa: F403

__all__ = [
    "PassContext",
    "counters",
    "FlexSite",
    "find_flex_sites",
    "flex_cp_pass",
    *mixing.__all__,
    *positions.__all__,
    *sdpa_cp.__all__,
]
