"""Tracing for ``cpcompile inspect``: :func:`inspect_model` traces a model as every CP rank, in one process.

Each rank is traced under a fake process group (no communication) of the CP size, with the model and the local
batch on the ``meta`` device by default: no weights are allocated and no attention is computed; Dynamo traces
the model on the shapes alone, with the same dynamic sequence length as training. The backend is the one
training builds (:class:`~cpcompile.backend.CPBackend`, same options) in its ``trace_only`` mode: every graph is
rewritten in a copy with refusals listed instead of raised, and the untouched graph is what runs (on meta), so
no collective is ever issued.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cpcompile import _compat
from cpcompile.backend import CPBackend, TracedGraph
from cpcompile.inspect.batch import packed_batch
from cpcompile.inspect.load import is_config, load_model
from cpcompile.inspect.report import Inspection, RankSite, RankTotals
from cpcompile.layouts import DEFAULT_BLOCK_SIZE, DEFAULT_LAYOUT, Workload, check_layout
from cpcompile.options import BackendOptions
from cpcompile.passes.sdpa_cp import SiteReport
from cpcompile.plan import CPPlan, build_plan
from cpcompile.runtime import current_plan, mark_local_dynamic, shard
from cpcompile.runtime.shard_options import RECURRENCES
from cpcompile.runtime.workload import workload_of

__all__ = ["inspect_model"]


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
    recurrence: str = "heads",
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
        recurrence: how the recurrent cores that support both run, as :func:`cpcompile.shard`'s ``recurrence``
            (``"heads"``: head-parallel, the default; ``"state"``: state passing).
        use_config: pass a transformers model's config to the backend (``backend(..., config=model.config)``),
            as training should: windows and refusals that come from the config then show.

    The model is called in train mode the way :func:`cpcompile.shard` calls it in training (this rank's tokens,
    global ``position_ids``, ``shift_labels``, ``use_cache=False``, a dynamic sequence length), under a fake
    process group, once per rank, through the backend training builds with the same options. It needs a
    process without an initialized default process group, and clears torch.compile's caches
    (``torch.compiler.reset()``) around every trace. Raises ``ValueError`` for bad arguments,
    ``RuntimeError`` when tracing fails.
    """
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
    check_layout(layout)
    if recurrence not in RECURRENCES:
        raise ValueError(f"recurrence={recurrence!r}: expected one of {RECURRENCES} (as cpcompile.shard takes)")

    net = load_model(model, device=device, dtype=dtype, attn_implementation=attn_implementation)
    config = getattr(net, "config", None)
    options = BackendOptions(
        inner="eager",
        attention=attention,
        block_size=block_size,
        config=config if use_config and is_config(config) else None,
        dump_dir=None,
    )
    vocab = int(getattr(config, "vocab_size", 2) or 2)
    batch = packed_batch([list(r) for r in rows_docs], vocab_size=vocab, seed=0)
    param = next(iter(net.parameters()), None)
    model_dtype = str(param.dtype if param is not None else torch.get_default_dtype()).removeprefix("torch.")

    graphs: list[TracedGraph] = []
    for rank in ranks:
        graphs += _trace_rank(net, batch, rank, cp_size, device, model, options, layout, recurrence)
    reports = [(g, report.resolved()) for g in graphs for report in g.reports]
    workload = _workload([report for _, report in reports], options.block_size)
    plans = {r: build_plan(batch, cp_size, r, layout=layout, workload=workload) for r in ranks}
    rows = tuple(_rank_site(g, report, plans[g.rank]) for g, report in reports)
    rewritten = [r for r in rows if r.action == "rewritten"]
    documents = not rewritten or rewritten[0].documents
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
        recurrence=recurrence,
    )


def _trace_rank(
    net, batch, rank: int, cp_size: int, device: str, spec: str, options, layout, recurrence: str
) -> list[TracedGraph]:
    with _compat.fake_process_group(rank, cp_size) as group:
        tracer = CPBackend(group, options, trace_only=True, name="inspect")
        torch.compiler.reset()
        try:
            compiled = torch.compile(net, backend=tracer)
            workload = Workload(block_size=options.block_size)
            with shard(batch, group, layout=layout, workload=workload, recurrence=recurrence) as local:
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
    """The attention forms of the rewritten sites, as training's balanced layout would balance them."""
    layers: dict[tuple[bool, int | None], set[str]] = {}
    for r in rows:
        if r.action == "rewritten":
            layers.setdefault((r.documents, r.window), set()).add(r.layer)
    selective = any(r.action == "rewritten" and r.exchange == "selective" for r in rows)
    return workload_of(layers, block_size, split_keys=selective)


def _rank_site(graph: TracedGraph, report: SiteReport, plan: CPPlan) -> RankSite:
    """The row of ``report`` on ``graph``'s rank, with the exchanged (halo or selective) and needed bytes of the
    plan's batch."""
    if report.action != "rewritten" or plan.cp_size == 1 or len(report.k_shape) != 4:
        return RankSite(graph.rank, graph.calls, report)
    itemsize = getattr(torch, report.dtype).itemsize
    per_token = report.kv_heads * (report.k_shape[3] + report.v_shape[3]) * itemsize  # K and V, one row
    rows = range(plan.batch_size)
    needed = sum(len(plan.keys_needed(report.window, row=b, documents=report.documents)) for b in rows) * per_token
    exchanged = 0
    if report.exchange in ("halo", "selective"):  # one all-to-all of the keys the plan routes, every row
        exchanged = len(plan.exchange_needs(report.window, documents=report.documents)) * plan.batch_size * per_token
    return RankSite(graph.rank, graph.calls, report, halo_bytes_per_call=exchanged, needed_bytes_per_call=needed)


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
        halo_exchanges=sum(2 * r.calls_per_forward for r in done if r.exchange in ("halo", "selective")),
        halo_bytes=sum(r.halo_bytes_per_call * r.calls_per_forward for r in done),
        needed_bytes=sum(r.needed_bytes_per_call * r.calls_per_forward for r in done),
        visible_pairs=sum(n * plan.visible_pairs(documents=f.documents, window=f.window, rank=rank) for f, n in forms),
        computed_pairs=plan.work(workload, rank) if done else 0,
    )
