"""Graph passes of cpcompile.

Main API: :func:`cp_attention_pass` (rewrite every SDPA call into all-gather-KV context-parallel attention)
and its building blocks :func:`find_sdpa_sites`, :func:`check_site`, :func:`site_window`, :func:`rewrite_site`,
plus :func:`find_non_sdpa_attention` (attention the pass refuses under CP); :func:`positions_pass` (positions
the model computes from the local sequence length: rewritten to global token indices, left to the mask, or
refused) and its building blocks :func:`sequence_length`, :func:`find_position_sources`, :func:`check_source`,
:func:`rewrite_source`.
"""

from cpcompile.passes.positions import (
    PositionCheck,
    PositionReport,
    PositionSource,
    SequenceLength,
    UnsupportedPositionError,
    check_source,
    find_position_sources,
    positions_pass,
    rewrite_source,
    sequence_length,
)
from cpcompile.passes.sdpa_cp import (
    SDPASite,
    SiteReport,
    UnsupportedAttentionError,
    check_site,
    config_window,
    counters,
    cp_attention_pass,
    find_non_sdpa_attention,
    find_sdpa_sites,
    graph_windows,
    rewrite_site,
    site_window,
)

__all__ = [
    "PositionCheck",
    "PositionReport",
    "PositionSource",
    "SequenceLength",
    "UnsupportedPositionError",
    "check_source",
    "find_position_sources",
    "positions_pass",
    "rewrite_source",
    "sequence_length",
    "SDPASite",
    "SiteReport",
    "UnsupportedAttentionError",
    "check_site",
    "config_window",
    "counters",
    "cp_attention_pass",
    "find_non_sdpa_attention",
    "find_sdpa_sites",
    "graph_windows",
    "rewrite_site",
    "site_window",
]
