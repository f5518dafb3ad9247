"""Rewrite every ``scaled_dot_product_attention`` call of a Dynamo graph into all-gather-KV CP attention.

find -> check -> rewrite:

* :func:`find_sdpa_sites` walks the graph and returns one :class:`SDPASite` per SDPA call;
* :func:`check_site` returns a one-line reason when a site cannot be reproduced exactly across ranks;
* :func:`rewrite_site` replaces the call (pattern in its docstring), emitting the ops of :mod:`cpcompile.ops`;
* :func:`cp_attention_pass` is the entry point the backend runs on every graph, with one :class:`PassContext`.

Refusal messages name the fix in the model's framework: transformers' settings for a transformers model (its
attention module comes from ``transformers`` or a config was given), plain torch calls otherwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
import re

import torch
import torch.fx as fx

from cpcompile import _compat, ops
from cpcompile.errors import UnsupportedAttentionError
from cpcompile.layouts import MAX_RUNS
from cpcompile.passes.aliasing import last_write, op_name
from cpcompile.passes.common import PassContext, counters, finish, graph_modules, node_value, source_line
from cpcompile.passes.kv_heads import KVSource
from cpcompile.passes.kv_heads import kv_source as find_kv_source
from cpcompile.passes.mask_rules import MaskProof, outer_arguments, prove_mask
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

_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


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

    @property
    def where(self) -> str:
        """A human-readable location: the layer name and the graph node."""
        return f"{self.layer or '<top level>'} (node {self.node.name})"

    @property
    def located(self) -> str:
        """:attr:`where`, after the model's source line (``file:line (code)``) when the graph recorded it."""
        line = source_line(self.node)
        return f"{line}, {self.where}" if line else self.where


@dataclasses.dataclass(frozen=True)
class SiteReport:
    """What the pass did with one site: the record ``backend.reports``, ``cpcompile inspect`` and dumps show.

    Shapes hold ints, or the symbol's name where the size is symbolic (``sizes`` gives every symbol's value at
    this compilation, :meth:`resolved` substitutes them); byte counts use those values.
    """

    graph_id: int
    node: str
    layer: str
    q_shape: tuple
    k_shape: tuple
    v_shape: tuple
    dtype: str
    #: ``bool-mask`` (a mask built by the model), ``float-mask``, ``is_causal`` or ``none``.
    mask_form: str
    enable_gqa: bool
    q_heads: int
    #: The model's key/value heads: of the expansion's source when SDPA got expanded K/V, else of K.
    kv_heads: int
    #: ``rewritten``, ``refused`` or ``untouched`` (CP group of size 1).
    action: str
    reason: str = ""
    #: Attention the rewrite emitted: ``"dense"`` (SDPA under the plan's mask), or cp_attention's ``"block"`` loop,
    #: ``"flex"`` or ``"flash_varlen"``.
    kernel: str = ""
    #: Sliding window of the site in tokens (``None``: none).
    window: int | None = None
    #: How the keys of other ranks arrive: ``"all_gather"``, ``"halo"`` (sliding window: only the keys the
    #: local queries see, into ``halo_slots`` key slots per K and V; bytes depend on the batch, see
    #: :meth:`cpcompile.plan.CPPlan.halo_needs`) or ``"selective"`` (full attention, ``backend(...,
    #: exchange="selective")``: the same for every key the queries see, ``halo_slots`` 0 meaning ``(N - 1) * c``);
    #: ``""`` when not rewritten or nothing is exchanged.
    exchange: str = ""
    halo_slots: int = 0
    #: Shapes of the local tensors all-gathered over the CP group per call (K then V); empty unless gathered.
    gathered_shapes: tuple = ()
    #: Whether the gathered K/V require grad (then each is reduce-scattered in backward).
    needs_grad: bool = False
    #: Bytes this rank receives per call in those all-gathers: ``(N - 1) * numel * itemsize`` of each.
    all_gather_bytes_per_call: int = 0
    #: Bytes this rank sends per call in the backward reduce-scatters (as on NCCL; gloo all-reduces instead).
    reduce_scatter_bytes_per_call: int = 0
    #: ``(symbol, value)`` of every symbolic size in the shapes, at this compilation.
    sizes: tuple[tuple[str, int], ...] = ()

    @property
    def mask_found(self) -> str:
        """The mask form with ``enable_gqa`` appended when set (``is_causal, enable_gqa``)."""
        return self.mask_form + (", enable_gqa" if self.enable_gqa else "")

    def resolved(self) -> SiteReport:
        """This report with every symbolic size replaced by its value at this compilation."""
        values = dict(self.sizes)

        def concrete(shape: tuple) -> tuple:
            return tuple(values.get(d, d) if isinstance(d, str) else d for d in shape)

        return dataclasses.replace(
            self,
            q_shape=concrete(self.q_shape),
            k_shape=concrete(self.k_shape),
            v_shape=concrete(self.v_shape),
            gathered_shapes=tuple(concrete(x) for x in self.gathered_shapes),
            sizes=(),
        )

    def to_json(self) -> dict:
        """The record as plain JSON types (tuples as lists)."""
        out = dataclasses.asdict(self)
        for key in ("q_shape", "k_shape", "v_shape"):
            out[key] = list(out[key])
        out["gathered_shapes"] = [list(x) for x in self.gathered_shapes]
        out["sizes"] = dict(self.sizes)
        return out


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


def check_site(site: SDPASite) -> str | None:
    """``None`` when the site can be rewritten exactly, else a one-line reason saying what to do."""
    no_dropout = "set the model's attention_dropout to 0.0" if site.transformers else "pass dropout_p=0.0"
    for name, arg in (("dropout_p", site.dropout_p), ("scale", site.scale)):
        value = arg.meta.get("example_value", arg.meta.get("val")) if isinstance(arg, fx.Node) else None
        if isinstance(value, (torch.SymFloat, torch.SymInt)):
            # Dynamo makes float attributes (attention_dropout, scaling) symbolic under dynamic=True, and on the
            # recompile of a frame whose float changed (automatic dynamic: another model configuration compiled
            # in the same process through the same code)
            return (
                f"the attention's {name} is symbolic (now {value}): Dynamo makes a model's float attributes "
                "symbolic under torch.compile(dynamic=True), and when it recompiles code it already compiled for "
                "another value (a second model of another configuration, e.g. another head_dim, in the same "
                "process), so cpcompile cannot prove it is the same constant on every call; compile without "
                "dynamic=True (cpcompile.shard marks the sequence length dynamic itself), and call "
                "torch.compiler.reset() before compiling a model of another configuration"
            )
    if isinstance(site.dropout_p, fx.Node) or not isinstance(site.dropout_p, numbers.Number):
        return f"dropout_p is computed at run time; {no_dropout} (or call model.eval())"
    if site.dropout_p != 0.0:
        return f"attention dropout p={site.dropout_p} cannot be reproduced across ranks; {no_dropout}"
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
        fix = "call the model with use_cache=False" if site.transformers else "call the model without a KV cache"
        return (
            f"query length {q.shape[2]} differs from key length {k.shape[2]} (cross-attention or a KV cache); "
            f"{fix} and self-attention only"
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
        fix = (
            "use attn_implementation='sdpa' without a custom bias"
            if site.transformers
            else "pass a bool attn_mask or is_causal=True"
        )
        return (
            f"the attention mask is a {m.dtype} additive bias, which cpcompile cannot rebuild for keys of other "
            f"ranks; {fix}"
        )
    if m.dim() != 4 or not _compat.statically_true(m.shape[1] == 1):
        return (
            f"expected a [B, 1, T, T] bool mask, got shape {tuple(m.shape)} (per-head masks are not supported); "
            "pass a mask that is the same for every head as [B, 1, T, T], or expand it with mask.expand(B, H, T, T)"
        )
    return None


# -- sliding windows --------------------------------------------------------------------------------------
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def mask_proof(site: SDPASite, outer: dict | None = None) -> MaskProof:
    """What the subgraph that builds the site's mask applies (:func:`cpcompile.passes.mask_rules.prove_mask`):
    its sliding windows, or why it cannot be proved. Nothing to prove without a mask built in the graph.
    ``outer`` (:func:`cpcompile.passes.mask_rules.outer_arguments`) follows a nested graph's mask input to where
    the calling graph builds it (a checkpointed layer)."""
    q = site.meta(site.query)
    if not isinstance(site.attn_mask, fx.Node) or q is None or q.dim() < 3:
        return MaskProof()
    return prove_mask(site.attn_mask, q.shape[-2], outer)


def graph_windows(site: SDPASite) -> set[int]:
    """Sliding windows written into the subgraph that builds the site's mask, in any spelling (transformers'
    ``kv > q - window``, ``(q - k) < window``, ...: :func:`mask_proof`). Empty when the mask is a graph input
    (e.g. one graph per decoder layer under FSDP2), has no window, or cannot be proved."""
    return set(mask_proof(site).windows)


def config_window(config: object, layer: str) -> tuple[int | None, str | None]:
    """``(window, None)`` for the layer at module path ``layer`` from a transformers config, or ``(None, reason)``.

    ``config.sliding_window`` applies to every layer unless ``config.layer_types`` says which layers are
    ``"sliding_attention"`` (Gemma3, Qwen2/3) and which ``"full_attention"``.
    """
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None, None
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return int(window), None
    m = _LAYER_INDEX.search(layer)
    if m is None:
        return None, (
            f"config.layer_types mixes attention types but the layer index of {layer or '<top level>'!r} is "
            "unknown; compile the model whose modules are named like 'model.layers.<i>'"
        )
    kind = layer_types[int(m.group(1))]
    if kind == "sliding_attention":
        return int(window), None
    if kind == "full_attention":
        return None, None
    return None, f"layer type {kind!r} is not supported (only 'full_attention' and 'sliding_attention')"


def site_window(site: SDPASite, config: object | None, outer: dict | None = None) -> tuple[int | None, str | None]:
    """The sliding window of ``site`` (``None``: none) and ``None``, or ``(None, reason)`` to refuse.

    A mask built in the graph that :func:`mask_proof` cannot prove to be causal order, same document and a
    sliding window is refused. Sources: the window in the graph that builds the mask (:func:`graph_windows`)
    and, when given, the model config (:func:`config_window`). When both are known they must agree; the config
    is the only source when the mask is a graph input. Whatever the source, the runtime compares the model's
    local mask with the plan's on every step.
    """
    proof = mask_proof(site, outer)
    if proof.reason:
        return None, proof.reason
    in_graph = set(proof.windows)
    if len(in_graph) > 1:
        return None, f"the mask combines several sliding windows {sorted(in_graph)}; cpcompile supports one per layer"
    graph_w = next(iter(in_graph), None)
    if config is None:
        window = graph_w
    else:
        window, reason = config_window(config, site.layer)
        if reason is not None:
            return None, reason
        if in_graph and window != graph_w:
            return None, (
                f"the mask built in the graph has a sliding window of {graph_w} tokens but the config gives "
                f"{window}; pass the config of the model being compiled"
            )
    if window is not None and site.attn_mask is None:
        return None, f"a sliding window of {window} tokens is configured but the call has no mask (is_causal only)"
    if window is not None and window < 1:
        return None, f"sliding window {window} must be at least 1"
    return window, None


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


def kv_source(site: SDPASite) -> KVSource:
    """The tensors a site exchanges: the un-expanded KV heads when K and V are expanded from them in a spelling
    :mod:`cpcompile.passes.kv_heads` recognises (the exchange then moves KV-head bytes), else K and V."""
    return find_kv_source(site.key, site.value, site.enable_gqa)


def rewrite_site(gm: fx.GraphModule, site: SDPASite, spec: ops.SiteSpec, ctx: PassContext) -> fx.Node:
    """Replace one SDPA call by all-gather-KV attention under the plan's mask (ops of :mod:`cpcompile.ops`).

    Before (transformers: K/V expanded by ``repeat_kv`` to the query heads)::

        k = repeat_kv(k_src, n_rep); v = repeat_kv(v_src, n_rep)
        out = sdpa(q, k, v, attn_mask=local_mask | None, is_causal=..., scale=s)

    After::

        k_h = all_gather_start(k_src)          # right after k_src exists: overlaps with the work until attention
        v_h = all_gather_start(v_src)          # right after v_src exists
        ...                                    # e.g. q/k norms and RoPE
        q_pos, kv_pos, docs = cpcompile::site_plan(k_src, v_src (detached), local_mask | None, site)
        k_all = all_gather_wait(k_h)           # [B, Hkv, N*c, D]; backward: reduce-scatter of dK
        v_all = all_gather_wait(v_h)
        out = sdpa(q, k_all, v_all, attn_mask=visible_mask(q_pos, kv_pos, docs, window), scale=s,
                   enable_gqa=True)            # spec.kernel == "dense"
        out = cpcompile::cp_attention(q, k_all, v_all, q_pos, kv_pos, docs, window, s, True, ...)[0]  # "block"

    A sliding-window site with ``spec.exchange == "halo"`` receives only its halo instead, a full-attention
    site with ``spec.exchange == "selective"`` only the keys its queries see (see :mod:`cpcompile.ops`):
    ``k_all = cat([k_src, halo_exchange(k_src, ...)], dim=2)``, likewise for V.

    K/V are gathered with their KV heads (``enable_gqa=True`` replaces ``repeat_kv``) when both come from
    ``repeat_kv``; otherwise the tensors SDPA received are gathered. The collectives are issued before
    ``site_plan`` checks the active plan: a call outside a shard context on every rank still fails on every
    rank (the gathers complete, the op raises). ``regather_kv_in_backward`` tags the gathers for recomputation
    in backward, so only the local K/V are kept between forward and backward. With ``cp_size == 1`` (block
    kernel only) nothing is gathered.
    """
    node = site.node
    graph = node.graph
    src = kv_source(site)
    k_src, v_src = (_heads_first(graph, t, src.layout) for t in (src.key, src.value))
    gather = spec.cp_size > 1 and spec.exchange == "all_gather"
    started = [ops.emit_gather_start(graph, t, spec, last_write(t)) for t in (k_src, v_src)] if gather else []
    with graph.inserting_before(node):
        positions = ops.emit_site_plan(graph, k_src, v_src, site.attn_mask, spec)
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


def _kernel_reason(site: SDPASite, kernel: str) -> str | None:
    """Why ``kernel`` cannot run this site (the CUDA library paths on another device), or ``None``."""
    q = site.meta(site.query)
    if kernel in ("flex", "flash_varlen") and q is not None and q.device.type not in ("cuda", "meta"):
        return (
            f"attention={kernel!r} runs on CUDA only, the query is on {q.device.type} (flex_attention has no "
            "CPU backward); use cpcompile.backend(..., attention='auto')"
        )
    return None


def _erase_unused_chain(graph: fx.Graph, node: fx.Node, source: fx.Node) -> None:
    """Erase ``node`` and its now unused producers up to ``source`` (the KV-head expansion chain)."""
    while node is not source and not node.users and node.op != "placeholder":
        parent = node.args[0]
        graph.erase_node(node)
        if not isinstance(parent, fx.Node):
            return
        node = parent


def _shape(t: torch.Tensor | None) -> tuple:
    return () if t is None else tuple(int(s) if isinstance(s, int) else str(s) for s in t.shape)


def _heads_first_meta(t: torch.Tensor | None, layout: str) -> torch.Tensor | None:
    return t.transpose(1, 2) if t is not None and layout == "bthd" else t


def _hint(size: object) -> int:
    """The value of a (possibly symbolic) size at this compilation."""
    value = _compat.sym_hint(size)
    if value is None:
        raise ValueError(f"size {size} has no value at this compilation (a data-dependent size)")
    return value


def _sizes(*tensors: torch.Tensor | None) -> tuple[tuple[str, int], ...]:
    """``(symbol, value)`` of the symbolic sizes of ``tensors`` at this compilation."""
    found = {str(s): _hint(s) for t in tensors if t is not None for s in t.shape if not isinstance(s, int)}
    return tuple(sorted(found.items()))


def _report(site: SDPASite, graph_id: int, action: str, reason: str = "", spec: ops.SiteSpec | None = None):
    q, k, v = (site.meta(n) for n in (site.query, site.key, site.value))
    src = kv_source(site)
    gk, gv = (_heads_first_meta(site.meta(n), src.layout) for n in (src.key, src.value))
    gathered = (gk, gv) if spec is not None and spec.cp_size > 1 and spec.exchange == "all_gather" else ()
    gather_bytes = sum((spec.cp_size - 1) * _hint(math.prod(t.shape)) * t.element_size() for t in gathered)
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
        q_heads=int(q.shape[1]) if q is not None and q.dim() == 4 else 0,
        kv_heads=int(gk.shape[1]) if gk is not None and gk.dim() == 4 else 0,
        action=action,
        reason=reason,
        kernel=spec.kernel if spec is not None else "",
        window=spec.window if spec is not None else None,
        exchange=spec.exchange if spec is not None and spec.cp_size > 1 else "",
        halo_slots=spec.halo_slots if spec is not None else 0,
        gathered_shapes=tuple(_shape(t) for t in gathered),
        needs_grad=bool(spec is not None and spec.needs_grad),
        all_gather_bytes_per_call=gather_bytes,
        reduce_scatter_bytes_per_call=gather_bytes if spec is not None and spec.needs_grad else 0,
        sizes=_sizes(q, k, v, gk, gv),
    )


def _refused_report(graph_id: int, node: str, layer: str, reason: str) -> SiteReport:
    return SiteReport(
        graph_id=graph_id,
        node=node,
        layer=layer,
        q_shape=(),
        k_shape=(),
        v_shape=(),
        dtype="?",
        mask_form="none",
        enable_gqa=False,
        q_heads=0,
        kv_heads=0,
        action="refused",
        reason=reason,
    )


def _refusal(where: str, reason: str) -> UnsupportedAttentionError:
    return UnsupportedAttentionError(f"cpcompile cannot run the attention at {where} across CP ranks: {reason}")


def _attn_implementation(config: object) -> str | None:
    return getattr(config, "_attn_implementation", None) or getattr(config, "attn_implementation", None)


def _config_reason(config: object | None) -> str | None:
    """Why a transformers ``config`` cannot run under CP (non-SDPA attention, soft-capped logits), or ``None``."""
    if config is None:
        return None
    impl = _attn_implementation(config)
    if impl is not None and impl not in ("sdpa", "flex_attention"):
        return (
            f"the model config uses attn_implementation={impl!r}; set attn_implementation='sdpa' (or 'flex_attention')"
        )
    if impl != "flex_attention" and getattr(config, "attn_logit_softcapping", None):  # flex: a score_mod
        return (
            f"the model soft-caps attention logits (attn_logit_softcapping={config.attn_logit_softcapping}), "
            "which SDPA cannot express; set attn_logit_softcapping=None, or attn_implementation='flex_attention'"
        )
    return None


def _non_sdpa_reason(node: fx.Node, what: str, config: object | None) -> str:
    transformers = config is not None or _compat.node_module_class(node).startswith("transformers.")
    fix = (
        "set attn_implementation='sdpa'"
        if transformers
        else "compute this attention with torch.nn.functional.scaled_dot_product_attention"
    )
    return f"it is {what}, not a scaled_dot_product_attention call, and would only see this rank's tokens; {fix}"


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
    local_len = _hint(k.shape[2]) if k is not None else 0
    if slots >= (ctx.cp_size - 1) * local_len:
        return {}
    return {"exchange": "halo", "halo_slots": slots}


def _site_spec(site: SDPASite, ctx: PassContext, window: int | None, kernel: str) -> ops.SiteSpec:
    """The site's description; its id is ``<prefix>:<layer> (node <name>)#<digest of the description>``, the
    same in every run for the same graph and options (dumps are deterministic) and different for any change."""
    k_meta, v_meta = (site.meta(n) for n in (kv_source(site).key, kv_source(site).value))
    spec = ops.SiteSpec(
        site="",
        layer=site.layer,
        group_name=ctx.group_name,
        cp_size=ctx.cp_size,
        cp_rank=ctx.cp_rank,
        documents=site.attn_mask is not None,
        window=window,
        kernel=kernel,
        needs_grad=bool(k_meta is not None and v_meta is not None and (k_meta.requires_grad or v_meta.requires_grad)),
        **_exchange(site, ctx, window),
    )
    digest = hashlib.sha1(repr(spec).encode()).hexdigest()[:8]
    return dataclasses.replace(spec, site=f"{ctx.site_prefix}:{site.where}#{digest}")


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
            line = source_line(node)
            refuse(
                f"{line + ', ' if line else ''}{layer or '<top level>'} (node {node.name})",
                reason,
                _refused_report(ctx.graph_id, node.name, layer, reason),
            )
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
        window, kernel = None, _kernel_for(site, ctx.options.attention)
        if reason is None:
            window, reason = site_window(site, config, outer)
        if reason is None:
            reason = _kernel_reason(site, kernel)
        if reason is not None:
            counters["sdpa_refused"] += 1
            refuse(site.located, reason, _report(site, ctx.graph_id, "refused", reason))
            continue
        spec = _site_spec(site, ctx, window, kernel)
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
