"""Rewrite every ``scaled_dot_product_attention`` call of a Dynamo graph into all-gather-KV CP attention.

find -> check -> rewrite:

* :func:`find_sdpa_sites` walks the graph and returns one :class:`SDPASite` per SDPA call;
* :func:`check_site` returns a one-line reason when a site cannot be reproduced exactly across ranks;
* :func:`rewrite_site` replaces the call (pattern below);
* :func:`cp_attention_pass` is the entry point the backend runs on every graph.
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
from collections import Counter

import torch
import torch.fx as fx

from cpcompile import _compat

__all__ = [
    "SDPASite",
    "SiteReport",
    "UnsupportedAttentionError",
    "counters",
    "find_sdpa_sites",
    "check_site",
    "rewrite_site",
    "cp_attention_pass",
]

#: Rewrite statistics, summed over every graph any cpcompile backend compiled in this process:
#: ``sdpa_found``, ``sdpa_rewritten``, ``sdpa_refused``, ``graphs``, ``graphs_without_sdpa``.
counters: Counter[str] = Counter()

_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


class UnsupportedAttentionError(_compat.PassThroughCompileError):
    """An attention call that cpcompile cannot run across CP ranks with exactly the model's semantics.

    Raised while compiling; ``torch.compile`` passes it to the caller unchanged (a ``RuntimeError``).
    """


@dataclasses.dataclass(frozen=True)
class SDPASite:
    """One ``scaled_dot_product_attention`` call found in a graph."""

    node: fx.Node
    query: fx.Node
    key: fx.Node
    value: fx.Node
    attn_mask: fx.Node | None
    dropout_p: object
    is_causal: object
    scale: object
    enable_gqa: object
    #: Qualified name of the module that made the call (``model.layers.0.self_attn``), or ``""``.
    layer: str

    def meta(self, arg: fx.Node | None) -> torch.Tensor | None:
        """The example (fake) tensor Dynamo recorded for ``arg``."""
        if not isinstance(arg, fx.Node):
            return None
        return arg.meta.get("example_value", arg.meta.get("val"))

    @property
    def mask_form(self) -> str:
        """How the call expresses its mask: ``bool-mask``, ``float-mask``, ``is_causal`` or ``none``."""
        if self.attn_mask is None:
            return "is_causal" if self.is_causal is True else "none"
        m = self.meta(self.attn_mask)
        return "bool-mask" if m is not None and m.dtype == torch.bool else "float-mask"

    @property
    def where(self) -> str:
        """A human-readable location: the layer name and the graph node."""
        return f"{self.layer or '<top level>'} (node {self.node.name})"


@dataclasses.dataclass(frozen=True)
class SiteReport:
    """What the pass did with one site (read by tests and the inspect tool)."""

    graph_id: int
    node: str
    layer: str
    q_shape: tuple
    k_shape: tuple
    v_shape: tuple
    dtype: str
    mask_form: str
    enable_gqa: bool
    #: The model's key/value heads: of the ``repeat_kv`` source when SDPA got expanded K/V, else of K.
    kv_heads: int
    #: Shapes of the local tensors all-gathered over the CP group per call (K then V); empty unless rewritten.
    gathered_shapes: tuple
    action: str  # "rewritten" | "refused" | "untouched"
    reason: str = ""


def find_sdpa_sites(gm: fx.GraphModule) -> list[SDPASite]:
    """Every SDPA call of ``gm``, in graph order."""
    sites = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _compat.SDPA_TARGETS:
            continue
        bound = dict(_SDPA_DEFAULTS)
        bound.update(zip(_SDPA_PARAMS, node.args))
        bound.update(node.kwargs)
        sites.append(
            SDPASite(
                node=node,
                query=bound["query"],
                key=bound["key"],
                value=bound["value"],
                attn_mask=bound["attn_mask"],
                dropout_p=bound["dropout_p"],
                is_causal=bound["is_causal"],
                scale=bound["scale"],
                enable_gqa=bound["enable_gqa"],
                layer=_compat.node_module_path(node),
            )
        )
    return sites


def check_site(site: SDPASite) -> str | None:
    """``None`` when the site can be rewritten exactly, else a one-line reason saying what to do."""
    if isinstance(site.dropout_p, fx.Node) or not isinstance(site.dropout_p, numbers.Number):
        return "dropout_p is computed at run time; use a constant 0.0 (attention_dropout=0 or model.eval())"
    if site.dropout_p != 0.0:
        return (
            f"attention dropout p={site.dropout_p} cannot be reproduced across ranks; set the model's "
            "attention_dropout to 0.0"
        )
    if not isinstance(site.is_causal, bool) or not isinstance(site.enable_gqa, bool):
        return "is_causal/enable_gqa are computed at run time; cpcompile needs them as constants"
    if site.scale is not None and not isinstance(site.scale, numbers.Number):
        return "the softmax scale is a run-time value; cpcompile needs a constant scale"
    q, k, v = (site.meta(n) for n in (site.query, site.key, site.value))
    if q is None or k is None or v is None:
        return "query/key/value have no recorded shapes (not a Dynamo graph?)"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"expected 4-D [B, H, T, D] query/key/value, got {q.dim()}-D/{k.dim()}-D/{v.dim()}-D"
    if not _compat.statically_true(q.shape[2] == k.shape[2]):
        return (
            f"query length {q.shape[2]} differs from key length {k.shape[2]} (cross-attention or a KV cache); "
            "call the model with use_cache=False and self-attention only"
        )
    if site.attn_mask is None:
        if site.is_causal is not True:
            return (
                "non-causal attention without a mask (bidirectional); cpcompile supports causal attention "
                "(is_causal=True or a causal bool mask)"
            )
        return None
    if site.is_causal:
        return "both attn_mask and is_causal=True are given; SDPA rejects this combination"
    m = site.meta(site.attn_mask)
    if m is None:
        return "the attention mask has no recorded shape"
    if m.dtype != torch.bool:
        return (
            f"the attention mask is a {m.dtype} additive bias, which cpcompile cannot rebuild for keys of other "
            "ranks; use a bool mask (transformers attn_implementation='sdpa', no custom bias)"
        )
    if m.dim() != 4 or not _compat.statically_true(m.shape[1] == 1):
        return f"expected a [B, 1, T, T] bool mask, got shape {tuple(m.shape)} (per-head masks are not supported)"
    return None


@dataclasses.dataclass(frozen=True)
class _KVSource:
    """What a site all-gathers: the K/V nodes, and whether they are the un-expanded KV heads."""

    key: fx.Node
    value: fx.Node
    #: True when ``key``/``value`` are the sources of transformers' ``repeat_kv`` (so attention uses GQA).
    unexpanded: bool


def _repeat_kv_source(node: fx.Node) -> tuple[fx.Node, int] | None:
    """``(src, n_rep)`` when ``node`` is transformers' ``repeat_kv(src, n_rep)`` as Dynamo records it.

    Pattern (``modeling_llama.repeat_kv``)::

        e = src[:, :, None, :, :]                     # [B, Hkv, 1, T, D]
        e = e.expand(B, Hkv, n_rep, T, D)
        node = e.reshape(B, Hkv * n_rep, T, D)

    Matched on the recorded shapes, so index spelling does not matter.
    """
    if node.op != "call_method" or node.target not in ("reshape", "view") or not node.args:
        return None
    exp = node.args[0]
    if not isinstance(exp, fx.Node) or exp.op != "call_method" or exp.target != "expand" or not exp.args:
        return None
    unsq = exp.args[0]
    if not isinstance(unsq, fx.Node) or unsq.op != "call_function" or unsq.target is not operator.getitem:
        return None
    src = unsq.args[0]
    if not isinstance(src, fx.Node):
        return None
    vals = [n.meta.get("example_value") for n in (src, unsq, exp, node)]
    if any(not isinstance(t, torch.Tensor) for t in vals):
        return None
    s, u, e, r = (tuple(t.shape) for t in vals)
    if len(s) != 4 or len(u) != 5 or len(e) != 5 or len(r) != 4:
        return None
    same = _compat.statically_true
    B, Hkv, T, D = s
    if not (u[2] == 1 and all(same(a == b) for a, b in zip(u[:2] + u[3:], s))):
        return None
    n_rep = e[2]
    if not (isinstance(n_rep, int) and all(same(a == b) for a, b in zip(e[:2] + e[3:], s))):
        return None
    if not all(same(a == b) for a, b in zip(r, (B, Hkv * n_rep, T, D))):
        return None
    return src, n_rep


def kv_source(site: SDPASite) -> _KVSource:
    """The tensors a site should all-gather: the KV-head sources of ``repeat_kv`` when both K and V come from
    it with the same factor (the gather then moves KV-head bytes, not query-head bytes), else K and V."""
    k, v = _repeat_kv_source(site.key), _repeat_kv_source(site.value)
    if site.enable_gqa is False and k is not None and v is not None and k[1] == v[1]:
        return _KVSource(k[0], v[0], unexpanded=True)
    return _KVSource(site.key, site.value, unexpanded=False)


def _start_point(graph: fx.Graph, src: fx.Node) -> fx.Node:
    """The node after which a collective on ``src`` can be issued (after all placeholders)."""
    if src.op != "placeholder":
        return src
    last = src
    for n in graph.nodes:
        if n.op == "placeholder":
            last = n
    return last


def rewrite_site(
    gm: fx.GraphModule,
    site: SDPASite,
    *,
    site_id: str,
    group_name: str,
    cp_size: int,
    regather_kv: bool = False,
) -> fx.Node:
    """Replace one SDPA call by all-gather-KV attention under the plan's mask.

    Before (transformers: K/V expanded by ``repeat_kv`` to the query heads)::

        k = repeat_kv(k_src, n_rep); v = repeat_kv(v_src, n_rep)
        out = sdpa(q, k, v, attn_mask=local_mask | None, is_causal=..., scale=s)

    After::

        k_h = all_gather_start(k_src)          # right after k_src exists: overlaps with the work until attention
        v_h = all_gather_start(v_src)          # right after v_src exists
        ...                                    # q/k projections, norms, RoPE
        mask = cpcompile.plan_mask(q, k_src, v_src (detached; sizes for comm_stats), needs_grad,
                                   local_mask | None, site_id, group, N, documents, window)
        k_all = all_gather_wait(k_h)           # [B, Hkv, N*c, D]; backward: reduce-scatter of dK
        v_all = all_gather_wait(v_h)
        out = sdpa(q, k_all, v_all, attn_mask=mask, scale=s, enable_gqa=True)

    K/V are gathered with their KV heads (``enable_gqa=True`` replaces ``repeat_kv``) when both come from
    ``repeat_kv``; otherwise the tensors SDPA received are gathered. ``documents`` is True for the bool-mask
    form (transformers' packed-document mask; the op checks the model's mask against the plan's on first use)
    and False for ``is_causal=True`` (plain global causal). ``regather_kv`` tags the gathers for recomputation
    in backward, so only the local K/V are kept between forward and backward (one more all-gather per
    tensor in backward, N times less K/V memory).
    """
    graph = gm.graph
    node = site.node
    src = kv_source(site)
    started = {}
    for name, t in (("key", src.key), ("value", src.value)):
        with graph.inserting_after(_start_point(graph, t)):
            started[name] = graph.call_function(_compat.all_gather_start, (t, cp_size, group_name))
    with graph.inserting_before(node):
        refs = [graph.call_method("detach", (n,)) for n in (site.query, src.key, src.value)]
        k_meta, v_meta = site.meta(src.key), site.meta(src.value)
        needs_grad = bool(k_meta is not None and v_meta is not None and (k_meta.requires_grad or v_meta.requires_grad))
        mask = graph.call_function(
            torch.ops.cpcompile.plan_mask.default,
            (*refs, needs_grad, site.attn_mask, site_id, group_name, cp_size, site.attn_mask is not None, -1),
        )
        k_all = graph.call_function(_compat.all_gather_wait, (started["key"],))
        v_all = graph.call_function(_compat.all_gather_wait, (started["value"],))
        new = graph.call_function(
            torch.nn.functional.scaled_dot_product_attention,
            (site.query, k_all, v_all),
            {
                "attn_mask": mask,
                "dropout_p": 0.0,
                "is_causal": False,
                "scale": site.scale,
                "enable_gqa": bool(site.enable_gqa) or src.unexpanded,
            },
        )
    if regather_kv:
        for n in (*started.values(), k_all, v_all):
            n.meta.update(_compat.must_recompute_meta())
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    if src.unexpanded:
        for expanded in (site.key, site.value):
            _erase_unused_chain(graph, expanded)
    return new


def _erase_unused_chain(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and its now unused ``repeat_kv`` producers (reshape <- expand <- getitem)."""
    for _ in range(3):
        if node.users or node.op == "placeholder":
            return
        parent = node.args[0]
        graph.erase_node(node)
        if not isinstance(parent, fx.Node):
            return
        node = parent


def _shape(t: torch.Tensor | None) -> tuple:
    return () if t is None else tuple(int(s) if isinstance(s, int) else str(s) for s in t.shape)


def _report(site: SDPASite, graph_id: int, action: str, reason: str = "") -> SiteReport:
    q, k, v = (site.meta(n) for n in (site.query, site.key, site.value))
    src = kv_source(site)
    gk, gv = site.meta(src.key), site.meta(src.value)
    return SiteReport(
        graph_id=graph_id,
        node=site.node.name,
        layer=site.layer,
        q_shape=_shape(q),
        k_shape=_shape(k),
        v_shape=_shape(v),
        dtype=str(q.dtype).removeprefix("torch.") if q is not None else "?",
        mask_form=site.mask_form,
        enable_gqa=bool(site.enable_gqa),
        kv_heads=int(gk.shape[1]) if gk is not None and gk.dim() == 4 else 0,
        gathered_shapes=(_shape(gk), _shape(gv)) if action == "rewritten" else (),
        action=action,
        reason=reason,
    )


def cp_attention_pass(
    gm: fx.GraphModule,
    *,
    group_name: str,
    cp_size: int,
    graph_id: int,
    site_prefix: str,
    refuse: str = "raise",
    regather_kv: bool = False,
) -> list[SiteReport]:
    """Rewrite every SDPA site of ``gm`` in place; return one report per site.

    ``refuse="raise"`` raises :class:`UnsupportedAttentionError` for the first site that cannot be rewritten
    exactly (nothing runs wrong silently); ``refuse="report"`` only records it (for inspection, never for
    running). With ``cp_size == 1`` nothing is rewritten.
    """
    sites = find_sdpa_sites(gm)
    counters["graphs"] += 1
    counters["sdpa_found"] += len(sites)
    if not sites:
        counters["graphs_without_sdpa"] += 1
        return []
    reports = []
    for site in sites:
        reason = check_site(site)
        if reason is not None:
            counters["sdpa_refused"] += 1
            if refuse == "raise":
                raise UnsupportedAttentionError(f"cpcompile cannot run the attention at {site.where} across CP ranks: {reason}")
            reports.append(_report(site, graph_id, "refused", reason))
            continue
        if cp_size == 1:
            reports.append(_report(site, graph_id, "untouched", "CP group of size 1"))
            continue
        reports.append(_report(site, graph_id, "rewritten"))
        try:
            rewrite_site(
                gm,
                site,
                site_id=f"{site_prefix}:{site.where}",
                group_name=group_name,
                cp_size=cp_size,
                regather_kv=regather_kv,
            )
        except Exception as e:  # noqa: BLE001 - re-raised with the pass's name
            raise RuntimeError(f"cpcompile sdpa_cp pass failed while rewriting {site.where}: {e}") from e
        counters["sdpa_rewritten"] += 1
    gm.graph.lint()
    gm.recompile()
    return reports
