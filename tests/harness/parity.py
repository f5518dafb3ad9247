"""The one parity harness: a model compiled with cpcompile on a CP group vs the same model eager in one process.

Every multi-process test that compares CP with the unsharded model goes through this module, and its tolerances
live in :mod:`tests.harness.tolerances`, the one place. Inside a rank of :func:`tests.harness.dist.run_distributed`::

    runner = ParityRunner(ParityCase(model="qwen3", doc_lens=((10, 20, 7), (5, 30, 2))), group)
    outcome = runner.run()          # one CP training step on this rank's chunk, gathered and summed
    assert_parity(outcome)          # assert_close of logits, loss and every gradient (named tolerances)
    errors = outcome.errors()       # max abs differences, for reports

The reference is the unsharded model run eagerly in this process on the whole global batch
(:func:`reference_step`; every rank runs it and builds the same weights and batch from the case's seeds). The CP
side (:func:`cp_step`) compiles an identical copy with ``cpcompile.backend(group, ...)`` and the case's options
(inner compiler, attention path, layout, config), runs it on ``cpcompile.shard``'s local batch, gathers the
logits, sums the per-rank losses and every parameter's gradient over the group. Training loops with several
steps (FSDP2 with an optimizer) call :func:`reference_step` and :func:`cp_step` directly.

Models (:meth:`ParityCase.build_model`): any family of :data:`cpcompile.testing.FAMILIES` (transformers models
built from tiny configs), ``"attn:<form>"`` for :func:`tests.models.attention.attention_lm`, or
``"module:factory"``.

Negative controls (:data:`CONTROLS`, :meth:`ParityRunner.run`) break the CP side through public means only (the
batch handed to ``shard``, the ``local`` batch handed to the model, the backend's options), but ``short_halo``,
which patches the mixing pass's finder, and must fail the same check, or be refused by cpcompile, with the error
they cause.

Why one module of about 580 lines: every parity test of the suite goes through :class:`ParityRunner` and
:func:`check_case`; the reference step, the CP step, the comparison and the controls that must fail it are kept
together so that a change to one is made against the others.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import math
import time
from collections.abc import Callable, Mapping
from typing import Literal

import torch
import torch.distributed as dist

import cpcompile
from cpcompile.backend import CPBackend
from cpcompile.testing import FAMILIES, HYBRID_FAMILIES, MOE_FAMILIES, packed_batch, tiny_model
from tests.harness.tolerances import GRAD_TOL, LOGITS_TOL, LOSS_TOL
from tests.models import attention as _models

#: Negative controls of :meth:`ParityRunner.run`:
#:
#: * ``label_shift``: the model gets this rank's labels unshifted as ``shift_labels`` (the chunk-boundary bug);
#:   the logits stay right, the loss and gradients do not.
#: * ``merge_documents``: the CP run is given the batch with its documents merged (``position_ids`` counting
#:   through the whole row), the reference keeps them apart: the logits differ.
#: * ``plan_merges_documents``: ``shard`` gets the merged batch (its plan attends across documents) but the
#:   model gets the batch's true ``position_ids``: refused by the mask check, which runs on every step
#:   (``MaskMismatchError`` on every rank), also on a site already checked with the right documents.
#: * ``wrong_window``: the backend gets a copy of the model config whose ``sliding_window`` is one token larger
#:   (windowed models only): refused at compile time (``UnsupportedAttentionError``).
#: * ``positions_off``: the case compiled afresh with ``cpcompile.backend(..., positions="off")``, so positions the
#:   model computes from the local length stay local (models that compute positions): the logits differ.
#: * ``mixing_off``: the case compiled afresh with ``cpcompile.backend(..., mixing="off")``, so ops that mix tokens
#:   outside attention (a causal conv1d, a token shift, a cumsum) see only this rank's tokens: the logits differ.
#: * ``short_halo``: the case compiled afresh with every causal region that takes a halo taking one token fewer
#:   than it reads (the mixing pass's :func:`~cpcompile.passes.mixing.regions.causal_region` patched; regions of a
#:   halo of 2 or more tokens): the first tokens of every run but the sequence's first miss one token, the logits
#:   differ.
Corruption = Literal[
    "label_shift",
    "merge_documents",
    "plan_merges_documents",
    "wrong_window",
    "positions_off",
    "mixing_off",
    "short_halo",
]
CONTROLS: tuple[Corruption, ...] = ("label_shift", "merge_documents", "plan_merges_documents", "wrong_window")


@dataclasses.dataclass(frozen=True)
class ParityCase:
    """One parity configuration (picklable: sent to spawned ranks)."""

    #: A family of ``cpcompile.testing.FAMILIES``, ``"attn:<form>"`` (``tests.models.attention.attention_lm``) or
    #: ``"package.module:factory"`` (called as ``factory(seed=seed, **overrides)``; must return a model in train
    #: mode taking a transformers causal LM's keyword arguments and returning ``.loss``/``.logits``).
    model: str
    #: Packed documents per row (every row the same total length); B = len(doc_lens).
    doc_lens: tuple[tuple[int, ...], ...]
    #: Inner compiler of cpcompile.backend. ``"eager"`` (the rewritten graph runs as traced, its backward by
    #: autograd) unless a case is about AOTAutograd or inductor: compiling the joint graph costs about half of a
    #: case's time, and each test file names the cases that take that path.
    inner: str = "eager"
    #: Weight seed and batch seed.
    seed: int = 0
    batch_seed: int = 1
    #: Config overrides for HF models / keyword arguments of the factory (``attention_lm`` for ``"attn:<form>"``).
    overrides: tuple[tuple[str, object], ...] = ()
    #: SDPA sites that must be rewritten (one per attention layer); default: the model's layer count.
    expected_sites: int | None = None
    #: How every site must call SDPA, as reported by the pass: (mask form, enable_gqa); None: not checked.
    expected_form: tuple[str, bool] | None = None
    #: Extra keyword arguments of ``cpcompile.backend`` (options added by later features).
    backend_kwargs: tuple[tuple[str, object], ...] = ()
    #: The backend's attention path: ``"auto"`` (block on CPU), ``"dense"`` (the CUDA default) or ``"block"``.
    attention: str = "auto"
    #: ``cpcompile.shard``'s layout (``cpcompile.plan.LAYOUTS``).
    layout: str = "contiguous"
    #: Pass the model's transformers config to the backend (``config=model.config``), as training should.
    use_config: bool = False
    #: Fields changed in the copy of the config the backend gets (negative controls; implies ``use_config``).
    config_overrides: tuple[tuple[str, object], ...] = ()
    #: ``torch.compile(..., fullgraph=...)`` of the CP copy.
    fullgraph: bool = False
    #: Activation checkpointing of the CP copy's decoder layers (``gradient_checkpointing_enable``).
    checkpointing: bool = False
    #: ``(kind, action)`` of every position source the backend must report, in order; None: not checked.
    expected_positions: tuple[tuple[str, str], ...] | None = None
    #: Extra keyword arguments of ``cpcompile.shard`` (e.g. the balanced layout's ``workload``).
    shard_kwargs: tuple[tuple[str, object], ...] = ()
    #: ``(op, action)`` of every op the mixing pass must report, in order; None: not checked.
    expected_mixing: tuple[tuple[str, str], ...] | None = None
    #: ``"package.module:function"`` called as ``function(batch)`` on the global batch; the entries it returns
    #: join the batch (e.g. flex BlockMasks built for the whole sequence, as torchtitan's trainer builds them).
    batch_extras: str | None = None

    @property
    def name(self) -> str:
        T = sum(self.doc_lens[0])
        extra = "".join(
            f"/{v}" for v, default in ((self.attention, "auto"), (self.layout, "contiguous")) if v != default
        )
        settings = "".join(f"/{k}={v}" for k, v in (*self.overrides, *self.backend_kwargs))
        return f"{self.model}{settings}/B{len(self.doc_lens)}/T{T}/{self.inner}{extra}"

    def build_model(self) -> torch.nn.Module:
        kwargs = dict(self.overrides)
        if self.model.startswith("attn:"):
            return _models.attention_lm(self.model.removeprefix("attn:"), seed=self.seed, **kwargs)
        if ":" in self.model:
            module, _, factory = self.model.partition(":")
            return getattr(importlib.import_module(module), factory)(seed=self.seed, **kwargs)
        families = {**FAMILIES, **MOE_FAMILIES, **HYBRID_FAMILIES}
        if self.model not in families:
            raise ValueError(
                f"unknown model {self.model!r}; use one of {sorted(families)}, 'attn:<form>' or 'module:factory'"
            )
        return tiny_model(self.model, seed=self.seed, **kwargs)

    def batch(self, extras: bool = True) -> dict[str, object]:
        """The global batch (``extras``: with :attr:`batch_extras`' entries)."""
        batch = packed_batch([list(r) for r in self.doc_lens], seed=self.batch_seed)
        if extras and self.batch_extras is not None:
            module, _, function = self.batch_extras.partition(":")
            batch.update(getattr(importlib.import_module(module), function)(batch))
        return batch

    def backend(self, group: dist.ProcessGroup, model: torch.nn.Module) -> CPBackend:
        """``cpcompile.backend`` with this case's options for ``model``."""
        kwargs = {"inner": self.inner, "attention": self.attention, **dict(self.backend_kwargs)}
        if self.use_config or self.config_overrides:
            config = model.config
            if self.config_overrides:
                config = copy.deepcopy(config)
                for key, value in self.config_overrides:
                    setattr(config, key, value)
            kwargs["config"] = config
        return cpcompile.backend(group, **kwargs)

    def plan_kwargs(self) -> dict[str, object]:
        """The ``shard_kwargs`` that shape the plan (``shard``'s own ``dynamic``, ``pad_values`` and ``recurrence``
        do not)."""
        return {k: v for k, v in self.shard_kwargs if k not in ("dynamic", "pad_values", "recurrence")}

    def max_runs(self, cp_size: int) -> int:
        """The most runs of consecutive tokens one rank holds when ``shard`` places this case's batch."""
        plan = cpcompile.plan.build_plan(self.batch(extras=False), cp_size, 0, layout=self.layout, **self.plan_kwargs())
        return int(cpcompile.plan.count_runs(plan.indices).max())

    def check_layout(self, cp_size: int) -> None:
        """Refuse a case that would not exercise CP: B >= 2 and some document held by more than one rank."""
        if len(self.doc_lens) < 2:
            raise ValueError(f"case {self.name}: use B >= 2 rows, got {len(self.doc_lens)}")
        if cp_size == 1:
            return
        plan = cpcompile.plan.build_plan(self.batch(extras=False), cp_size, 0, layout=self.layout, **self.plan_kwargs())
        owner = torch.empty(plan.padded_len, dtype=torch.long)
        owner[plan.gathered_indices()] = torch.arange(cp_size).repeat_interleave(plan.chunk_len)
        crossing = any(
            len(set(owner[start : start + n].tolist())) > 1
            for row in self.doc_lens
            for start, n in zip(_starts(row), row)
        )
        if not crossing:
            raise ValueError(f"case {self.name}: no document is split between ranks at CP={cp_size}")


def _starts(row: tuple[int, ...]) -> list[int]:
    return [sum(row[:i]) for i in range(len(row))]


def merged_documents(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` with one document per row: ``position_ids`` count 0..T-1 through the packed documents."""
    B, T = batch["input_ids"].shape
    return {**batch, "position_ids": torch.arange(T).expand(B, T).contiguous()}


# -- one step on each side --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Step:
    """One forward/backward: logits in global token order, the global loss, every parameter's global gradient."""

    logits: torch.Tensor
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    #: CP side only: the collectives cpcompile counted, and the gloo events the profiler saw (``profile=True``).
    comm: cpcompile.runtime.CommStats | None = None
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Elements each all-to-all delivered to this rank, in the order they ran (``profile=True``): read from the
    #: profiler's record of the call (the receive tensor's shape and split sizes), not from cpcompile.
    all_to_all_received: list[int] = dataclasses.field(default_factory=list)


def reference_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Step:
    """The unsharded model, eager, on the whole global batch (``use_cache=False``, as ``shard`` calls it)."""
    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return Step(out.logits.detach(), out.loss.detach(), grads)


def _all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t


def sum_grads_over_cp(model: torch.nn.Module, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Every parameter's gradient summed over the CP group (each rank holds the partial sum of its tokens)."""
    return {n: _all_reduce_sum(p.grad, group) for n, p in model.named_parameters() if p.grad is not None}


def cp_step(
    compiled: Callable[..., object],
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    group: dist.ProcessGroup,
    *,
    layout: str = "contiguous",
    shard_kwargs: Mapping[str, object] | None = None,
    dp_group: dist.ProcessGroup | None = None,
    full_grads: Callable[[torch.nn.Module, dist.ProcessGroup], dict[str, torch.Tensor]] = sum_grads_over_cp,
    corrupt: Corruption | None = None,
    profile: bool = False,
) -> Step:
    """One CP training step of ``compiled`` (the compiled ``model``) on this rank's part of ``batch``.

    The loss is summed over ``group`` (with ``dp_group``, ``batch`` holds this DP rank's rows and the loss is
    this DP rank's share of the global mean), the logits are gathered into token order, ``shard_kwargs`` go to
    ``cpcompile.shard``, ``full_grads`` gives the
    whole-sequence gradients. ``corrupt`` applies a negative control (:data:`CONTROLS`) to what ``shard`` or
    the model gets; ``profile`` counts the gloo collectives of the step with ``torch.profiler``.
    """
    model.zero_grad(set_to_none=True)
    plan_batch = merged_documents(batch) if corrupt in ("merge_documents", "plan_merges_documents") else batch
    kwargs = dict(shard_kwargs or {}) if dp_group is None else {**(shard_kwargs or {}), "dp_group": dp_group}
    profiler = torch.profiler.profile(record_shapes=True) if profile else contextlib.nullcontext()
    with cpcompile.shard(plan_batch, group, layout=layout, **kwargs) as local:
        if corrupt == "label_shift":
            local["shift_labels"] = local["labels"]
        elif corrupt == "plan_merges_documents":  # the batch's true positions, into the tensor shard marked
            true = cpcompile.plan.build_plan(batch, dist.get_world_size(group), 0)  # position ids of every token
            local["position_ids"].copy_(cpcompile.runtime.current_plan().local(true.position_ids))
        with profiler:
            out = compiled(**local)
            out.loss.backward()
        logits = cpcompile.gather(out.logits.detach())
    collectives: dict[str, int] = {}
    received: list[int] = []
    if profile:
        events = sorted(profiler.events(), key=lambda e: e.time_range.start)
        for event in events:
            if event.name.startswith("gloo:"):
                collectives[event.name] = collectives.get(event.name, 0) + 1
            if event.name == "c10d::alltoall_base_":  # (output, input, group, output splits, input splits, ...)
                rows = event.input_shapes[0][1:]
                received.append(sum(event.concrete_inputs[3]) * math.prod(rows))
    return Step(
        logits=logits,
        loss=_all_reduce_sum(out.loss, group),
        grads=full_grads(model, group),
        comm=dataclasses.replace(cpcompile.comm_stats()),
        collectives=collectives,
        all_to_all_received=received,
    )


# -- the runner -------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ParityOutcome:
    """Reference and CP results of one step, on one rank (CP values already gathered / summed over ranks)."""

    case: ParityCase
    cp_size: int
    ref_logits: torch.Tensor
    cp_logits: torch.Tensor
    ref_loss: torch.Tensor
    cp_loss: torch.Tensor
    ref_grads: dict[str, torch.Tensor]
    cp_grads: dict[str, torch.Tensor]
    #: (mask form, enable_gqa) of every site this runner's backend compiled so far.
    forms: list[tuple[str, bool]]
    #: (kind, action) of every position source this runner's backend reported so far.
    positions: list[tuple[str, str]]
    #: What cpcompile did: SiteReport actions of every graph this runner's backend compiled so far, counter
    #: deltas of this step (compiles happen on the first step only), collectives of this step.
    actions: list[str]
    counter_delta: dict[str, int]
    comm: cpcompile.runtime.CommStats
    seconds: float
    #: The attention each rewritten site emitted (``"dense"`` or ``"block"``), in compile order.
    kernels: list[str] = dataclasses.field(default_factory=list)
    #: gloo collectives seen by the profiler in this step (``run(profile=True)``), by event name.
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Elements each all-to-all delivered to this rank in this step, in order, as the profiler recorded them.
    all_to_all_received: list[int] = dataclasses.field(default_factory=list)
    #: SDPA sites the case must rewrite (``case.expected_sites``, else the model's attention layer count).
    expected_sites: int = 0
    #: (op, action) of every op the mixing pass reported for this runner's backend so far.
    mixing: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    #: The bytes per call the mixing reports give (summed over every op reported so far): ``"heads"``, the
    #: all-to-alls of head-parallel and replicated regions; ``"state"``, the all-gathers of state summaries.
    reported_bytes: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.case.name} CP={self.cp_size}"

    def errors(self) -> dict[str, float]:
        """Max absolute differences (and the largest gradient's name), for reports."""
        grad_err = {n: (self.cp_grads[n] - g).abs().max().item() for n, g in self.ref_grads.items()}
        worst = max(grad_err, key=grad_err.get)
        return {
            "logits": (self.cp_logits - self.ref_logits).abs().max().item(),
            "loss": (self.cp_loss - self.ref_loss).abs().item(),
            "grad": grad_err[worst],
            "grad_param": worst,
            "grad_max_abs": max(g.abs().max().item() for g in self.ref_grads.values()),
        }


def assert_parity(outcome: ParityOutcome) -> None:
    """``assert_close`` of gathered logits, summed loss and every summed gradient against the reference."""
    name = outcome.name
    torch.testing.assert_close(outcome.cp_logits, outcome.ref_logits, **LOGITS_TOL, msg=lambda m: f"{name} logits: {m}")
    torch.testing.assert_close(outcome.cp_loss, outcome.ref_loss, **LOSS_TOL, msg=lambda m: f"{name} loss: {m}")
    assert outcome.cp_grads.keys() == outcome.ref_grads.keys(), f"{name}: CP and reference have different parameters"
    for pname, ref in outcome.ref_grads.items():
        torch.testing.assert_close(
            outcome.cp_grads[pname], ref, **GRAD_TOL, msg=lambda m, p=pname: f"{name} grad of {p}: {m}"
        )


def compare_steps(
    ref: Step, cp: Step, what: str = "", tols: tuple[dict, dict, dict] = (LOGITS_TOL, LOSS_TOL, GRAD_TOL)
) -> tuple[dict[str, float], list[str]]:
    """For steps run outside :class:`ParityRunner`: the max absolute differences of logits, loss and gradients,
    and one line per quantity that fails its tolerance (``assert_close`` with ``tols``: logits, loss, gradients),
    prefixed with ``what``."""
    errors = {
        "logits": (cp.logits - ref.logits).abs().max().item(),
        "loss": (cp.loss - ref.loss).abs().item(),
        "grad": max((cp.grads[n] - g).abs().max().item() for n, g in ref.grads.items()),
    }
    pairs = [("logits", cp.logits, ref.logits, tols[0]), ("loss", cp.loss, ref.loss, tols[1])]
    pairs += [(f"grad of {n}", cp.grads.get(n), g, tols[2]) for n, g in ref.grads.items()]
    failing = []
    for name, got, want, tol in pairs:
        try:
            torch.testing.assert_close(got, want, **tol)
        except (AssertionError, TypeError) as e:
            failing.append(f"{what}{name}: {e}")
    return errors, failing


def failing_quantities(outcome: ParityOutcome) -> list[str]:
    """Which of ``logits``, ``loss``, ``grads`` differ from the reference beyond their tolerance."""
    failed = []
    checks = (
        ("logits", [(outcome.cp_logits, outcome.ref_logits)], LOGITS_TOL),
        ("loss", [(outcome.cp_loss, outcome.ref_loss)], LOSS_TOL),
        ("grads", [(outcome.cp_grads[n], g) for n, g in outcome.ref_grads.items()], GRAD_TOL),
    )
    for quantity, pairs, tol in checks:
        try:
            for got, want in pairs:
                torch.testing.assert_close(got, want, **tol)
        except AssertionError:
            failed.append(quantity)
    return failed


def assert_rewrites(outcome: ParityOutcome, expected_sites: int) -> None:
    """Exactly ``expected_sites`` SDPA sites rewritten, none refused, and K and V exchanged once per site (an
    all-gather each, or a halo exchange each at sliding-window sites), every exchange with its backward."""
    name = outcome.name
    rewritten = outcome.actions.count("rewritten")
    assert rewritten == expected_sites, f"{name}: {rewritten} SDPA sites rewritten, expected {expected_sites}"
    assert outcome.counter_delta.get("sdpa_rewritten", 0) == expected_sites, f"{name}: {outcome.counter_delta}"
    assert outcome.counter_delta.get("sdpa_refused", 0) == 0, f"{name}: {outcome.counter_delta}"
    if outcome.case.attention != "auto":
        assert set(outcome.kernels) == {outcome.case.attention}, f"{name}: attention emitted {outcome.kernels}"
    if outcome.cp_size > 1:
        # one step: K and V exchanged once per site (an all-gather each, or a halo exchange each at sliding-window
        # sites; again in backward where activation checkpointing recomputes the layer), each with its backward
        # (reduce-scatter or halo return)
        comm = outcome.comm
        # an exchange of needed keys runs again in backward under regather_kv_in_backward (a regathered
        # all-gather is issued inside the graph's backward and not counted again)
        refetched = dict(outcome.case.backend_kwargs).get("regather_kv_in_backward") and comm.halo_exchanges
        runs = 2 if outcome.case.checkpointing or refetched else 1
        assert comm.all_gathers + comm.halo_exchanges == 2 * expected_sites * runs, f"{name}: {comm}"
        if not (outcome.case.checkpointing or refetched):  # an exchange run again moves its keys again
            assert comm.reduce_scatters == comm.all_gathers, f"{name}: {comm}"
            assert comm.halo_backward_bytes == comm.halo_bytes, f"{name}: {comm}"


class ParityRunner:
    """Builds the reference (eager, whole batch) once and the compiled CP model once; ``run`` does one CP step.

    Extension points for other setups: ``wrap`` turns the CP copy into what gets compiled (e.g. applies
    ``fully_shard``; default: the model itself), ``compile`` turns ``(model, backend)`` into the callable a step
    calls with the local batch (default: ``torch.compile(model, backend=..., fullgraph=case.fullgraph)``) and
    ``full_grads`` returns the whole-sequence gradient of every parameter by name on this rank (default:
    :func:`sum_grads_over_cp`).
    """

    def __init__(
        self,
        case: ParityCase,
        group: dist.ProcessGroup,
        *,
        wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
        compile: Callable[[torch.nn.Module, CPBackend], Callable[..., object]] | None = None,
        full_grads: Callable[[torch.nn.Module, dist.ProcessGroup], dict[str, torch.Tensor]] = sum_grads_over_cp,
    ) -> None:
        self.case, self.group, self.full_grads = case, group, full_grads
        self.cp_size = dist.get_world_size(group)
        case.check_layout(self.cp_size)
        self.batch = case.batch()
        self.ref_model = case.build_model()
        self.reference = reference_step(self.ref_model, self.batch)
        self.model = case.build_model()
        if case.checkpointing:
            self.model.gradient_checkpointing_enable()
        if wrap is not None:
            self.model = wrap(self.model)
        self.expected_sites = case.expected_sites if case.expected_sites is not None else _layer_count(self.model)
        self.backend = case.backend(group, self.model)
        if compile is None:
            self.compiled = torch.compile(self.model, backend=self.backend, fullgraph=case.fullgraph)
        else:
            self.compiled = compile(self.model, self.backend)

    def run(
        self, corrupt: Corruption | None = None, *, batch: dict[str, torch.Tensor] | None = None, profile: bool = False
    ) -> ParityOutcome:
        """One CP step on ``batch`` (default: the case's), next to the reference on the same batch.

        ``corrupt`` applies a negative control to the CP side (:data:`CONTROLS`; ``wrong_window`` needs a fresh
        backend: see :func:`check_case`); ``profile`` records the step's gloo collectives.
        """
        start = time.perf_counter()
        ref = self.reference if batch is None else reference_step(self.ref_model, batch)
        batch = self.batch if batch is None else batch
        before = dict(cpcompile.passes.counters)
        cp = cp_step(
            self.compiled,
            self.model,
            batch,
            self.group,
            layout=self.case.layout,
            shard_kwargs=dict(self.case.shard_kwargs),
            full_grads=self.full_grads,
            corrupt=corrupt,
            profile=profile,
        )
        return ParityOutcome(
            case=self.case,
            cp_size=self.cp_size,
            ref_logits=ref.logits,
            cp_logits=cp.logits,
            ref_loss=ref.loss,
            cp_loss=cp.loss,
            ref_grads=ref.grads,
            cp_grads=cp.grads,
            actions=[r.action for r in self.backend.reports],
            forms=[(r.mask_form, r.enable_gqa) for r in self.backend.reports],
            positions=[(r.kind, r.action) for r in self.backend.position_reports],
            kernels=[r.kernel for r in self.backend.reports if r.action == "rewritten"],
            counter_delta={k: v - before.get(k, 0) for k, v in cpcompile.passes.counters.items()},
            comm=cp.comm,
            collectives=cp.collectives,
            all_to_all_received=cp.all_to_all_received,
            seconds=time.perf_counter() - start,
            expected_sites=self.expected_sites,
            mixing=[(r.op, r.action) for r in self.backend.mixing_reports],
            reported_bytes={
                "heads": sum(r.all_to_all_bytes_per_call for r in self.backend.mixing_reports),
                "state": sum(
                    r.all_gather_bytes_per_call for r in self.backend.mixing_reports if r.action == "state_passing"
                ),  # fmt: skip
            },
        )


@contextlib.contextmanager
def _short_halo():
    """Within: every causal region the mixing pass finds with a halo of ``h >= 2`` tokens takes ``h - 1``."""
    from cpcompile.passes.mixing import find

    real = find.causal_region

    def short(start, g):
        region, why = real(start, g)
        if region is not None and region.halo > 1:
            region = dataclasses.replace(region, halo=region.halo - 1)
        return region, why

    find.causal_region = short
    try:
        yield
    finally:
        find.causal_region = real


def run_control(
    case: ParityCase, group: dist.ProcessGroup, corrupt: Corruption, runner: ParityRunner | None = None, **runner_kwargs
) -> dict:
    """Run one negative control; return whether it was caught, how (``error``: the exception type, or
    ``"parity"`` with the ``failing`` quantities), the errors it caused and the first line of the message.

    ``runner`` is reused when given (its sites are already compiled and checked); ``wrong_window`` always
    compiles afresh with the changed config.
    """
    try:
        if corrupt in ("positions_off", "mixing_off"):
            torch._dynamo.reset()  # compile the control afresh, with no cache entry of the rewritten graph
            option = corrupt.removesuffix("_off")
            off = dataclasses.replace(case, backend_kwargs=(*case.backend_kwargs, (option, "off")))
            bad = ParityRunner(off, group, **runner_kwargs).run()
            assert bad.positions == [] and bad.mixing == [], f"{case.name}: {option}='off' still reported ops"
        elif corrupt == "short_halo":
            torch._dynamo.reset()
            with _short_halo():
                bad = ParityRunner(case, group, **runner_kwargs).run()
            assert ("conv1d", "halo") in bad.mixing or ("pad", "halo") in bad.mixing, f"{case.name}: {bad.mixing}"
        elif corrupt == "wrong_window":
            window = case.build_model().config.sliding_window
            bad_case = dataclasses.replace(case, config_overrides=(("sliding_window", window + 1),))
            torch._dynamo.reset()
            runner = ParityRunner(bad_case, group, **runner_kwargs)
            bad = runner.run()
        else:
            bad = (runner or ParityRunner(case, group, **runner_kwargs)).run(corrupt)
        assert_parity(bad)
    except (cpcompile.UnsupportedAttentionError, cpcompile.MaskMismatchError) as e:
        return {"caught": True, "error": type(e).__name__, "message": str(e).splitlines()[0]}
    except AssertionError as e:
        return {
            "caught": True,
            "error": "parity",
            "failing": failing_quantities(bad),
            **bad.errors(),
            "message": str(e).splitlines()[0],
        }
    return {"caught": False, "error": "none", **bad.errors()}


def check_case(
    case: ParityCase, group: dist.ProcessGroup, *, controls: tuple[Corruption, ...] = (), **runner_kwargs
) -> dict:
    """Run ``case`` on this rank, assert parity and rewrites, then run each negative control.

    Returns a summary (max errors, seconds, and for each control how the check caught it: see
    :func:`run_control`) for the parent test, which must assert that every control was caught the way it
    should be (:func:`assert_controls`). ``runner_kwargs`` go to :class:`ParityRunner`.
    """
    t0 = time.perf_counter()
    runner = ParityRunner(case, group, **runner_kwargs)
    outcome = runner.run()
    check_outcome(outcome)
    summary = {
        "case": case.name,
        "cp": runner.cp_size,
        "runs": case.max_runs(runner.cp_size),
        **outcome.errors(),
        # (reported per call, received in the step): equal when every region's graph ran once in the step
        "heads_bytes": (outcome.reported_bytes["heads"], outcome.comm.heads_bytes),
        "state_bytes": (outcome.reported_bytes["state"], outcome.comm.state_bytes),
        "seconds": time.perf_counter() - t0,
        "controls": {},
    }
    for corrupt in controls:
        summary["controls"][corrupt] = run_control(case, group, corrupt, runner, **runner_kwargs)
    return summary


def check_outcome(outcome: ParityOutcome) -> None:
    """Every assertion of a parity run: the rewrites and SDPA forms the case expects, then parity; prints the
    errors (shown with ``pytest -s``)."""
    case = outcome.case
    assert_rewrites(outcome, outcome.expected_sites)
    if case.expected_form is not None:
        assert set(outcome.forms) == {case.expected_form}, f"{case.name}: SDPA forms {outcome.forms}"
    if case.expected_positions is not None:
        assert outcome.positions == list(case.expected_positions), f"{case.name}: positions {outcome.positions}"
    if case.expected_mixing is not None:
        assert outcome.mixing == list(case.expected_mixing), f"{case.name}: mixing {outcome.mixing}"
    if outcome.cp_size > 1:  # one all-gather or halo exchange per step for every region, as the report says
        for action, count in (("gathered", outcome.comm.sequence_gathers), ("halo", outcome.comm.sequence_halos)):
            assert count == sum(a == action for _, a in outcome.mixing), f"{case.name}: {outcome.comm}"
    assert_parity(outcome)
    e = outcome.errors()
    print(f"\n{outcome.name}: logits {e['logits']:.1e} loss {e['loss']:.1e} grad {e['grad']:.1e} ({e['grad_param']})")


#: How each control must be caught: the parity check failing on these quantities, or this exception.
EXPECTED_CATCH: dict[str, dict] = {
    "label_shift": {"error": "parity", "failing": ["loss", "grads"]},  # the logits are right
    "merge_documents": {"error": "parity", "failing_includes": "logits"},
    "plan_merges_documents": {"error": "MaskMismatchError", "message_includes": "mask check"},
    "wrong_window": {"error": "UnsupportedAttentionError", "message_includes": "sliding window"},
    "positions_off": {"error": "parity", "failing_includes": "logits"},
    "mixing_off": {"error": "parity", "failing_includes": "logits"},
    "short_halo": {"error": "parity", "failing_includes": "logits"},
}


def assert_controls(summaries: list[dict]) -> None:
    """Every control of every summary was caught, with the error it measures (:data:`EXPECTED_CATCH`)."""
    for s in summaries:
        for name, got in s["controls"].items():
            want = EXPECTED_CATCH[name]
            where = f"negative control {name} of {s['case']} CP={s['cp']}"
            assert got["caught"], f"{where} passed the parity check: {got}"
            assert got["error"] == want["error"], f"{where} was caught by {got['error']}, expected {want}: {got}"
            if "failing" in want:
                assert got["failing"] == want["failing"], f"{where} failed on {got['failing']}: {got}"
            if "failing_includes" in want:
                assert want["failing_includes"] in got["failing"], f"{where} failed on {got['failing']}: {got}"
            if "message_includes" in want:
                assert want["message_includes"] in got["message"], f"{where}: {got['message']}"


def report(summaries: list[dict]) -> None:
    """Print the errors of every case and control (shown with ``pytest -s``)."""
    for s in summaries:
        print(
            f"\n{s['case']} CP={s['cp']}: logits {s['logits']:.1e} loss {s['loss']:.1e} grad {s['grad']:.1e} "
            f"({s['grad_param']}, max |g| {s['grad_max_abs']:.1e}) in {s['seconds']:.1f}s"
        )
        for name, c in s["controls"].items():
            errors = (
                f"logits {c['logits']:.1e} loss {c['loss']:.1e} grad {c['grad']:.1e} failing {c['failing']}"
                if c["error"] == "parity"
                else c["message"]
            )
            print(f"  control {name}: caught={c['caught']} by {c['error']}: {errors}")


def _layer_count(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    if config is not None:
        types = getattr(config, "layer_types", None)  # hybrids (LFM2): only the attention layers call SDPA
        return sum("attention" in t for t in types) if types else config.num_hidden_layers
    return len(model.layers)
