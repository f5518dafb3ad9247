"""Rewrite every ``scaled_dot_product_attention`` call of a Dynamo graph into all-gather-KV CP attention.

find -> check -> rewrite:

* :func:`find_sdpa_sites` walks the graph and returns one :class:`SDPASite` per SDPA call, and
  :func:`find_non_sdpa_attention` the attention computed without it (:mod:`cpcompile.passes.sdpa_sites`);
* :func:`check_site` returns a one-line reason when a site cannot be reproduced exactly across ranks, and
  :func:`site_window` the site's sliding window or the reason to refuse it (:mod:`cpcompile.passes.sdpa_check`);
* :func:`rewrite_site` replaces the call (pattern in its docstring), emitting the ops of :mod:`cpcompile.ops`;
* :func:`cp_attention_pass` is the entry point the backend runs on every graph, with one :class:`PassContext`,
  returning one :class:`SiteReport` per site (:mod:`cpcompile.passes.sdpa_report`).

This module holds the rewrite and the entry point; every name of ``__all__`` is importable from here.
"""

from __future__ import annotations

import torch.fx as fx

from cpcompile import _compat, ops
from cpcompile.errors import UnsupportedAttentionError
from cpcompile.layouts import MAX_RUNS
from cpcompile.passes.aliasing import last_write
from cpcompile.passes.common import PassContext, counters, finish, node_located, size_hint
from cpcompile.passes.mask_rules import MaskProof, outer_arguments
from cpcompile.passes.sdpa_check import (
    _config_reason,
    _kernel_reason,
    _non_sdpa_reason,
    check_site,
    config_window,
    graph_windows,
    site_window,
)
from cpcompile.passes.sdpa_check import mask_proof as mask_proof
from cpcompile.passes.sdpa_report import SiteReport, _refused_report, _report, site_spec
from cpcompile.passes.sdpa_sites import SDPASite, find_non_sdpa_attention, find_sdpa_sites, kv_source
from cpcompile.runtime.workload import record_attention_form

__all__ = [
    "SDPASite",
    "SiteReport",
    "find_sdpa_sites",
    "check_site",
    "graph_windows",
    "config_window",
    "site_window",
    "find_non_sdpa_attention",
    "rewrite_site",
    "cp_attention_pass",
]


def rewrite_site(gm: fx.GraphModule, site: SDPASite, spec: ops.SiteSpec, ctx: PassContext) -> fx.Node:
    """Replace one SDPA call by all-gather-KV attention under the plan's mask (ops of :mod:`cpcompile.ops`).

    Before (transformers: K/V expanded by ``repeat_kv`` to the query heads)::

        k = repeat_kv(k_src, n_rep); v = repeat_kv(v_src, n_rep)
        out = sdpa(q, k, v, attn_mask=local_mask | None, is_causal=..., scale=s)

    After::

        ok = cpcompile::site_check(v_src (detached), local_mask | None, site)  # right after the first of K/V
        v_h = all_gather_start(v_src)          # right after v_src exists and the check passed
        k_h = all_gather_start(k_src)          # right after k_src exists: overlaps with the work until attention
        ...                                    # e.g. q/k norms and RoPE
        q_pos, kv_pos, docs = cpcompile::site_plan(k_src, v_src (detached), ok, site)
        k_all = all_gather_wait(k_h)           # [B, Hkv, N*c, D]; backward: reduce-scatter of dK
        v_all = all_gather_wait(v_h)
        out = sdpa(q, k_all, v_all, attn_mask=visible_mask(q_pos, kv_pos, docs, window), scale=s,
                   enable_gqa=True)            # spec.kernel == "dense"
        out = cpcompile::cp_attention(q, k_all, v_all, q_pos, kv_pos, docs, window, s, True, ...)[0]  # "block"

    A sliding-window site with ``spec.exchange == "halo"`` receives only its halo instead, a full-attention
    site with ``spec.exchange == "selective"`` only the keys its queries see (see :mod:`cpcompile.ops`):
    ``k_all = cat([k_src, halo_exchange(k_src, ...)], dim=2)``, likewise for V.

    K/V are gathered with their KV heads (``enable_gqa=True`` replaces ``repeat_kv``) when both come from
    ``repeat_kv``; otherwise the tensors SDPA received are gathered. ``site_check`` (the active plan, the mask
    check, the site's control round) comes before the site's collectives are issued, as early as the first of K
    and V and the model's mask exist: a check that fails raises on every rank with nothing in flight.
    ``regather_kv_in_backward`` tags the gathers (or the halo / selective exchanges) for recomputation in
    backward, so only the local K/V (and the exchange's routing) are kept between forward and backward. With
    ``cp_size == 1`` (block kernel only) nothing is gathered.
    """
    node = site.node
    graph = node.graph
    src = kv_source(site)
    k_src, v_src = (_heads_first(graph, t, src.layout) for t in (src.key, src.value))
    gather = spec.cp_size > 1 and spec.exchange == "all_gather"
    ready = [(t, last_write(t)) for t in (k_src, v_src)]  # K and V may be one tensor
    checked = ops.emit_site_check(graph, ready, site.attn_mask, spec)
    started = [ops.emit_gather_start(graph, t, spec, ops.last_of([w, checked])) for t, w in ready] if gather else []
    with graph.inserting_before(node):
        positions = ops.emit_site_plan(graph, k_src, v_src, checked, spec)
        if gather:
            k_all, v_all = (graph.call_function(_compat.all_gather_wait, (h,)) for h in started)
        elif spec.exchange in ops.EXCHANGES_OF_NEEDED_KEYS:
            k_all, v_all = ops.emit_halo_exchange(graph, k_src, v_src, spec)
        else:
            k_all, v_all = k_src, v_src
        new = ops.emit_attention(
            graph,
            spec,
            site.query,
            k_all,
            v_all,
            positions,
            scale=site.scale,
            enable_gqa=bool(site.enable_gqa) or src.unexpanded,
            block_size=ctx.options.block_size,
        )
    if ctx.options.regather_kv_in_backward and gather:
        for n in (*started, k_all, v_all):
            n.meta.update(_compat.must_recompute_meta())
    elif ctx.options.regather_kv_in_backward and spec.cp_size > 1 and spec.exchange in ops.EXCHANGES_OF_NEEDED_KEYS:
        ops.recompute_exchange(k_all, v_all)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    if src.unexpanded:
        for expanded, source in ((site.key, src.key), (site.value, src.value)):
            _erase_unused_chain(graph, expanded, source)
    return new


def _heads_first(graph: fx.Graph, t: fx.Node, layout: str) -> fx.Node:
    """``t`` as ``[B, Hkv, T, D]``: itself, or (``"bthd"``) ``t.transpose(1, 2)`` inserted right after ``t``."""
    if layout == "bhtd":
        return t
    with graph.inserting_after(t):
        return graph.call_method("transpose", (t, 1, 2))


def _kernel_for(site: SDPASite, attention: str) -> str:
    """``"auto"`` is the block loop on every device (memory bounded by blocks, and the code the CPU tests run);
    the other paths are taken as given."""
    return "block" if attention == "auto" else attention


def _erase_unused_chain(graph: fx.Graph, node: fx.Node, source: fx.Node) -> None:
    """Erase ``node`` and its now unused producers up to ``source`` (the KV-head expansion chain)."""
    while node is not source and not node.users and node.op != "placeholder":
        parent = node.args[0]
        graph.erase_node(node)
        if not isinstance(parent, fx.Node):
            return
        node = parent


def _refusal(where: str, reason: str) -> UnsupportedAttentionError:
    return UnsupportedAttentionError(f"cpcompile cannot run the attention at {where} across CP ranks: {reason}")


def _exchange(site: SDPASite, ctx: PassContext, window: int | None) -> dict:
    """``exchange``/``halo_slots`` of a site: a halo of ``MAX_RUNS * (window - 1)`` key slots for a sliding-window
    site when that is fewer keys than the all-gather's ``(N - 1) * c`` (at this compilation's length; with a
    dynamic length the choice stays correct for every length, only less economical), else the all-gather. A
    full-attention site with ``exchange="selective"``: the selective exchange into ``exchange_slots`` key slots
    (``0``: ``(N - 1) * c``, whatever the length)."""
    if ctx.cp_size == 1:
        return {}
    if window is None:
        if ctx.options.exchange != "selective":
            return {}
        return {"exchange": "selective", "halo_slots": ctx.options.exchange_slots or 0}
    if not ctx.options.halo:
        return {}
    slots = MAX_RUNS * (window - 1)
    k = site.meta(site.key)
    local_len = size_hint(k.shape[2], strict=True) if k is not None else 0
    if slots >= (ctx.cp_size - 1) * local_len:
        return {}
    return {"exchange": "halo", "halo_slots": slots}


def _site_spec(site: SDPASite, ctx: PassContext, window: int | None, kernel: str, proof: MaskProof) -> ops.SiteSpec:
    """The site's description and id (:func:`~cpcompile.passes.sdpa_report.site_spec`).

    ``documents`` (the same-document condition, which the step check, the plan's positions and document ids, the
    halo and selective exchanges all read from the spec) follows the model's mask: none with ``is_causal=True``,
    none for a mask proved to have no document condition (``proof``: :func:`mask_proof`; ``k <= q`` of ``arange``
    attends across packed documents), else applied (a mask with one, or one made elsewhere that the step check
    compares with that rule).
    """
    k_meta, v_meta = (site.meta(n) for n in (kv_source(site).key, kv_source(site).value))
    return site_spec(
        ctx,
        site.node,
        layer=site.layer,
        documents=site.attn_mask is not None and proof.documents,
        documents_assumed=site.attn_mask is not None and proof.documents and proof.assumed,
        window=window,
        kernel=kernel,
        needs_grad=bool(k_meta is not None and v_meta is not None and (k_meta.requires_grad or v_meta.requires_grad)),
        **_exchange(site, ctx, window),
    )


def cp_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> list[SiteReport]:
    """Rewrite every SDPA site of ``gm`` (and of its nested graphs) in place; return one report per site.

    ``ctx.refuse == "raise"`` raises :class:`UnsupportedAttentionError` for the first site that cannot be
    rewritten exactly (nothing runs wrong silently); ``"report"`` only records it (for inspection, never for
    running). ``ctx.options.attention`` (see :func:`_kernel_for`)
    selects the attention emitted. With ``cp_size == 1`` nothing is rewritten, except with ``attention="block"``.

    With CP > 1 the pass also refuses attention that is not an SDPA call (:func:`find_non_sdpa_attention`)
    and, when the model config is given, a config whose attention implementation is not ``"sdpa"`` or that
    soft-caps attention logits. Sliding windows come from :func:`site_window`. A graph without any attention
    (e.g. an MLP) passes through untouched.
    """
    sites = find_sdpa_sites(gm)
    counters["graphs"] += 1
    counters["sdpa_found"] += len(sites)
    config = ctx.options.config
    reports: list[SiteReport] = []

    def refuse(where: str, reason: str, report: SiteReport) -> None:
        if ctx.refuse == "raise":
            raise _refusal(where, reason)
        reports.append(report)

    if ctx.cp_size > 1:
        reason = _config_reason(config)
        if reason is not None:
            where = sites[0].where if sites else f"graph {ctx.graph_id}"
            refuse(where, reason, _refused_report(ctx.graph_id, "", "", reason))
        for node, layer, what in find_non_sdpa_attention(gm):
            counters["non_sdpa_attention"] += 1
            reason = _non_sdpa_reason(node, what, config)
            refuse(node_located(node), reason, _refused_report(ctx.graph_id, node.name, layer, reason))
    if not sites:
        counters["graphs_without_sdpa"] += 1
        return reports
    outer = outer_arguments(gm)
    for site in sites:
        if ctx.cp_size == 1 and ctx.options.attention != "block":
            # nothing is rewritten, so the model runs exactly as it is, whatever form its attention takes
            reports.append(_report(site, ctx.graph_id, "untouched", "CP group of size 1"))
            continue
        reason = check_site(site)
        window, kernel, proof = None, _kernel_for(site, ctx.options.attention), MaskProof()
        if reason is None:
            proof = mask_proof(site, outer)
            window, reason = site_window(site, config, proof)
        if reason is None:
            reason = _kernel_reason(site, kernel)
        if reason is not None:
            counters["sdpa_refused"] += 1
            refuse(site.located, reason, _report(site, ctx.graph_id, "refused", reason))
            continue
        spec = _site_spec(site, ctx, window, kernel, proof)
        ops.register_site(spec)
        reports.append(_report(site, ctx.graph_id, "rewritten", spec=spec))
        try:
            rewrite_site(gm, site, spec, ctx)
        except Exception as e:  # noqa: BLE001 - re-raised with the pass's name
            raise RuntimeError(f"cpcompile sdpa_cp pass failed while rewriting {site.where}: {e}") from e
        # what cpcompile.shard's balanced layout evens out: the attention forms compiled for this CP group
        layer = spec.layer or spec.site
        record_attention_form(
            spec.group_name,
            layer,
            spec.documents,
            spec.window,
            ctx.options.block_size,
            selective=spec.exchange == "selective",
        )
        counters["sdpa_rewritten"] += 1
    finish(gm)
    return reports
