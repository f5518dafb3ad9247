"""What the SDPA pass did with each site: :class:`SiteReport` (``backend.reports``, ``cpcompile inspect``, dumps;
the flex_attention pass reports its sites with it too) and the builders that fill it from a site and the
:class:`cpcompile.ops.SiteSpec` of its rewrite (shapes, the K/V exchanged, bytes per call). The builders both
passes share: :func:`site_report` (a report's shapes and dtype from the query, key and value) and
:func:`site_spec` (a rewrite's spec and its site id)."""

from __future__ import annotations

import dataclasses
import hashlib
import math

import torch
import torch.fx as fx

from cpcompile import ops
from cpcompile.passes.common import PassContext, node_where, size_hint
from cpcompile.passes.sdpa_sites import SDPASite, kv_source

__all__ = ["SiteReport"]


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
    #: Whether the rewritten site keeps packed documents apart (its spec's same-document condition: the model's
    #: mask has one, or was not analysed; :attr:`cpcompile.passes.mask_rules.MaskProof.documents`).
    documents: bool = False
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


def _shape(t: object) -> tuple:
    """A shape as a report holds it: ints, the symbol's name where a size is symbolic; ``()`` for no tensor."""
    return tuple(s if isinstance(s, int) else str(s) for s in t.shape) if isinstance(t, torch.Tensor) else ()


def site_report(graph_id: int, node: fx.Node, layer: str, q: object, k: object, v: object, **fields) -> SiteReport:
    """The :class:`SiteReport` of the attention call ``node``: the shapes of its query, key and value (recorded
    values, ``None`` where there is none) and the query's dtype, with ``fields``."""
    return SiteReport(
        graph_id=graph_id,
        node=node.name,
        layer=layer,
        q_shape=_shape(q),
        k_shape=_shape(k),
        v_shape=_shape(v),
        dtype=str(q.dtype).removeprefix("torch.") if isinstance(q, torch.Tensor) else "?",
        **fields,
    )


def site_spec(ctx: PassContext, node: fx.Node, **fields) -> ops.SiteSpec:
    """The :class:`~cpcompile.ops.SiteSpec` of a site rewritten in ``ctx``'s CP group, ``fields`` describing it;
    its id is ``<prefix>:<layer> (node <name>)#<digest of the description>``, the same in every run for the same
    graph and options (dumps are deterministic) and different for any change."""
    spec = ops.SiteSpec(site="", group_name=ctx.group_name, cp_size=ctx.cp_size, cp_rank=ctx.cp_rank, **fields)
    digest = hashlib.sha1(repr(spec).encode()).hexdigest()[:8]
    return dataclasses.replace(spec, site=f"{ctx.site_prefix}:{node_where(node)}#{digest}")


def _heads_first_meta(t: torch.Tensor | None, layout: str) -> torch.Tensor | None:
    return t.transpose(1, 2) if t is not None and layout == "bthd" else t


def _sizes(*tensors: torch.Tensor | None) -> tuple[tuple[str, int], ...]:
    """``(symbol, value)`` of the symbolic sizes of ``tensors`` at this compilation."""
    found = {
        str(s): size_hint(s, strict=True) for t in tensors if t is not None for s in t.shape if not isinstance(s, int)
    }
    return tuple(sorted(found.items()))


def _report(site: SDPASite, graph_id: int, action: str, reason: str = "", spec: ops.SiteSpec | None = None):
    q, k, v = (site.meta(n) for n in (site.query, site.key, site.value))
    src = kv_source(site)
    gk, gv = (_heads_first_meta(site.meta(n), src.layout) for n in (src.key, src.value))
    gathered = (gk, gv) if spec is not None and spec.cp_size > 1 and spec.exchange == "all_gather" else ()
    gather_bytes = sum(
        (spec.cp_size - 1) * size_hint(math.prod(t.shape), strict=True) * t.element_size() for t in gathered
    )
    return site_report(
        graph_id,
        site.node,
        site.layer,
        q,
        k,
        v,
        mask_form=site.mask_form,
        enable_gqa=bool(site.enable_gqa),
        q_heads=int(q.shape[1]) if q is not None and q.dim() == 4 else 0,
        kv_heads=int(gk.shape[1]) if gk is not None and gk.dim() == 4 else 0,
        action=action,
        reason=reason,
        kernel=spec.kernel if spec is not None else "",
        window=spec.window if spec is not None else None,
        documents=bool(spec is not None and spec.documents),
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
