"""Rewrite every ``flex_attention`` call of a Dynamo graph into all-gather-KV CP attention at global indices.

find -> check -> rewrite:

* :func:`find_flex_sites` walks the graph and returns one :class:`FlexSite` per ``flex_attention`` call (the
  higher-order op ``torch.ops.higher_order.flex_attention`` Dynamo records);
* :func:`check_site` returns a one-line reason when a site cannot be reproduced exactly across ranks;
* :func:`rewrite_site` replaces the call (pattern in its docstring) with the ops of :mod:`cpcompile.ops`;
* :func:`flex_cp_pass` is the entry point the backend runs on every graph, before the SDPA pass.

What a site means is its ``mask_mod`` and ``score_mod``: the rewritten site evaluates both at the *global*
indices of its queries (this rank's tokens) and keys (every rank's, all-gathered; with ``exchange="selective"``
only those some query sees, routed by the mask_mod itself: :func:`cpcompile.ops.flex_routing`), block by block, in
``cpcompile::flex_cp_attention`` (:mod:`cpcompile.kernels`), so a document mask, a sliding window, a prefix-LM
mask, soft-capping or ALiBi mean what they mean in the whole-sequence run. The BlockMask's block tables only
make flex skip blocks; they follow from its ``mask_mod``, and the rewritten site does not read them, so a
BlockMask built inside the model for the local length, or outside it for the global length, is handled alike.
The tensors the mods read (``mask_mod``/``score_mod`` closures) are mapped to global indices by their length:

* a tensor with the local sequence length on one dim (per-token data such as document ids made from this
  rank's inputs) is all-gathered along that dim into global token order; one made before the graph (an input)
  first goes through ``cpcompile::exact_input``, which refuses at run time a tensor not known to hold the
  whole-sequence run's values at this rank's tokens (made in eager code from them);
* a tensor without the local length (a table for the whole sequence, per-head constants) is read as it is,
  at global indices;
* anything else is refused (:func:`check_site`): a tensor with the local length on several dims (a
  precomputed ``[c, c]`` mask), a tensor that requires grad (a learned bias), the local length used as a value,
  a BlockMask without a ``mask_mod`` (``BlockMask.from_kv_blocks``: its mask lives only in its block tables).

Why one module of about 430 lines: finding, checking and rewriting a flex site all work on one table, the
tensors its mods read and how each maps to global indices (``_Buffers``); the reports and site ids it
shares with the SDPA pass (:mod:`cpcompile.passes.sdpa_report`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator

import torch
import torch.fx as fx

from cpcompile import _compat, ops
from cpcompile.errors import UnsupportedAttentionError
from cpcompile.kernels.flex_mods import FlexMods
from cpcompile.passes.aliasing import last_write, mutated, viewed_bases
from cpcompile.passes.common import PassContext, counters, finish, graph_modules, node_value, source_line
from cpcompile.passes.sdpa_check import qkv_reason
from cpcompile.passes.sdpa_report import SiteReport, site_report, site_spec
from cpcompile.runtime.workload import record_attention_form

__all__ = ["FlexSite", "find_flex_sites", "check_site", "rewrite_site", "flex_cp_pass"]


@dataclasses.dataclass(frozen=True)
class FlexSite:
    """One ``flex_attention`` call found in a graph (the higher-order op's arguments, by name)."""

    node: fx.Node
    owner: fx.GraphModule
    query: fx.Node
    key: fx.Node
    value: fx.Node
    #: ``score_mod(score, b, h, q_idx, kv_idx, *score_buffers)`` as a graph module, ``None`` when the identity.
    score_mod: fx.GraphModule | None
    #: ``mask_mod(b, h, q_idx, kv_idx, *mask_buffers)`` of the BlockMask.
    mask_mod: fx.GraphModule
    #: The BlockMask as the op gets it: ``(Q_LEN, KV_LEN, block tables..., Q_BLOCK, KV_BLOCK, mask_mod)``.
    block_mask: tuple
    scale: object
    score_buffers: tuple
    mask_buffers: tuple
    layer: str
    transformers: bool = False

    @property
    def where(self) -> str:
        """A human-readable location: the layer, the graph node and the model's line that called flex."""
        line = source_line(self.node)
        return f"{self.layer or '<top level>'} (node {self.node.name}{', ' + line if line else ''})"

    @property
    def outputs(self) -> dict[int, list[fx.Node]]:
        """The ``getitem`` users of the call by output index (0: out, 1: logsumexp in base 2, 2: max scores)."""
        found: dict[int, list[fx.Node]] = {}
        for user in self.node.users:
            index = user.args[1] if user.target is operator.getitem else None
            found.setdefault(index, []).append(user)
        return found


def _submodule(owner: fx.GraphModule, n: object) -> fx.GraphModule | None:
    if isinstance(n, fx.Node) and n.op == "get_attr":
        return owner.get_submodule(n.target)
    return None


def _is_identity_score(gm: fx.GraphModule) -> bool:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out
    return bool(placeholders) and out is placeholders[0]


def _is_noop_mask(gm: fx.GraphModule) -> bool:
    """Whether the mask_mod is flex's ``noop_mask``: its output does not depend on the indices."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out
    return isinstance(out, fx.Node) and out.op in ("call_method", "call_function") and "ones" in str(out.target)


def find_flex_sites(gm: fx.GraphModule) -> list[FlexSite]:
    """Every ``flex_attention`` call of ``gm`` and of its nested graphs, in graph order."""
    sites = []
    for owner in graph_modules(gm):
        for node in owner.graph.nodes:
            if node.op != "call_function" or node.target not in _compat.FLEX_ATTENTION_TARGETS:
                continue
            q, k, v, score_mod, block_mask, scale, _kernel_options, *rest = node.args
            score_buffers = tuple(rest[0]) if len(rest) > 0 else ()
            mask_buffers = tuple(rest[1]) if len(rest) > 1 else ()
            score_gm = _submodule(owner, score_mod)
            sites.append(
                FlexSite(
                    node=node,
                    owner=owner,
                    query=q,
                    key=k,
                    value=v,
                    score_mod=None if score_gm is None or _is_identity_score(score_gm) else score_gm,
                    mask_mod=_submodule(owner, block_mask[-1]),
                    block_mask=tuple(block_mask),
                    scale=scale,
                    score_buffers=score_buffers,
                    mask_buffers=mask_buffers,
                    layer=_compat.node_module_path(node),
                    transformers=_compat.node_module_class(node).startswith("transformers."),
                )
            )
    return sites


def _local_dims(t: torch.Tensor, local_len: object) -> list[int]:
    """The dims of ``t`` whose size is the local sequence length ``local_len``: the same value at this
    compilation, whether each is a constant or a symbol (the local length of separately marked inputs is a
    symbol of its own; transformers' flex path traces the query with a constant length and the tensors its
    ``mask_mod`` reads with symbols)."""
    want = _compat.sym_hint(local_len)
    return [d for d, size in enumerate(t.shape) if want is not None and _compat.sym_hint(size) == want]


@dataclasses.dataclass(frozen=True)
class _Buffers:
    """How the rewritten site passes the mods' extra arguments: per argument of each mod ``("tensor", i)`` (the
    op's ``i``-th tensor) or ``("const", value)``, and for every tensor the dim to all-gather (``None``: as is)."""

    mask_slots: tuple[tuple[str, object], ...]
    score_slots: tuple[tuple[str, object], ...]
    tensors: tuple[tuple[fx.Node, int | None], ...]


def _plan_buffers(args: tuple, mod: fx.GraphModule | None, local_len: object, what: str, tensors: list):
    """Sort ``args`` (a mod's extra arguments) into ``tensors`` and constants; return ``(slots, reason)``."""
    placeholders = [n for n in mod.graph.nodes if n.op == "placeholder"] if mod is not None else []
    first = 5 if what == "score_mod" else 4
    slots = []
    for i, a in enumerate(args):
        value = node_value(a) if isinstance(a, fx.Node) else a
        placeholder = placeholders[first + i] if first + i < len(placeholders) else None
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return None, (
                    f"its {what} reads a tensor that requires grad ({a.name if isinstance(a, fx.Node) else a}, "
                    f"shape {tuple(value.shape)}: a learned bias), whose gradient the CP kernel does not compute; "
                    "compute the bias from q_idx/kv_idx and constants"
                )
            dims = _local_dims(value, local_len)
            if len(dims) > 1:
                return None, (
                    f"its {what} reads a tensor with the local sequence length on several dims "
                    f"(shape {tuple(value.shape)}: a precomputed mask or bias over this rank's tokens), which "
                    "cannot be mapped to global indices; compute it in the mod from per-token tensors "
                    "(document ids, positions) indexed by q_idx and kv_idx"
                )
            slots.append(("tensor", len(tensors)))
            tensors.append((a, dims[0] if dims else None))
        elif isinstance(value, (int, float, bool)) and not isinstance(a, fx.Node):
            slots.append(("const", value))
        elif placeholder is not None and not placeholder.users:
            slots.append(("const", None))  # a size Dynamo passes along with a tensor's symbolic shape
        else:
            local = isinstance(value, torch.SymInt) and _compat.sym_hint(value) == _compat.sym_hint(local_len)
            what_value = "the local sequence length" if local else f"the run-time number {value}"
            return None, (
                f"its {what} uses {what_value} as a value, which cpcompile cannot map to the whole sequence; "
                "pass it as a constant, or read it from a tensor"
            )
    return tuple(slots), None


def check_site(site: FlexSite) -> str | None:
    """``None`` when the site can be rewritten exactly, else a one-line reason saying what to do."""
    q, k, v = (node_value(n) for n in (site.query, site.key, site.value))
    reason = qkv_reason(q, k, v, "call the model without a KV cache, self-attention only")
    if reason is not None:
        return reason
    if not isinstance(site.scale, numbers.Number):
        return "the softmax scale is a run-time value; cpcompile needs a constant scale"
    if site.mask_mod is None:
        return "the BlockMask has no mask_mod graph"
    if _is_noop_mask(site.mask_mod) and site.block_mask[-3] != _compat.FLEX_NO_TABLES_BLOCK:
        return (
            "its BlockMask has no mask_mod (BlockMask.from_kv_blocks): its mask lives only in its block tables, "
            "which cpcompile cannot map to global indices; build it with create_block_mask(mask_mod, ...)"
        )
    used = site.outputs
    if used.get(2):
        return "the call returns flex's max scores (return_aux), which the CP kernel does not compute"
    if None in used:
        return "the call's result is used as a whole, not through its outputs"
    return None


def _buffers(site: FlexSite, local_len: object) -> tuple[_Buffers | None, str | None]:
    tensors: list = []
    mask_slots, reason = _plan_buffers(site.mask_buffers, site.mask_mod, local_len, "mask_mod", tensors)
    if reason is not None:
        return None, reason
    score_slots, reason = _plan_buffers(site.score_buffers, site.score_mod, local_len, "score_mod", tensors)
    if reason is not None:
        return None, reason
    return _Buffers(mask_slots, score_slots, tuple(tensors)), None


def _reader(site: FlexSite, t: fx.Node) -> str:
    """Which of the site's mods reads the graph input ``t``, for messages."""
    return "mask_mod" if t in site.mask_buffers else "score_mod"


def rewrite_site(
    gm: fx.GraphModule, site: FlexSite, spec: ops.SiteSpec, buffers: _Buffers, ctx: PassContext
) -> fx.Node:
    """Replace one flex_attention call by all-gather-KV attention at global indices.

    Before (torchtitan, or transformers' flex path; ``doc`` made from this rank's tokens)::

        block_mask = create_block_mask(mask_mod, B, None, c, c)       # mask_mod reads doc[b, q_idx], ...
        out, lse = flex_attention(q, k, v, score_mod, block_mask, scale, return_lse=...)

    After::

        ok = cpcompile::site_check(k, None, site)                      # right after the first of k, v exists
        k_h = all_gather_start(k); v_h = all_gather_start(v)          # right after k, v exist and the check
        doc_all = sequence_gather(doc)                                 # per-token buffers, global token order
        q_pos, kv_pos, seq_len = cpcompile::flex_site_plan(k, v, ok, site)
        out, lse_e = cpcompile::flex_cp_attention(q, all_gather_wait(k_h), all_gather_wait(v_h), q_pos,
                                                  kv_pos, seq_len, [doc_all, ...], [...], site, scale, block)
        lse = lse_e / ln(2), -inf where no key is visible              # flex's own logsumexp convention

    With ``spec.exchange == "selective"`` there is no all-gather of K/V: after the plan, ``send_slots, counts,
    kv_pos = cpcompile::flex_routing(k, q_pos, seq_len, [doc_all, ...], heads, block, site)`` and ``k_all =
    cat([k, cpcompile::halo_exchange(k, send_slots, counts, site)], dim=2)``, likewise for V.

    The block tables of the BlockMask are left unused (and erased when nothing else reads them).
    """
    graph = site.node.graph
    selective = spec.cp_size > 1 and spec.exchange == "selective"
    gather = spec.cp_size > 1 and not selective
    ready = [(t, last_write(t)) for t in (site.key, site.value)]  # K and V may be one tensor
    checked = ops.emit_site_check(graph, ready, None, spec)
    started = [ops.emit_gather_start(graph, t, spec, ops.last_of([w, checked])) for t, w in ready] if gather else []
    with graph.inserting_before(site.node):
        tensors = []
        for t, dim in buffers.tensors:
            if dim is None or spec.cp_size == 1:
                tensors.append(t)
                continue
            if t.op == "placeholder" and t.graph is gm.graph:  # made before this graph: only an exact one
                t = ops.emit_exact_input(graph, t, spec, _reader(site, t))
            tensors.append(ops.emit_buffer_gather(graph, t, dim, spec))
        q_pos, kv_pos, seq_len = ops.emit_flex_site_plan(graph, site.key, site.value, checked, spec)
        if gather:
            k_all, v_all = (graph.call_function(_compat.all_gather_wait, (h,)) for h in started)
        elif selective:
            heads = int(node_value(site.query).shape[1])
            k_all, v_all, kv_pos = ops.emit_flex_exchange(
                graph, site.key, site.value, q_pos, seq_len, tensors, heads, ctx.options.block_size, spec
            )
        else:
            k_all, v_all = site.key, site.value
        out, lse = ops.emit_flex_attention(
            graph,
            spec,
            site.query,
            k_all,
            v_all,
            (q_pos, kv_pos, seq_len),
            tensors=tensors,
            mods=FlexMods(site.mask_mod, site.score_mod, buffers.mask_slots, buffers.score_slots),
            scale=float(site.scale),
            block_size=ctx.options.block_size,
        )
        lse2 = None
        if site.outputs.get(1):
            lse2 = graph.call_function(operator.truediv, (lse, math.log(2)))
            lse2 = graph.call_function(torch.nan_to_num, (lse2,), {"posinf": -math.inf})
    if ctx.options.regather_kv_in_backward and gather:
        for n in started:
            n.meta.update(_compat.must_recompute_meta())
    elif ctx.options.regather_kv_in_backward and selective:
        ops.recompute_exchange(k_all, v_all)
    for index, users in site.outputs.items():
        for user in users:
            user.replace_all_uses_with(out if index == 0 else lse2)
            graph.erase_node(user)
    inputs = site.node.all_input_nodes
    graph.erase_node(site.node)
    _erase_unused(graph, inputs)
    _detach_unused_mods(site.owner)
    return out


def _detach_unused_mods(owner: fx.GraphModule) -> None:
    """Remove the mod graphs no ``get_attr`` reads any more from ``owner`` (the kernel holds them): later passes
    walk nested graphs and would take a mask_mod's indexing at global indices for token mixing."""
    read = {n.target for n in owner.graph.nodes if n.op == "get_attr"}
    for name, child in list(owner.named_children()):
        if isinstance(child, fx.GraphModule) and name not in read and (name.startswith(("mask_fn", "score_mod"))):
            delattr(owner, name)


def _erase_unused(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase what only fed the replaced call: the BlockMask's block tables (``create_block_mask`` traced into the
    graph evaluates the mask_mod over this rank's local indices) and the mods' ``get_attr`` nodes.

    The candidates are the ancestors of ``nodes`` and the in-place writes into them (``dense[rows, cols] = 1``),
    closed under both; a candidate stays when anything else (any other node, the output) still reads it.
    Leaving them would run the mask_mod at local indices for nothing, and the mixing pass would refuse it.
    """
    region: set[fx.Node] = set()
    stack = [n for n in nodes if n.op != "placeholder"]
    while stack:
        n = stack.pop()
        if n in region or n.op in ("placeholder", "output"):
            continue
        region.add(n)
        stack.extend(n.all_input_nodes)
        stack.extend(u for u in n.users if mutated(u) is n and not u.users)
    live: set[fx.Node] = set()
    stack = [n for n in graph.nodes if n not in region]
    while stack:
        while stack:
            n = stack.pop()
            for i in n.all_input_nodes:
                if i not in live:
                    live.add(i)
                    stack.append(i)
        # a write into a tensor that stays (the model's `buf.copy_(k)` before k reached the call) stays too
        for n in region - live:
            target = mutated(n)
            if target is not None and any(b in live for b in viewed_bases(target)):
                live.add(n)
                stack.append(n)
    for n in reversed(list(graph.nodes)):
        if n in region and n not in live and not n.users:
            graph.erase_node(n)


def _report(site: FlexSite, graph_id: int, action: str, reason: str = "", spec: ops.SiteSpec | None = None):
    q, k, v = (node_value(n) for n in (site.query, site.key, site.value))
    form = "mask_mod" + (", score_mod" if site.score_mod is not None else "")
    return site_report(
        graph_id,
        site.node,
        site.layer,
        q,
        k,
        v,
        mask_form=f"flex ({form})",
        enable_gqa=bool(isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.shape[1] != k.shape[1]),
        q_heads=int(q.shape[1]) if isinstance(q, torch.Tensor) else 0,
        kv_heads=int(k.shape[1]) if isinstance(k, torch.Tensor) else 0,
        action=action,
        reason=reason,
        kernel="block" if spec is not None else "",
        exchange=spec.exchange if spec is not None and spec.cp_size > 1 else "",
        needs_grad=bool(spec is not None and spec.needs_grad),
    )


def _site_spec(site: FlexSite, ctx: PassContext) -> ops.SiteSpec:
    """The site's description and id (:func:`~cpcompile.passes.sdpa_report.site_spec`, as the SDPA sites'); with
    ``exchange="selective"`` and CP > 1, the selective exchange into ``exchange_slots`` key slots."""
    k, v = (node_value(n) for n in (site.key, site.value))
    selective = ctx.cp_size > 1 and ctx.options.exchange == "selective"
    return site_spec(
        ctx,
        site.node,
        layer=site.layer,
        documents=False,
        window=None,
        kernel="block",
        needs_grad=bool(k.requires_grad or v.requires_grad),
        **({"exchange": "selective", "halo_slots": ctx.options.exchange_slots or 0} if selective else {}),
    )


def flex_cp_pass(gm: fx.GraphModule, ctx: PassContext) -> list[SiteReport]:
    """Rewrite every flex_attention site of ``gm`` (and of its nested graphs) in place; return one report per
    site. Runs when CP > 1, or with ``attention="block"`` (CP of one: the CPU kernel instead of flex);
    otherwise the sites are reported ``untouched``. ``ctx.refuse`` as in the SDPA pass: ``"raise"`` raises
    :class:`UnsupportedAttentionError` naming the layer, its line and the fix."""
    sites = find_flex_sites(gm)
    if sites:
        counters["flex_found"] += len(sites)
    reports: list[SiteReport] = []
    for site in sites:
        if ctx.cp_size == 1 and ctx.options.attention != "block":
            reports.append(_report(site, ctx.graph_id, "untouched", "CP group of size 1"))
            continue
        local_len = node_value(site.query).shape[2] if isinstance(node_value(site.query), torch.Tensor) else None
        reason = check_site(site)
        buffers = None
        if reason is None:
            buffers, reason = _buffers(site, local_len)
        if reason is not None:
            counters["flex_refused"] += 1
            if ctx.refuse == "raise":
                raise UnsupportedAttentionError(
                    f"cpcompile cannot run the flex_attention call at {site.where} across CP ranks: {reason}"
                )
            reports.append(_report(site, ctx.graph_id, "refused", reason))
            continue
        spec = _site_spec(site, ctx)
        ops.register_site(spec)
        reports.append(_report(site, ctx.graph_id, "rewritten", spec=spec))
        try:
            rewrite_site(gm, site, spec, buffers, ctx)
        except Exception as e:  # noqa: BLE001 - re-raised with the pass's name
            raise RuntimeError(f"cpcompile flex_cp pass failed while rewriting {site.where}: {e}") from e
        # the balanced layout's estimate of the site's work: a causal document form (the mask is its mask_mod)
        record_attention_form(
            spec.group_name,
            spec.layer or spec.site,
            True,
            None,
            ctx.options.block_size,
            selective=spec.exchange == "selective",
        )
        counters["flex_rewritten"] += 1
    if sites:
        finish(gm)
    return reports
