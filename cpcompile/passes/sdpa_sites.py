"""Find, for the SDPA pass (:mod:`cpcompile.passes.sdpa_cp`): every ``scaled_dot_product_attention`` call of a
graph (:class:`SDPASite`, :func:`find_sdpa_sites`), the K/V tensors a site exchanges (:func:`kv_source`), and
attention computed without SDPA (:func:`find_non_sdpa_attention`), which the pass refuses under CP."""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from cpcompile import _compat
from cpcompile.passes.aliasing import op_name
from cpcompile.passes.common import FoundAt, graph_modules, node_value
from cpcompile.passes.kv_heads import KVSource
from cpcompile.passes.kv_heads import kv_source as find_kv_source

__all__ = ["SDPASite", "find_sdpa_sites", "kv_source", "find_non_sdpa_attention"]

_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


@dataclasses.dataclass(frozen=True)
class SDPASite(FoundAt):
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
    #: Whether that module is a transformers module (refusals then name transformers' settings).
    transformers: bool = False

    def meta(self, arg: fx.Node | None) -> torch.Tensor | None:
        """The example (fake) tensor Dynamo recorded for ``arg``."""
        return node_value(arg)

    @property
    def mask_form(self) -> str:
        """How the call expresses its mask: ``bool-mask``, ``float-mask``, ``is_causal`` or ``none``."""
        if self.attn_mask is None:
            return "is_causal" if self.is_causal is True else "none"
        m = self.meta(self.attn_mask)
        return "bool-mask" if m is not None and m.dtype == torch.bool else "float-mask"


_HEAD_BROADCASTS = frozenset({"expand", "expand_as", "broadcast_to"})


def _recorded_shape(n: fx.Node) -> tuple | None:
    v = node_value(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _one_mask_for_all_heads(mask: object) -> object:
    """The ``[B, 1, T, T]`` mask a ``[B, H, T, T]`` mask was expanded from (``mask.expand(B, H, T, T)``, also
    through ``expand_as``/``broadcast_to``): the same mask for every head, which the site then takes as its mask.
    Any other mask as it is (a mask that may differ between heads keeps its shape, and is refused)."""
    m = mask
    while (
        isinstance(m, fx.Node)
        and m.op in ("call_function", "call_method")
        and op_name(m) in _HEAD_BROADCASTS
        and m.args
        and isinstance(m.args[0], fx.Node)
    ):
        src = m.args[0]
        shape, out = (_recorded_shape(n) for n in (src, m))
        if shape is not None and len(shape) == 4 and _compat.statically_true(shape[1] == 1):
            same_rows = out is not None and all(_compat.statically_true(shape[d] == out[d]) for d in (2, 3))
            return src if same_rows else mask
        m = src
    return mask


def find_sdpa_sites(gm: fx.GraphModule) -> list[SDPASite]:
    """Every SDPA call of ``gm`` and of its nested graphs (e.g. checkpointed layers), in graph order."""
    sites = []
    for node in (n for g in graph_modules(gm) for n in g.graph.nodes):
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
                attn_mask=_one_mask_for_all_heads(bound["attn_mask"]),
                dropout_p=bound["dropout_p"],
                is_causal=bound["is_causal"],
                scale=bound["scale"],
                enable_gqa=bound["enable_gqa"],
                layer=_compat.node_module_path(node),
                transformers=_compat.node_module_class(node).startswith("transformers."),
            )
        )
    return sites


def kv_source(site: SDPASite) -> KVSource:
    """The tensors a site exchanges: the un-expanded KV heads when K and V are expanded from them in a spelling
    :mod:`cpcompile.passes.kv_heads` recognises (the exchange then moves KV-head bytes), else K and V."""
    return find_kv_source(site.key, site.value, site.enable_gqa)


# -- attention that is not an SDPA call -------------------------------------------------------------------
_SOFTMAX = (torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax)


def find_non_sdpa_attention(gm: fx.GraphModule) -> list[tuple[fx.Node, str, str]]:
    """Attention computed without SDPA: ``(node, layer, what)`` for every softmax over a 4-D score tensor
    ``[B, H, T_q, T_k]`` (eager attention: matmul, softmax, matmul). ``flex_attention`` calls are
    :mod:`cpcompile.passes.flex_cp`'s: rewritten, or refused there.

    Such attention would only see this rank's chunk of the sequence; the pass refuses it when CP > 1. Softmax
    over fewer dimensions (routers, the loss) is not attention and is ignored.
    """
    found = []
    for g in graph_modules(gm):
        for n in g.graph.nodes:
            is_softmax = (n.op == "call_function" and n.target in _SOFTMAX) or (
                n.op == "call_method" and n.target == "softmax"
            )
            if not is_softmax or not n.args or not isinstance(n.args[0], fx.Node):
                continue
            x = node_value(n.args[0])
            if isinstance(x, torch.Tensor) and x.dim() == 4:
                what = f"a softmax over a {x.dim()}-D attention score tensor (eager matmul/softmax attention)"
                found.append((n, _compat.node_module_path(n), what))
    return found
