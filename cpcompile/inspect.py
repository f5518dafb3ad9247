"""``cpcompile inspect``: what the backend does to a model, traced in one process without a cluster.

Main API: :func:`inspect_model` (trace the model as every CP rank, run the pass in report mode, collect one
:class:`RankSite` per SDPA site) and :func:`write_dump` (graphs before/after, ``summary.json`` and a PNG of each
rank's attention pattern). The command line is ``cpcompile inspect`` (:mod:`cpcompile.__main__`).

Each rank is traced in this process under a fake process group (no communication) of the CP size, with the
model and the local batch on the ``meta`` device by default: no weights are allocated and no attention is
computed; Dynamo traces the model on the shapes alone, with the same dynamic sequence length as training.
The backend is the one training builds (:func:`cpcompile.backend`'s :class:`~cpcompile.backend.CPBackend`,
same options) in its ``trace_only`` mode: every graph is rewritten in a copy with refusals listed instead of
raised, and the untouched graph is what runs (on meta), so no collective is ever issued. The rows of the
positions pass list every position source the model computes from the local sequence length, those of the mixing
pass every other op that mixes tokens along the sequence (run on the whole sequence, accounted for, or refused).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from collections.abc import Sequence

import torch

from cpcompile import _compat
from cpcompile.backend import CPBackend, TracedGraph
from cpcompile.dump import RankDumpWriter, write_json
from cpcompile.layouts import DEFAULT_BLOCK_SIZE, DEFAULT_LAYOUT, AttentionForm, Workload
from cpcompile.options import BackendOptions
from cpcompile.passes.sdpa_cp import SiteReport
from cpcompile.pattern import PatternGeometry, attention_pattern_image, pattern_geometry
from cpcompile.plan import CPPlan, build_plan

__all__ = [
    "Inspection",
    "RankSite",
    "RankTotals",
    "attention_pattern_image",
    "inspect_model",
    "load_model",
    "PatternGeometry",
    "pattern_geometry",
    "write_dump",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


# -- results -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RankSite:
    """One SDPA site as traced on one rank: the pass's report (sizes resolved) and its graph's calls per forward."""

    rank: int
    #: How many times the site's graph ran in one forward.
    calls_per_forward: int
    report: SiteReport
    #: Bytes of K and V this rank receives per call in a halo exchange (``report.exchange == "halo"``), from the
    #: plan of the inspected batch.
    halo_bytes_per_call: int = 0
    #: Bytes of the K and V this rank's queries see that other ranks hold, summed over the batch rows: the least
    #: any exchange must deliver (an all-gather delivers all of the other ranks' keys by design).
    needed_bytes_per_call: int = 0

    @property
    def all_gather_bytes_per_step(self) -> int:
        return self.report.all_gather_bytes_per_call * self.calls_per_forward

    @property
    def backward_bytes_per_step(self) -> int:
        """Bytes this rank sends in backward: reduce-scatters of dK/dV, or the halo keys' gradients returned."""
        halo_back = self.halo_bytes_per_call * self.calls_per_forward if self.report.needs_grad else 0
        return self.reduce_scatter_bytes_per_step + halo_back

    @property
    def received_bytes_per_call(self) -> int:
        """K and V bytes this rank receives per call, whatever the exchange."""
        return self.report.all_gather_bytes_per_call + self.halo_bytes_per_call

    @property
    def reduce_scatters_per_step(self) -> int:
        """Backward reduce-scatters of one step: one per gathered tensor that requires grad, per call."""
        return len(self.report.gathered_shapes) * self.report.needs_grad * self.calls_per_forward

    @property
    def reduce_scatter_bytes_per_step(self) -> int:
        return self.report.reduce_scatter_bytes_per_call * self.calls_per_forward

    def __getattr__(self, name: str):
        """The report's fields (``row.layer``, ``row.action``, ...) read through the row."""
        if name == "report":  # not set yet (copying, unpickling)
            raise AttributeError(name)
        return getattr(self.report, name)

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "graph": self.report.graph_id,
            "calls_per_forward": self.calls_per_forward,
            **self.report.to_json(),
            "all_gather_bytes_per_step": self.all_gather_bytes_per_step,
            "reduce_scatters_per_step": self.reduce_scatters_per_step,
            "reduce_scatter_bytes_per_step": self.reduce_scatter_bytes_per_step,
            "halo_bytes_per_call": self.halo_bytes_per_call,
            "halo_bytes_per_step": self.halo_bytes_per_call * self.calls_per_forward,
            "needed_bytes_per_call": self.needed_bytes_per_call,
        }


@dataclasses.dataclass(frozen=True)
class RankTotals:
    """What one rank gathers and computes in one training step (forward + backward)."""

    rank: int
    rewritten: int
    refused: int
    all_gathers: int
    all_gather_bytes: int
    reduce_scatters: int
    reduce_scatter_bytes: int
    #: Halo exchanges (K and V of sliding-window sites) and the bytes received in them, one step.
    halo_exchanges: int
    halo_bytes: int
    #: Bytes of the K and V its queries see that other ranks hold, one step (``RankSite.needed_bytes_per_call``).
    needed_bytes: int
    #: Query/key pairs of this rank's rows that the plan's masks let attend, summed over the batch and over the
    #: rewritten attention layers (each with its documents and window).
    visible_pairs: int
    #: Query/key pairs the block kernel computes for this rank (its not fully masked blocks), same sums.
    computed_pairs: int


@dataclasses.dataclass(frozen=True)
class Inspection:
    """The result of :func:`inspect_model`: the settings, one row per site per traced rank, the graphs.

    The batch's sizes and layout (``cp_size``, ``seq_len``, ``padded_len``, ``chunk_len``, ``layout``) are read
    from :attr:`plan`.
    """

    model: str
    model_class: str
    ranks: tuple[int, ...]
    doc_lens: tuple[tuple[int, ...], ...]
    dtype: str
    device: str
    #: The options the backend traced with (those a training run with the same options uses).
    options: BackendOptions
    #: What the ``"balanced"`` layout balanced: the rewritten layers' attention forms, the backend's block size.
    workload: Workload
    rows: tuple[RankSite, ...]
    totals: tuple[RankTotals, ...]
    #: The plan of the global batch (rank 0's view; ``plan.token_indices(r)`` gives any rank's tokens).
    plan: CPPlan
    #: Whether the rewritten sites use the packed-document mask (bool-mask form) or plain causal order.
    documents: bool
    #: Every graph traced, of every traced rank.
    graphs: tuple[TracedGraph, ...] = dataclasses.field(repr=False)

    @property
    def batch_size(self) -> int:
        return len(self.doc_lens)

    cp_size = property(lambda self: self.plan.cp_size, doc="CP group size ``N``.")
    seq_len = property(lambda self: self.plan.seq_len, doc="Global sequence length ``T`` before padding.")
    padded_len = property(lambda self: self.plan.padded_len, doc="``T`` padded to a multiple of ``N``.")
    chunk_len = property(lambda self: self.plan.chunk_len, doc="Tokens per rank, ``T_pad / N``.")
    layout = property(lambda self: self.plan.layout, doc="The layout's name (:data:`cpcompile.plan.LAYOUTS`).")

    def site_table(self) -> str:
        """The per-site table (one row per site, whose byte columns give the largest rank's; a site that differs
        between ranks gets one row per rank)."""
        from tabulate import tabulate

        headers = [
            "ranks",
            "graph",
            "layer",
            "q",
            "k, v",
            "dtype",
            "heads q/kv",
            "mask found",
            "action",
            "attention",
            "exchange",
            "gathered K, V",
            "recv/call",
            "needed/call",
            "recv/step",
            "bwd/step",
        ]
        body = []
        for ranks, row in self._merged_rows():
            action = row.action + (f": {row.reason}" if row.reason and row.action != "rewritten" else "")
            body.append(
                [
                    ranks,
                    row.graph_id,
                    row.layer or "<top level>",
                    _fmt_shape(row.q_shape),
                    _fmt_shapes((row.k_shape, row.v_shape)),
                    row.dtype,
                    f"{row.q_heads}/{row.kv_heads}",
                    row.mask_found,
                    action,
                    (row.kernel or "-") + (f", window {row.window}" if row.window is not None else ""),
                    row.exchange.replace("_", "-") or "-",
                    _fmt_shapes(row.gathered_shapes),
                    _fmt_bytes(row.received_bytes_per_call),
                    _fmt_bytes(row.needed_bytes_per_call),
                    _fmt_bytes(row.received_bytes_per_call * row.calls_per_forward),
                    _fmt_bytes(row.backward_bytes_per_step),
                ]
            )
        return tabulate(body, headers=headers, tablefmt="simple", disable_numparse=True)

    def rank_table(self) -> str:
        """The per-rank totals of one training step."""
        from tabulate import tabulate

        headers = [
            "rank",
            "rewritten",
            "refused",
            "all-gathers",
            "AG/step",
            "reduce-scatters (bwd)",
            "RS/step",
            "halo exchanges",
            "halo/step",
            "needed/step",
            "visible (q,k) pairs",
            "computed (q,k) pairs",
        ]
        body = [
            [
                t.rank,
                t.rewritten,
                t.refused,
                t.all_gathers,
                _fmt_bytes(t.all_gather_bytes),
                t.reduce_scatters,
                _fmt_bytes(t.reduce_scatter_bytes),
                t.halo_exchanges,
                _fmt_bytes(t.halo_bytes),
                _fmt_bytes(t.needed_bytes),
                t.visible_pairs,
                t.computed_pairs,
            ]
            for t in self.totals
        ]
        return tabulate(body, headers=headers, tablefmt="simple", disable_numparse=True)

    def headline(self) -> str:
        docs = "; ".join(",".join(map(str, row)) for row in self.doc_lens)
        pad = f", padded to {self.padded_len}" if self.padded_len != self.seq_len else ""
        return (
            f"{self.model} ({self.model_class}): CP size {self.cp_size}, batch {self.batch_size} x {self.seq_len} "
            f"tokens{pad} (documents {docs}), {self.chunk_len} tokens per rank, {self.dtype}, traced on "
            f"{self.device}, {self.layout} layout, attention={self.options.attention}; "
            f"{len({(r.graph_id, r.node) for r in self.rows})} SDPA site(s) in "
            f"{len({g.graph for g in self.graphs})} graph(s)"
        )

    def position_table(self) -> str:
        """One row per position source (a source found alike on several ranks gets one row)."""
        from tabulate import tabulate

        rows: dict[tuple, list[int]] = {}
        for g in self.graphs:
            for p in g.positions:
                key = (g.graph, p.layer or "<top level>", p.node, p.kind, p.action, p.reason)
                rows.setdefault(key, []).append(g.rank)
        body = [[_fmt_ranks(ranks, self.cp_size), *key] for key, ranks in rows.items()]
        headers = ["ranks", "graph", "layer", "node", "kind", "action", "reason"]
        return tabulate(body, headers=headers, tablefmt="simple", disable_numparse=True)

    def mixing_table(self) -> str:
        """One row per op that mixes tokens outside attention (an op found alike on several ranks gets one row)."""
        from tabulate import tabulate

        rows: dict[tuple, list[int]] = {}
        for g in self.graphs:
            for m in g.mixing:
                nbytes = m.all_gather_bytes_per_call or ""
                key = (g.graph, m.layer or "<top level>", m.node, m.op, m.kind, m.action, nbytes, m.reason)
                rows.setdefault(key, []).append(g.rank)
        body = [[_fmt_ranks(ranks, self.cp_size), *key] for key, ranks in rows.items()]
        headers = ["ranks", "graph", "layer", "node", "op", "kind", "action", "AG bytes/call", "reason"]
        return tabulate(body, headers=headers, tablefmt="simple", disable_numparse=True)

    def report(self) -> str:
        """The text ``cpcompile inspect`` prints."""
        lines = [self.headline(), ""]
        if not self.rows:
            lines.append(
                "no scaled_dot_product_attention call found in the traced graphs: the backend passes them "
                "through unchanged and context parallelism does not split attention (does the model use "
                "attn_implementation='sdpa'?)"
            )
        else:
            lines += [
                self.site_table(),
                "",
                "per rank, one step (forward all-gathers, backward reduce-scatters):",
                self.rank_table(),
            ]
        if any(g.positions for g in self.graphs):
            lines += [
                "",
                "positions computed from the local sequence length (rewritten to global token indices, left to "
                "the attention mask, unchanged, or refused):",
                self.position_table(),
            ]
        if any(g.mixing for g in self.graphs):
            lines += [
                "",
                "ops that mix tokens along the sequence outside attention (gathered: run on the whole sequence; "
                "partial_sum: a sum the ranks' values add up to; dispatch: MoE token bookkeeping; per_token: a "
                "listed custom op; refused):",
                self.mixing_table(),
            ]
        return "\n".join(lines) + "\n"

    def _merged_rows(self) -> list[tuple[str, RankSite]]:
        by_site: dict[tuple[int, str], list[RankSite]] = {}
        for row in self.rows:
            by_site.setdefault((row.graph_id, row.node), []).append(row)
        out = []
        for rows in by_site.values():
            same = all(r.report == rows[0].report and r.calls_per_forward == rows[0].calls_per_forward for r in rows)
            if same:  # one row; the bytes that depend on the rank's tokens: the largest over the ranks
                largest = dataclasses.replace(
                    rows[0],
                    halo_bytes_per_call=max(r.halo_bytes_per_call for r in rows),
                    needed_bytes_per_call=max(r.needed_bytes_per_call for r in rows),
                )
                out.append((_fmt_ranks([r.rank for r in rows], self.cp_size), largest))
            else:
                out += [(str(r.rank), r) for r in rows]
        return out

    def to_json(self) -> dict:
        """The table's data as plain JSON types (what ``summary.json`` holds, without the file list)."""
        return {
            "model": self.model,
            "model_class": self.model_class,
            "cp_size": self.cp_size,
            "ranks": list(self.ranks),
            "doc_lens": [list(r) for r in self.doc_lens],
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "padded_len": self.padded_len,
            "chunk_len": self.chunk_len,
            "dtype": self.dtype,
            "device": self.device,
            "documents": self.documents,
            "layout": self.layout,
            "workload": dataclasses.asdict(self.workload),
            "attention": self.options.attention,
            "sites": [row.to_json() for row in self.rows],
            "positions": [{"rank": g.rank, **dataclasses.asdict(p)} for g in self.graphs for p in g.positions],
            "mixing": [{"rank": g.rank, **m.to_json()} for g in self.graphs for m in g.mixing],
            "rank_totals": [dataclasses.asdict(t) for t in self.totals],
        }


def _fmt_shape(shape: Sequence) -> str:
    return "[" + ",".join(str(s) for s in shape) + "]"


def _fmt_shapes(shapes: Sequence[Sequence]) -> str:
    if not shapes:
        return "-"
    if all(tuple(s) == tuple(shapes[0]) for s in shapes):
        return f"{len(shapes)} x {_fmt_shape(shapes[0])}" if len(shapes) > 1 else _fmt_shape(shapes[0])
    return " ".join(_fmt_shape(s) for s in shapes)


def _fmt_bytes(n: int) -> str:
    """Binary units with one decimal (exact byte counts are in summary.json and the rows)."""
    if n == 0:
        return "0"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _fmt_ranks(ranks: list[int], cp_size: int) -> str:
    if ranks == list(range(cp_size)):
        return "all"
    return ",".join(map(str, ranks))


# -- loading the model ---------------------------------------------------------------------------------------
def load_model(spec: str, *, device: str = "meta", dtype: str | None = None, attn_implementation: str = "sdpa"):
    """Build the model named by ``spec`` on ``device``, in train mode.

    ``spec`` is a transformers config (a ``config.json`` file or a folder holding one; built with
    ``AutoModelForCausalLM.from_config`` and ``attn_implementation``, random weights) or ``module:factory``,
    a function called with no arguments that returns an ``nn.Module`` (or a transformers config). Raises
    ``ValueError`` for a spec that names nothing loadable.
    """
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(_DTYPES)}")
    if os.path.exists(spec):
        model = _from_config(_load_config(spec), device, attn_implementation)
    elif _FACTORY.match(spec):
        made = _call_factory(spec)
        if isinstance(made, torch.nn.Module):
            model = made.to(device=device)
        elif _is_config(made):
            model = _from_config(made, device, attn_implementation)
        else:
            raise ValueError(
                f"model factory {spec!r} returned a {type(made).__name__}; it must return a torch.nn.Module "
                "(or a transformers config)"
            )
    else:
        raise ValueError(
            f"unknown model spec {spec!r}: not an existing config file or folder, and not of the form "
            "'module:factory'; pass a transformers config.json (or the folder holding it) or "
            "'package.module:function' returning the model"
        )
    if dtype is not None:
        model = model.to(dtype=_DTYPES[dtype])
    return model.train()


def _is_config(obj: object) -> bool:
    return type(obj).__name__.endswith("Config") and hasattr(obj, "to_dict")


def _load_config(path: str):
    try:
        import transformers
    except ImportError as e:
        raise ValueError(
            f"model spec {path!r} is a config file, which needs transformers: pip install transformers"
        ) from e
    try:
        return transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(
            f"cannot read a transformers config from {path!r} ({type(e).__name__}: {e}); pass a config.json "
            "with a 'model_type' field, or the folder that holds it"
        ) from e


def _from_config(config, device: str, attn_implementation: str):
    import transformers

    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def _call_factory(spec: str):
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"model spec {spec!r}: cannot import module {module_name!r} ({e}); is it on PYTHONPATH?"
        ) from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"model spec {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"model spec {spec!r}: {attr!r} is a {type(obj).__name__}, not a function returning a model")
    return obj()


# -- tracing -------------------------------------------------------------------------------------------------
def _doc_lens(seq_len: int, doc_lens: Sequence[Sequence[int]] | None, batch_size: int) -> tuple[tuple[int, ...], ...]:
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if doc_lens is None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        return ((seq_len,),) * batch_size
    rows = tuple(tuple(row) for row in doc_lens)
    if not rows:
        raise ValueError("doc_lens is empty; give one list of document lengths per batch row, or None")
    for b, row in enumerate(rows):
        if not row or any(not isinstance(n, int) or n < 1 for n in row):
            raise ValueError(f"doc_lens row {b} = {list(row)}: document lengths must be positive ints")
        if sum(row) != seq_len:
            raise ValueError(
                f"doc_lens row {b} = {list(row)} sums to {sum(row)} tokens, but seq_len is {seq_len}; the "
                "documents of every row must fill the sequence exactly"
            )
    return rows


def inspect_model(
    model: str,
    *,
    cp_size: int,
    seq_len: int,
    doc_lens: Sequence[Sequence[int]] | None = None,
    batch_size: int = 1,
    ranks: Sequence[int] | None = None,
    dtype: str | None = None,
    device: str = "meta",
    attn_implementation: str = "sdpa",
    attention: str = "auto",
    layout: str = DEFAULT_LAYOUT,
    block_size: int = DEFAULT_BLOCK_SIZE,
    use_config: bool = True,
) -> Inspection:
    """Trace ``model`` as each CP rank of a group of ``cp_size`` and report what the backend does with it.

    Args:
        model: a transformers ``config.json`` (or its folder) or ``module:factory`` (see :func:`load_model`).
        cp_size: the CP group size ``N``.
        seq_len: global sequence length ``T`` of the batch (padded to a multiple of ``N`` like in training).
        doc_lens: packed document lengths, one list per batch row, each summing to ``seq_len``
            (default: one document per row, ``batch_size`` rows).
        ranks: which ranks to trace (default all); each rank is one Dynamo trace.
        dtype: ``float32``, ``bfloat16`` or ``float16`` to cast the model to (default: as built).
        device: ``meta`` (default: shapes only, nothing allocated) or ``cpu`` (real tensors, for models whose
            Python code reads tensor values).
        attn_implementation: for config specs, the transformers attention implementation (``sdpa``).
        attention: the backend's ``attention`` option (``auto``: the block loop, on every device).
        layout: the layout :func:`cpcompile.shard` uses (:data:`cpcompile.plan.LAYOUTS`; default
            ``"balanced"``, balancing the attention forms of the rewritten layers).
        block_size: the backend's ``block_size`` (block kernel; the computed pairs and the balance use it).
        use_config: pass a transformers model's config to the backend (``backend(..., config=model.config)``),
            as training should: windows and refusals that come from the config then show.

    The model is called in train mode the way :func:`cpcompile.shard` calls it in training (this rank's tokens,
    global ``position_ids``, ``shift_labels``, ``use_cache=False``, a dynamic sequence length), under a fake
    process group, once per rank, through the backend training builds with the same options. It needs a
    process without an initialized default process group, and clears torch.compile's caches
    (``torch.compiler.reset()``) around every trace. Raises ``ValueError`` for bad arguments,
    ``RuntimeError`` when tracing fails.
    """
    from cpcompile.plan import LAYOUTS
    from cpcompile.testing import packed_batch

    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int (the CP group size), got {cp_size!r}")
    rows_docs = _doc_lens(seq_len, doc_lens, batch_size)
    if seq_len < cp_size:
        raise ValueError(
            f"CP size {cp_size} does not fit a sequence of {seq_len} tokens: every rank needs at least one token; "
            f"use --cp-size <= {seq_len} or a longer sequence"
        )
    ranks = tuple(range(cp_size)) if ranks is None else tuple(ranks)
    bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < cp_size]
    if bad or not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks={list(ranks)}: expected distinct ranks in [0, {cp_size}) (CP size {cp_size})")
    if device not in ("meta", "cpu"):
        raise ValueError(f"device={device!r}: inspect traces on 'meta' (default) or 'cpu'")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not a known layout; choose one of {sorted(LAYOUTS)}")

    net = load_model(model, device=device, dtype=dtype, attn_implementation=attn_implementation)
    config = getattr(net, "config", None)
    options = BackendOptions(
        inner="eager",
        attention=attention,
        block_size=block_size,
        config=config if use_config and _is_config(config) else None,
        dump_dir=None,
    )
    vocab = int(getattr(config, "vocab_size", 2) or 2)
    batch = packed_batch([list(r) for r in rows_docs], vocab_size=vocab, seed=0)
    param = next(iter(net.parameters()), None)
    model_dtype = str(param.dtype if param is not None else torch.get_default_dtype()).removeprefix("torch.")

    graphs: list[TracedGraph] = []
    for rank in ranks:
        graphs += _trace_rank(net, batch, rank, cp_size, device, model, options, layout)
    reports = [(g, report.resolved()) for g in graphs for report in g.reports]
    workload = _workload([report for _, report in reports], options.block_size)
    plans = {r: build_plan(batch, cp_size, r, layout=layout, workload=workload) for r in ranks}
    rows = tuple(_rank_site(g, report, plans[g.rank]) for g, report in reports)
    rewritten_forms = [r.mask_form for r in rows if r.action == "rewritten"]
    documents = not rewritten_forms or rewritten_forms[0] == "bool-mask"
    plan = plans[0] if 0 in plans else build_plan(batch, cp_size, 0, layout=layout, workload=workload)
    totals = tuple(_totals(rank, rows, plan, workload) for rank in ranks)
    return Inspection(
        model=model,
        model_class=type(net).__name__,
        ranks=ranks,
        doc_lens=rows_docs,
        dtype=model_dtype,
        device=device,
        options=options,
        workload=workload,
        rows=rows,
        totals=totals,
        plan=plan,
        documents=documents,
        graphs=tuple(graphs),
    )


def _trace_rank(net, batch, rank: int, cp_size: int, device: str, spec: str, options, layout) -> list[TracedGraph]:
    from cpcompile.runtime import current_plan, mark_local_dynamic, shard

    with _compat.fake_process_group(rank, cp_size) as group:
        tracer = CPBackend(group, options, trace_only=True, name="inspect")
        torch.compiler.reset()
        try:
            compiled = torch.compile(net, backend=tracer)
            with shard(batch, group, layout=layout, workload=Workload(block_size=options.block_size)) as local:
                local = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in local.items()}
                mark_local_dynamic(local, current_plan().chunk_len)  # the moved copies, like shard's own
                compiled(**local)
        except Exception as e:  # noqa: BLE001 - re-raised with what was being traced
            hint = (
                " (retry with --device cpu if the model's Python code reads tensor values)" if device == "meta" else ""
            )
            raise RuntimeError(
                f"cpcompile inspect: tracing {spec!r} as rank {rank} of {cp_size} on {device} failed{hint}: {e}"
            ) from e
        finally:
            torch.compiler.reset()
    return tracer.traced


def _workload(rows: list[SiteReport], block_size: int) -> Workload:
    """The attention forms of the rewritten sites (as :func:`cpcompile.runtime.compiled_workload` records them)."""
    layers: dict[tuple[bool, int | None], set[str]] = {}
    for r in rows:
        if r.action == "rewritten":
            layers.setdefault((r.mask_form == "bool-mask", r.window), set()).add(r.layer)
    if not layers:
        return Workload(block_size=block_size)
    ordered = sorted(layers.items(), key=lambda kv: (not kv[0][0], kv[0][1] is not None, kv[0][1] or 0))
    return Workload(forms=tuple(AttentionForm(d, w, len(n)) for (d, w), n in ordered), block_size=block_size)


def _rank_site(graph: TracedGraph, report: SiteReport, plan: CPPlan) -> RankSite:
    """The row of ``report`` on ``graph``'s rank, with the halo and needed bytes of the plan's batch."""
    if report.action != "rewritten" or plan.cp_size == 1 or len(report.k_shape) != 4:
        return RankSite(graph.rank, graph.calls, report)
    itemsize = getattr(torch, report.dtype).itemsize
    per_token = report.kv_heads * (report.k_shape[3] + report.v_shape[3]) * itemsize  # K and V, one row
    documents = report.mask_form == "bool-mask"
    rows = range(plan.batch_size)
    needed = sum(len(plan.keys_needed(report.window, row=b, documents=documents)) for b in rows) * per_token
    halo = len(plan.halo_needs(report.window)) * plan.batch_size * per_token if report.exchange == "halo" else 0
    return RankSite(graph.rank, graph.calls, report, halo_bytes_per_call=halo, needed_bytes_per_call=needed)


def _totals(rank: int, rows: tuple[RankSite, ...], plan: CPPlan, workload: Workload) -> RankTotals:
    mine = [r for r in rows if r.rank == rank]
    done = [r for r in mine if r.action == "rewritten"]
    forms = [(f, f.layers) for f in workload.forms] if done else []
    return RankTotals(
        rank=rank,
        rewritten=len(done),
        refused=sum(r.action == "refused" for r in mine),
        all_gathers=sum(len(r.gathered_shapes) * r.calls_per_forward for r in done),
        all_gather_bytes=sum(r.all_gather_bytes_per_step for r in done),
        reduce_scatters=sum(r.reduce_scatters_per_step for r in done),
        reduce_scatter_bytes=sum(r.reduce_scatter_bytes_per_step for r in done),
        halo_exchanges=sum(2 * r.calls_per_forward for r in done if r.exchange == "halo"),
        halo_bytes=sum(r.halo_bytes_per_call * r.calls_per_forward for r in done),
        needed_bytes=sum(r.needed_bytes_per_call * r.calls_per_forward for r in done),
        visible_pairs=sum(n * plan.visible_pairs(documents=f.documents, window=f.window, rank=rank) for f, n in forms),
        computed_pairs=plan.work(workload, rank) if done else 0,
    )


# -- the dump ------------------------------------------------------------------------------------------------
def write_dump(inspection: Inspection, directory: str) -> list[str]:
    """Write the inspection under ``directory`` (created; must be empty) and return the paths written.

    Files, the same bytes for the same model and arguments::

        summary.json              settings, every site row of every traced rank, per-rank totals, file list
        attention_pattern.png     every rank's (query, key) pattern under the plan (attention_pattern_image)
        rank{r}/graph{n}_before.py  graph n as Dynamo traced it for rank r (runnable print_readable code)
        rank{r}/graph{n}_after.py   the same graph after the cpcompile passes (refused sites left as they were)
        rank{r}/summary.json      what the pass did in rank r's graphs (the schema the backend's dump_dir writes)

    for every traced rank ``r`` and graph ``n``.
    """
    directory = os.fspath(directory)
    if os.path.isdir(directory) and os.listdir(directory):
        raise ValueError(
            f"dump folder {directory!r} is not empty; pass a new folder (files are never mixed with an older dump)"
        )
    os.makedirs(directory, exist_ok=True)
    written = []
    for rank in inspection.ranks:
        writer = RankDumpWriter(directory, rank, inspection.cp_size)
        for g in (g for g in inspection.graphs if g.rank == rank):
            written += writer.add_graph(
                g.before, g.after, list(g.reports), calls_per_forward=g.calls, positions=g.positions, mixing=g.mixing
            )
    written = list(dict.fromkeys(written))
    png = os.path.join(directory, "attention_pattern.png")
    attention_pattern_image(inspection.plan, documents=inspection.documents).save(png, format="PNG")
    written.append(png)
    summary = os.path.join(directory, "summary.json")
    written.append(summary)
    data = inspection.to_json()
    data["attention_pattern"] = dataclasses.asdict(pattern_geometry(inspection.padded_len, inspection.batch_size))
    data["files"] = sorted(os.path.relpath(p, directory).replace(os.sep, "/") for p in written)
    write_json(summary, data)
    return written
