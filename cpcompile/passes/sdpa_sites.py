"""Find, for the SDPA pass (:mod:`cpcompile.passes.sdpa_cp`): every ``scaled_dot_product_attention`` call of a
graph (:class:`SDPASite`, :func:`find_sdpa_sites`), the K/V tensors a site exchanges (:func:`kv_source`), and
attention computed without SDPA (:func:`find_non_sdpa_attention`), which the pass refuses under CP."""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from cpcompile import _compat
from cpcompile.passes import vocabulary as vocab
from cpcompile.passes.aliasing import is_inplace, mutated, op_name, viewed_bases
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
    Any other mask as it is (see :func:`_mask_without_heads` for masks broadcast to the heads in other ways)."""
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


#: Ops that keep a mask's elements where they are (a cast, a copy), read through by :func:`_mask_without_heads`.
_HEAD_COPIES = frozenset({"contiguous", "clone", "to", "bool", "detach"})


def _one_head(n: object) -> bool:
    """Whether ``n`` has no heads dim of its own in a ``[B, H, T, T]`` broadcast: fewer than 3 dims, or size 1 at
    dim -3."""
    shape = _recorded_shape(n) if isinstance(n, fx.Node) else ()
    return shape is not None and (len(shape) < 3 or _compat.statically_true(shape[-3] == 1))


def _heads_free(n: object, made: dict, copies: list, before: fx.Node) -> object:
    """A value equal to ``n`` at every head with no heads dim of its own (:func:`_one_head`), its ops copied
    before ``before`` when it has to be made (the copies are appended to ``copies``); ``None`` when ``n`` may
    differ between heads. ``made`` maps the nodes already read to their value."""
    if not isinstance(n, fx.Node) or _one_head(n):
        return n
    if n in made:
        return made[n]
    made[n] = None
    if _written_in_place(n):
        return None  # a copy of its ops would miss the write
    name = op_name(n) if n.op in ("call_function", "call_method") else ""
    src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    found = None
    if src is not None and (name in _HEAD_BROADCASTS or name in _HEAD_COPIES):
        # a broadcast (expand, expand_as, broadcast_to) copies its input to every head; a cast keeps it
        found = _heads_free(src, made, copies, before)
    elif src is not None and name == "repeat" and _one_head(src):
        sizes = list(n.args[1:]) if not isinstance(n.args[1], (tuple, list)) else list(n.args[1])
        shape = _recorded_shape(src)
        # tiles only along the heads dim: every head a copy of the one
        if shape is not None and len(sizes) == len(shape) == 4 and all(sizes[d] == 1 for d in (0, 2, 3)):
            found = src
    elif name in vocab.ELEMENTWISE and not is_inplace(name) and name not in _RANDOM:
        inputs = n.all_input_nodes
        free = {i: _heads_free(i, made, copies, before) for i in inputs}
        if all(v is not None for v in free.values()) and any(free[i] is not i for i in inputs):
            with n.graph.inserting_before(before):
                found = n.graph.node_copy(n, lambda a: free.get(a, a))
            copies.append(found)
            value = _evaluate(found)
            if value is None:
                found = None
            else:
                found.meta["example_value"] = value
    made[n] = found
    return found


def _written_in_place(n: fx.Node) -> bool:
    """Whether an op of the graph writes in place into ``n`` or a view of it."""
    for u in n.graph.nodes:
        target = mutated(u)
        if target is not None and u is not n and n in viewed_bases(target):
            return True
    return False


#: Element-wise ops that draw random numbers: a copy would draw other numbers.
_RANDOM = frozenset({"dropout", "alpha_dropout", "feature_alpha_dropout", "bernoulli"})


def _evaluate(n: fx.Node) -> torch.Tensor | None:
    """The (fake) value of a node copied from another: its op run on its inputs' recorded values."""
    args, kwargs = fx.node.map_arg((n.args, n.kwargs), node_value)
    try:
        if n.op == "call_method":
            return getattr(args[0], n.target)(*args[1:], **kwargs)
        return n.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a value that cannot be recomputed: the mask is left as it was
        return None


def _mask_without_heads(sdpa: fx.Node, mask: object) -> object:
    """The site's mask with no heads dim when a ``[B, H, T, T]`` mask is the same for every head.

    Libraries broadcast one ``[B, 1, T, T]`` (or ``[T, T]``) mask to the heads and go on from there:
    x-transformers' ``mask.expand(B, H, T, T) & ~causal_mask``, ``mask.repeat(1, H, 1, 1)``,
    ``mask[:, None].expand(-1, H, -1, -1) & causal``. The mask's element-wise ops are copied onto the
    broadcasts' inputs (``mask & ~causal_mask`` on the ``[B, 1, T, T]`` mask), the call gets that ``[B, 1, T, T]``
    mask (the same values at every head, by broadcasting) and the ``[B, H, T, T]`` ops no longer used are
    removed. A mask that may differ between heads (a value with its own heads dim that is not a broadcast, a
    random op) is left as it is, and the site refuses it.
    """
    if not isinstance(mask, fx.Node):
        return mask
    plain = _one_mask_for_all_heads(mask)
    shape = _recorded_shape(mask)
    if plain is not mask or shape is None or len(shape) != 4 or _one_head(mask):
        return plain
    made: dict = {}
    copies: list = []
    free = _heads_free(mask, made, copies, sdpa)
    out = _recorded_shape(free) if isinstance(free, fx.Node) else None
    same_rows = out is not None and len(out) == 4 and all(_compat.statically_true(out[d] == shape[d]) for d in (2, 3))
    if not same_rows:
        _erase_unused(reversed(copies))
        return mask
    if "attn_mask" in sdpa.kwargs:
        sdpa.update_kwarg("attn_mask", free)
    else:
        sdpa.update_arg(_SDPA_PARAMS.index("attn_mask"), free)
    _erase_unused([n for n in reversed(list(mask.graph.nodes)) if n in made])
    return free


def _erase_unused(nodes) -> None:
    """Erase the nodes of ``nodes`` (users before their inputs) that nothing uses (pure mask ops)."""
    for n in nodes:
        if not n.users and n.op in ("call_function", "call_method"):
            n.graph.erase_node(n)


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
                attn_mask=_mask_without_heads(node, bound["attn_mask"]),
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
