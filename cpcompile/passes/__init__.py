"""Graph passes of cpcompile.

Main API: :func:`cp_attention_pass` (rewrite every SDPA call into all-gather-KV context-parallel attention)
and its building blocks :func:`find_sdpa_sites`, :func:`check_site`, :func:`rewrite_site`.
"""

from cpcompile.passes.sdpa_cp import (
    SDPASite,
    SiteReport,
    UnsupportedAttentionError,
    check_site,
    counters,
    cp_attention_pass,
    find_sdpa_sites,
    rewrite_site,
)

__all__ = [
    "SDPASite",
    "SiteReport",
    "UnsupportedAttentionError",
    "check_site",
    "counters",
    "cp_attention_pass",
    "find_sdpa_sites",
    "rewrite_site",
]
