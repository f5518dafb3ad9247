"""``cpcompile.backend``: the torch.compile backend that makes a model context-parallel."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import weakref
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.fx as fx

from cpcompile import _compat, _logging, cores, dump, regions
from cpcompile.options import BackendOptions
from cpcompile.passes.common import PassContext, counters
from cpcompile.passes.flex_cp import flex_cp_pass
from cpcompile.passes.mixing import EXCHANGED_ACTIONS, MixingReport, mixing_pass
from cpcompile.passes.positions import PositionReport, positions_pass, sequence_length
from cpcompile.passes.positions.check import exact_outputs, proved_handed_masks
from cpcompile.passes.positions.guards import LengthGuards, length_guards
from cpcompile.passes.sdpa_cp import SiteReport, cp_attention_pass
from cpcompile.runtime import (
    check_group,
    current_context,
    current_plan,
    is_exact,
    meet_before_backward,
    record_exact,
    record_graph_run,
    record_proved_masks,
)

__all__ = ["BackendOptions", "CPBackend", "TracedGraph", "backend"]

_backend_ids = itertools.count()
#: The live backends of this process by a key of their own, for unpickling a backend in the process that pickled it.
_LIVE_BACKENDS: weakref.WeakValueDictionary[int, CPBackend] = weakref.WeakValueDictionary()
_live_keys = itertools.count()


@dataclasses.dataclass
class TracedGraph:
    """One graph a backend in ``trace_only`` mode compiled: its code before and after the pass, its reports."""

    #: Global rank of the process that traced it.
    rank: int
    graph: int
    before: str
    after: str
    reports: tuple[SiteReport, ...]
    positions: tuple[PositionReport, ...] = ()
    mixing: tuple[MixingReport, ...] = ()
    #: How many times the (unrewritten) graph ran so far.
    calls: int = 0


class CPBackend:
    """A ``(GraphModule, example_inputs) -> callable`` compiler; build it with :func:`backend`.

    Every Dynamo graph goes through :func:`cpcompile.passes.cp_attention_pass`,
    :func:`cpcompile.passes.positions_pass` and :func:`cpcompile.passes.mixing_pass` (CP > 1) and then the inner
    compiler. ``reports`` lists what was done with every SDPA site of every graph compiled so far,
    ``position_reports`` with every position source, ``mixing_reports`` with every other op that mixes tokens.

    ``trace_only=True`` is how ``cpcompile inspect`` sees what training would run: every graph is rewritten in a
    copy with refusals recorded instead of raised, recorded in ``traced``, and the original graph runs
    (no collective is ever issued). A graph with a refusal also runs through the passes as training runs them, so
    that a sequence mixer training would find (``regions="found"``) is found here too. ``name`` prefixes the ids
    of its sites (default ``backend<n>``).

    ``copy.copy``/``copy.deepcopy`` return the backend itself (wrappers such as Lightning's ``torch.compile`` copy
    their arguments). A pickle holds the CP group's registered name and the options: unpickled in the same process
    it is the same backend; in another process, a new backend over the group registered there under that name
    (``TypeError`` naming the fix when there is none).
    """

    def __init__(
        self,
        cp_group: dist.ProcessGroup,
        options: BackendOptions,
        *,
        trace_only: bool = False,
        name: str | None = None,
    ) -> None:
        self.cp_size, self.cp_rank, self.group_name = check_group(cp_group)
        self.cp_group = cp_group
        if self.cp_size > 1 and not trace_only:
            _compat.forbid_eager_fallback_on_recompile_limit()
        if self.cp_size > 1 or options.attention == "block":  # flex sites reach the flex pass on CPU too
            _compat.trace_flex_attention_on_cpu()
        if self.cp_size > 1:  # before the first trace: a graph traced without CP then guards on it too
            cores.register_known_cores()
        self.options = options
        self.trace_only = trace_only
        self.reports: list[SiteReport] = []
        #: What :func:`cpcompile.passes.positions_pass` did with every position source (CP > 1).
        self.position_reports: list[PositionReport] = []
        #: What :func:`cpcompile.passes.mixing_pass` did with every op that mixes tokens outside attention (CP > 1).
        self.mixing_reports: list[MixingReport] = []
        self.traced: list[TracedGraph] = []
        #: Prefix of the ids of the sites this backend compiles (``backend<n>``, n counting backends per process).
        self.name = f"backend{next(_backend_ids)}" if name is None else name
        self._graphs = itertools.count()
        self._dump = (
            None if options.dump_dir is None else dump.writer_for(options.dump_dir, dist.get_rank(), self.cp_size)
        )
        self._key = next(_live_keys)
        _LIVE_BACKENDS[self._key] = self

    # Wrappers that copy their arguments (Lightning's torch.compile deep-copies its keyword arguments) get this
    # backend itself: it holds a process group, which cannot be copied, and its reports must stay in one place.
    def __copy__(self) -> CPBackend:
        return self

    def __deepcopy__(self, memo: dict) -> CPBackend:
        return self

    def __reduce__(self):
        """Pickle by reference: the CP group's registered name and the options (see :func:`_unpickle_backend`)."""
        fields = {f.name: getattr(self.options, f.name) for f in dataclasses.fields(self.options)}
        return (_unpickle_backend, (os.getpid(), self._key, self.group_name, fields, self.trace_only))

    def __call__(self, gm: fx.GraphModule, example_inputs: list[torch.Tensor]):
        graph_id = next(self._graphs)
        title = f"rank {dist.get_rank()}, graph {graph_id}"
        trace = _logging.GraphTrace(f"cpcompile {self.name} graph {graph_id}, CP rank {self.cp_rank} of {self.cp_size}")
        keep_source = self._dump is not None or self.trace_only or trace.wants_code()
        before = dump.graph_source(gm, f"{title}: as Dynamo traced it") if keep_source else ""
        target = copy.deepcopy(gm) if self.trace_only else gm
        ctx = PassContext(
            options=self.options,
            group_name=self.group_name,
            cp_size=self.cp_size,
            cp_rank=self.cp_rank,
            graph_id=graph_id,
            site_prefix=f"{self.name}/graph{graph_id}",
            refuse="report" if self.trace_only else "raise",
        )
        positions: list[PositionReport] = []
        mixing: list[MixingReport] = []
        plan = current_plan()
        chunk_len = plan.chunk_len if plan is not None else None
        guards, handed, exact = LengthGuards(()), [], []
        if self.cp_size > 1 and self.options.positions == "rewrite":
            seq = sequence_length(gm, chunk_len)
            guards = length_guards(seq)  # the model's decisions, before the passes'
            handed = proved_handed_masks(gm, seq) if seq is not None and not self.trace_only else []
        if self.cp_size > 1 and not self.trace_only:
            seq = sequence_length(gm, chunk_len, mixed=True)
            exact = exact_outputs(gm, seq) if seq is not None else []
        held = (len(self.reports), len(self.position_reports), len(self.mixing_reports), counters.copy())
        try:
            reports = flex_cp_pass(target, ctx)  # first: the SDPA pass refuses attention it does not rewrite
            reports += cp_attention_pass(target, ctx)
            self.reports += reports
            if self.cp_size > 1 and self.options.positions == "rewrite":  # after attention: its refusals first
                positions = positions_pass(target, ctx, chunk_len)
            if self.cp_size > 1 and self.options.mixing == "exact":  # last: it sees the rewritten attention
                mixing = mixing_pass(target, ctx, chunk_len)
                self.mixing_reports += mixing
            if guards and plan is not None:  # last: the passes' refusals name the code more precisely
                if self.trace_only:
                    refused = guards.refusal(plan.seq_len, plan.chunk_len)
                    if refused is not None:
                        positions.append(PositionReport(graph_id, "(shape guard)", "", "length", "refused", refused))
                else:
                    guards.check(plan.seq_len, plan.chunk_len)
        except _compat.PassThroughCompileError as e:  # a refusal: the refused graph is the one to look at
            if self.options.regions == "found" and not self.trace_only and self.cp_size > 1:
                why = regions.find(e, gm, chunk_len, self.cp_size)
                if why == regions.RESTART:
                    positions = []  # (kept by ``finally``)
                    self._trace_again(graph_id, held)
                elif why:
                    e.args = (f"{e.args[0]} (cpcompile found no head-parallel region for this op: {why}.)",)
            if self._dump is not None:
                self._dump.add_graph(before, "", [], refused=str(e))
            raise
        finally:
            self.position_reports += positions
        if self.trace_only and self.options.regions == "found" and self.cp_size > 1:
            refused = [r for r in (*positions, *mixing) if r.action == "refused"]
            why = self._regions_found(gm, ctx, chunk_len) if refused else ""
            if why == regions.RESTART:  # as training does
                self._trace_again(graph_id, held)
            elif why:  # the first refusal is the one training raises: positions first, as the passes run
                first = refused[0]
                note = dataclasses.replace(first, reason=f"{first.reason} (no head-parallel region: {why})")
                for held in (positions, mixing, self.position_reports, self.mixing_reports):
                    held[:] = [note if r is first else r for r in held]
        after = dump.graph_source(target, f"{title}: after the cpcompile passes") if keep_source else ""
        trace.emit(before, after, reports, rank=self.cp_rank, cp_size=self.cp_size, mixing=mixing)  # TORCH_LOGS, TRACE
        if self._dump is not None:
            self._dump.add_graph(before, after, reports, positions=positions, mixing=mixing)
        if self.trace_only:
            record = TracedGraph(
                dist.get_rank(), graph_id, before, after, tuple(reports), tuple(positions), tuple(mixing)
            )
            self.traced.append(record)

            def run(*args):
                record.calls += 1
                return gm.forward(*args)

            return run
        compiled = gm.forward if self.options.inner == "eager" else None
        if compiled is None:
            compiled = _compat.lookup_inner_backend(self.options.inner)(gm, example_inputs)
        if self.cp_size == 1:
            return compiled
        rewritten = any(r.action == "rewritten" for r in reports)
        mixes = rewritten or any(r.action in EXCHANGED_ACTIONS for r in mixing)
        if self.options.token_mixing == "required":  # pooled rows mix tokens across ranks, in forward only
            noted = mixes or any(r.action == "pooled" for r in mixing)
            compiled = _noting_graph_run(compiled, self.group_name, self.name, _frame_of(gm, graph_id), noted)
        if mixes:  # the graph's backward runs collectives
            compiled = _meeting_before_backward(compiled, self.group_name)
        if handed:
            compiled = _recording_proved_masks(compiled, handed)
        if exact:
            compiled = _recording_exact_outputs(compiled, exact)
        if guards:
            compiled = _checking_length_guards(compiled, guards)
        return compiled

    def _trace_again(self, graph_id: int, held: tuple[int, int, int, dict]) -> NoReturn:
        """Have Dynamo trace the frame of graph ``graph_id`` again, keeping nothing of it: a sequence mixer of the
        model's code was registered (:data:`cpcompile.regions.RESTART`), or a method lost the probe this graph was
        traced through. ``held``: the lengths of the attention, position and mixing reports and the counters
        before the graph's passes ran. The graph traced again keeps its number."""
        reports, positions, mixing, counted = held
        del self.reports[reports:]
        del self.position_reports[positions:]
        del self.mixing_reports[mixing:]
        counters.clear()
        counters.update(counted)
        self._graphs = itertools.count(graph_id)
        _compat.restart_trace("cpcompile: a sequence mixer of the model's code is run head-parallel")

    def _regions_found(self, gm: fx.GraphModule, ctx: PassContext, chunk_len: int | None) -> str:
        """In ``trace_only`` mode, what training's refusal of ``gm`` leads to (:func:`cpcompile.regions.find`):
        the passes run again on a copy of ``gm``, raising as training's do, and the refusal they raise goes to
        ``find``; their counters and reports are dropped. :data:`~cpcompile.regions.RESTART` also when ``find``
        took a method's probe away: the graph, traced through the probe, is traced again without it."""
        counted = counters.copy()
        raising = dataclasses.replace(ctx, refuse="raise")
        target = copy.deepcopy(gm)
        try:
            flex_cp_pass(target, raising)
            cp_attention_pass(target, raising)
            if self.options.positions == "rewrite":
                positions_pass(target, raising, chunk_len)
            if self.options.mixing == "exact":
                mixing_pass(target, raising, chunk_len)
        except _compat.PassThroughCompileError as e:
            probed = set(_compat.INLINED)
            why = regions.find(e, gm, chunk_len, self.cp_size)
            if set(_compat.INLINED) < probed:  # a method lost its probe, which this graph's guards read
                return regions.RESTART
            return why
        finally:
            counters.clear()
            counters.update(counted)
        return ""


def _frame_of(gm: fx.GraphModule, graph_id: int) -> str:
    """Where a graph's code comes from: the innermost frame of its first node's stack trace, for messages."""
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace")
        if trace:
            lines = [line.strip() for line in trace.splitlines() if line.strip().startswith("File ")]
            if lines:
                return f"graph {graph_id}: {lines[-1]}"
    return f"graph {graph_id}"


def _noting_graph_run(compiled, group_name: str, backend_name: str, frame: str, mixes: bool):
    """``compiled``, noting each run in the active shard step, with whether the graph mixes tokens across ranks
    (``runtime.record_graph_run``)."""

    def run(*args):
        record_graph_run(group_name, backend_name, frame, mixes)
        return compiled(*args)

    run._boxed_call = getattr(compiled, "_boxed_call", False)  # Dynamo calls a boxed function with one list
    return run


def _checking_length_guards(compiled, guards: LengthGuards):
    """``compiled``, which first checks the decisions its code took on the local length against the active plan's
    global length (:class:`~cpcompile.passes.positions.guards.LengthGuards`; once per length)."""

    def run(*args):
        plan = current_plan()
        if plan is not None:
            guards.check(plan.seq_len, plan.chunk_len)
        return compiled(*args)

    run._boxed_call = getattr(compiled, "_boxed_call", False)
    return run


def _recording_exact_outputs(compiled, outputs: list[tuple[int, tuple[int, ...]]]):
    """``compiled``, noting in the active shard step each per-token output computed only from inputs that were
    noted there (``runtime.record_exact``; see :func:`~cpcompile.passes.positions.check.exact_outputs`)."""

    def run(*args):
        context = current_context()
        boxed = len(args) == 1 and isinstance(args[0], list)  # one list of the graph's inputs: a boxed call
        inputs = list(args[0] if boxed else args)  # (which may clear that list)
        out = compiled(*args)
        if context is not None and not _compat.has_fake_tensor(inputs):  # fake: a compile-time run
            trusted = [out[i] for i, deps in outputs if all(is_exact(context, inputs[j]) for j in deps)]
            record_exact(trusted, context)
        return out

    run._boxed_call = getattr(compiled, "_boxed_call", False)
    return run


def _recording_proved_masks(compiled, outputs: list[int]):
    """``compiled``, noting the masks at ``outputs`` (proved with documents in this graph, handed on) in the active
    shard step (``runtime.record_proved_masks``), so that the graph that receives one trusts its documents."""

    def run(*args):
        out = compiled(*args)
        masks = [out[i] for i in outputs]
        if not _compat.has_fake_tensor(masks):  # fake: a compile-time run (DDPOptimizer), not a step
            record_proved_masks(masks)
        return out

    run._boxed_call = getattr(compiled, "_boxed_call", False)
    return run


def _meeting_before_backward(compiled, group_name: str):
    """``compiled``, whose outputs hold the step's backward round (``runtime.meet_before_backward``)."""

    def run(*args):
        out = compiled(*args)
        if not _compat.has_fake_tensor(out if isinstance(out, (list, tuple)) else (out,)):  # fake: compile time
            meet_before_backward(out, group_name)
        return out

    run._boxed_call = getattr(compiled, "_boxed_call", False)
    return run


def _unpickle_backend(pid: int, key: int, group_name: str, options: dict, trace_only: bool) -> CPBackend:
    """A pickled backend: the same object in the process that pickled it (while it lives), else a new backend with
    the same options over the process group registered under ``group_name`` in this process."""
    if pid == os.getpid() and (live := _LIVE_BACKENDS.get(key)) is not None:
        return live
    group = _compat.resolve_group(group_name)
    if group is None:
        raise TypeError(
            f"cannot unpickle a cpcompile backend: its CP process group {group_name!r} is not registered in this "
            "process (a process group cannot travel in a pickle); create the same process groups here first (same "
            "torch.distributed.new_group / init_device_mesh calls in the same order), or build the backend in this "
            "process with cpcompile.backend(cp_group)"
        )
    return CPBackend(group, BackendOptions(**options), trace_only=trace_only)


def backend(cp_group: dist.ProcessGroup, **options: object) -> CPBackend:
    """A torch.compile backend that runs every SDPA call of the model as context-parallel attention and makes
    the positions the model computes from the local sequence length global (or refuses them).

    ``model = torch.compile(model, backend=cpcompile.backend(cp_group))``, then call the model inside
    ``with cpcompile.shard(batch, cp_group) as local: model(**local)``.

    ``cp_group`` is the context-parallel process group (the ranks that share one sequence). ``options`` are the
    fields of :class:`cpcompile.options.BackendOptions`, each documented there: ``inner`` (``"inductor"``,
    ``"aot_eager"`` or ``"eager"``), ``attention``, ``block_size``, ``halo``, ``exchange`` and ``exchange_slots``
    (``"selective"``: full-attention layers receive only the keys their queries see), ``positions``, ``mixing``,
    ``per_token_ops``, ``config`` (the
    model's transformers config: pass it in training), ``regather_kv_in_backward``, ``dump_dir`` (``None``: the
    ``CPCOMPILE_DUMP_DIR`` environment variable, else no dump). An unknown option raises ``TypeError`` naming the
    known ones; a bad value, ``ValueError``.

    With a CP group of more than one rank this also sets Dynamo's ``fail_on_recompile_limit_hit``: a frame
    that exceeds the recompile limit raises instead of silently running uncompiled (local-only attention); and
    it raises Dynamo's per-frame ``recompile_limit`` to at least 64, since a policy and a reference model, grad
    and no-grad calls, ``train()`` and ``eval()`` and a changing length each compile a variant of the same frames.
    """
    known = {f.name for f in dataclasses.fields(BackendOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"cpcompile.backend got unknown option(s) {unknown}; the options are {sorted(known)} "
            "(see cpcompile.options.BackendOptions)"
        )
    if options.get("dump_dir", 0) is None:  # None: the environment's default, as when the option is not given
        del options["dump_dir"]
    return CPBackend(cp_group, BackendOptions(**options))


_registry_backends: dict[str, CPBackend] = {}


def _registry_backend(gm: fx.GraphModule, example_inputs: list[torch.Tensor]):
    """``torch.compile(model, backend="cpcompile")``: CP over the default (world) process group, inductor."""
    if not dist.is_initialized():
        raise RuntimeError(
            'backend="cpcompile" uses the default process group as the CP group, but torch.distributed is not '
            "initialized; call torch.distributed.init_process_group first, or pass "
            "backend=cpcompile.backend(cp_group)"
        )
    world = dist.group.WORLD
    key = _compat.group_name_of(world)
    if key not in _registry_backends:
        _registry_backends[key] = backend(world)
    return _registry_backends[key](gm, example_inputs)
