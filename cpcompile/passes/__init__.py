"""Graph passes of cpcompile.

Main API: :func:`cp_attention_pass` (rewrite every SDPA call into all-gather-KV context-parallel attention)
and its building blocks :func:`find_sdpa_sites`, :func:`check_site`, :func:`site_window`, :func:`rewrite_site`,
plus :func:`find_non_sdpa_attention` (attention the pass refuses under CP).
"""

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
