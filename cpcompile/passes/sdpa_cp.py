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


def rewrite_site(gm: fx.GraphModule, site: SDPASite, *, site_id: str, group_name: str, cp_size: int) -> fx.Node:
    """Replace one SDPA call by all-gather-KV attention under the plan's mask.

    Before::

        out = sdpa(q, k, v, attn_mask=local_mask | None, is_causal=..., scale=s, enable_gqa=g)

    After::

        k_all = all_gather_seq(k, 2, group)        # [B, Hkv, N*c, D]; backward: reduce-scatter of dK
        v_all = all_gather_seq(v, 2, group)
        mask  = cpcompile.plan_mask(q, k, v (detached; sizes for comm_stats), needs_grad,
                                    local_mask | None, site_id, group, N, documents, window)
        out   = sdpa(q, k_all, v_all, attn_mask=mask, scale=s, enable_gqa=g)

    ``documents`` is True for the bool-mask form (transformers' packed-document mask; the op checks the
    model's mask against the plan's on first use) and False for ``is_causal=True`` (plain global causal).
    """
    graph = gm.graph
    node = site.node
    with graph.inserting_before(node):
        k_all = graph.call_function(_compat.all_gather_seq, (site.key, 2, group_name))
        v_all = graph.call_function(_compat.all_gather_seq, (site.value, 2, group_name))
        refs = [graph.call_method("detach", (n,)) for n in (site.query, site.key, site.value)]
        k_meta, v_meta = site.meta(site.key), site.meta(site.value)
        needs_grad = bool(k_meta is not None and v_meta is not None and (k_meta.requires_grad or v_meta.requires_grad))
        mask = graph.call_function(
            torch.ops.cpcompile.plan_mask.default,
            (*refs, needs_grad, site.attn_mask, site_id, group_name, cp_size, site.attn_mask is not None, -1),
        )
        new = graph.call_function(
            torch.nn.functional.scaled_dot_product_attention,
            (site.query, k_all, v_all),
            {"attn_mask": mask, "dropout_p": 0.0, "is_causal": False, "scale": site.scale, "enable_gqa": site.enable_gqa},
        )
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def _shape(t: torch.Tensor | None) -> tuple:
    return () if t is None else tuple(int(s) if isinstance(s, int) else str(s) for s in t.shape)


def _report(site: SDPASite, graph_id: int, action: str, reason: str = "") -> SiteReport:
    q, k, v = (site.meta(n) for n in (site.query, site.key, site.value))
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
        gathered_shapes=(_shape(k), _shape(v)) if action == "rewritten" else (),
        action=action,
        reason=reason,
    )


def cp_attention_pass(
    gm: fx.GraphModule, *, group_name: str, cp_size: int, graph_id: int, site_prefix: str, refuse: str = "raise"
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
                gm, site, site_id=f"{site_prefix}:{site.where}", group_name=group_name, cp_size=cp_size
            )
        except Exception as e:  # noqa: BLE001 - re-raised with the pass's name
            raise RuntimeError(f"cpcompile sdpa_cp pass failed while rewriting {site.where}: {e}") from e
        counters["sdpa_rewritten"] += 1
    gm.graph.lint()
    gm.recompile()
    return reports
