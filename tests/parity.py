"""Reusable parity check: a model compiled with cpcompile on a CP group vs the same model eager in one process.

Inside a rank of :func:`tests._dist.run_distributed`::

    runner = ParityRunner(ParityCase(model="qwen3", doc_lens=((10, 20, 7), (5, 30, 2))), group)
    outcome = runner.run()          # one CP training step on this rank's chunk, gathered and summed
    assert_parity(outcome)          # assert_close of logits, loss and every gradient (named tolerances)
    errors = outcome.errors()       # max abs differences, for reports

The reference is the unsharded model run eagerly in this process on the whole global batch (every rank runs it;
all ranks build the same weights and batch from the case's seeds). The CP side compiles an identical copy with
``cpcompile.backend(group, inner=...)``, runs it on ``cpcompile.shard``'s local batch, gathers the logits,
sums the per-rank losses and every parameter's gradient over the group.

Models: any family of :data:`cpcompile.testing.FAMILIES` (HF models built from tiny configs), or
``"attn:<form>"`` for :class:`tests._models.TinyAttentionLM` (see its attention forms).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import time
from collections.abc import Callable
from typing import Literal
from unittest import mock

import torch
import torch.distributed as dist

import cpcompile
from cpcompile import ops
from cpcompile.plan import CPPlan
from cpcompile.testing import FAMILIES, packed_batch, tiny_model
from tests import _models

# fp32 tolerances. The CP side computes the same attention over the same keys; only the order of float
# reductions changes (softmax/matmul blocking over a shorter query chunk, the loss and every gradient summed over
# ranks instead of over one row). Measured differences are <= 5e-7 (table in tests/test_parity.py); 1e-5 leaves
# room for other kernels and inner compilers, and is far below what one wrong mask entry, a wrong label at a chunk
# boundary or a missing rank's gradient causes (>= 1e-3, measured by the negative controls).
LOGITS_TOL = dict(atol=1e-5, rtol=1e-5)
#: The loss is one scalar of size ~5: the same absolute budget as the logits.
LOSS_TOL = dict(atol=1e-5, rtol=1e-6)
#: Gradients are small (|g| ~1e-3..1e-1): an absolute 1e-6 keeps the relative check meaningful.
GRAD_TOL = dict(atol=1e-6, rtol=1e-5)

Corruption = Literal["label_shift", "merge_documents", "positions_off"]


@dataclasses.dataclass(frozen=True)
class ParityCase:
    """One parity configuration (picklable: sent to spawned ranks)."""

    #: A family of ``cpcompile.testing.FAMILIES``, ``"attn:<form>"`` (a ``tests._models.TinyAttentionLM``) or
    #: ``"package.module:factory"`` (called as ``factory(seed=seed, **overrides)``; must return a model in train
    #: mode taking a transformers causal LM's keyword arguments and returning ``.loss``/``.logits``).
    model: str
    #: Packed documents per row (every row the same total length); B = len(doc_lens).
    doc_lens: tuple[tuple[int, ...], ...]
    #: Inner compiler of cpcompile.backend.
    inner: str = "aot_eager"
    #: Weight seed and batch seed.
    seed: int = 0
    batch_seed: int = 1
    #: Config overrides for HF models / constructor kwargs for TinyAttentionLM.
    overrides: tuple[tuple[str, object], ...] = ()
    #: SDPA sites that must be rewritten (one per attention layer); default: the model's layer count.
    expected_sites: int | None = None
    #: How every site must call SDPA, as reported by the pass: (mask form, enable_gqa); None: not checked.
    expected_form: tuple[str, bool] | None = None
    #: Extra keyword arguments of ``cpcompile.backend`` (options added by later features).
    backend_kwargs: tuple[tuple[str, object], ...] = ()
    #: The layout ``cpcompile.shard`` distributes the tokens with.
    layout: str = "contiguous"
    #: ``(kind, action)`` of every position source the backend must report, in order; None: not checked.
    expected_positions: tuple[tuple[str, str], ...] | None = None

    @property
    def name(self) -> str:
        T = sum(self.doc_lens[0])
        extra = "".join(f"/{k}={v}" for k, v in self.overrides)
        return f"{self.model}{extra}/B{len(self.doc_lens)}/T{T}/{self.inner}/{self.layout}"

    def build_model(self) -> torch.nn.Module:
        kwargs = dict(self.overrides)
        if self.model.startswith("attn:"):
            return _models.attention_lm(self.model.removeprefix("attn:"), seed=self.seed, **kwargs)
        if ":" in self.model:
            module, _, factory = self.model.partition(":")
            return getattr(importlib.import_module(module), factory)(seed=self.seed, **kwargs)
        if self.model not in FAMILIES:
            raise ValueError(
                f"unknown model {self.model!r}; use one of {sorted(FAMILIES)}, 'attn:<form>' or 'module:factory'"
            )
        return tiny_model(self.model, seed=self.seed, **kwargs)

    def batch(self) -> dict[str, torch.Tensor]:
        return packed_batch([list(r) for r in self.doc_lens], seed=self.batch_seed)

    def check_layout(self, cp_size: int) -> None:
        """Refuse a case that would not exercise CP: B >= 2 and some document crossing a chunk boundary."""
        T = sum(self.doc_lens[0])
        c = -(-T // cp_size)
        if len(self.doc_lens) < 2:
            raise ValueError(f"case {self.name}: use B >= 2 rows, got {len(self.doc_lens)}")
        crossing = False
        for row in self.doc_lens:
            start = 0
            for n in row:
                crossing |= start // c != (start + n - 1) // c
                start += n
        if cp_size > 1 and not crossing:
            raise ValueError(f"case {self.name}: no document crosses a chunk boundary (chunk {c}) at CP={cp_size}")


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
    comm: cpcompile.CommStats
    seconds: float

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
    name = f"{outcome.case.name} CP={outcome.cp_size}"
    torch.testing.assert_close(outcome.cp_logits, outcome.ref_logits, **LOGITS_TOL, msg=lambda m: f"{name} logits: {m}")
    torch.testing.assert_close(outcome.cp_loss, outcome.ref_loss, **LOSS_TOL, msg=lambda m: f"{name} loss: {m}")
    assert outcome.cp_grads.keys() == outcome.ref_grads.keys(), f"{name}: CP and reference have different parameters"
    for pname, ref in outcome.ref_grads.items():
        torch.testing.assert_close(
            outcome.cp_grads[pname], ref, **GRAD_TOL, msg=lambda m, p=pname: f"{name} grad of {p}: {m}"
        )


def assert_rewrites(outcome: ParityOutcome, expected_sites: int) -> None:
    """Exactly ``expected_sites`` SDPA sites rewritten, none refused, and K and V exchanged once per site (an
    all-gather each, or a halo exchange each at sliding-window sites), every exchange with its backward."""
    name = f"{outcome.case.name} CP={outcome.cp_size}"
    rewritten = outcome.actions.count("rewritten")
    assert rewritten == expected_sites, f"{name}: {rewritten} SDPA sites rewritten, expected {expected_sites}"
    assert outcome.counter_delta.get("sdpa_rewritten", 0) == expected_sites, f"{name}: {outcome.counter_delta}"
    assert outcome.counter_delta.get("sdpa_refused", 0) == 0, f"{name}: {outcome.counter_delta}"
    if outcome.cp_size > 1:
        # one forward step: K and V exchanged once per site, each with its backward (reduce-scatter or halo return)
        comm = outcome.comm
        assert comm.all_gathers + comm.halo_exchanges == 2 * expected_sites, f"{name}: {comm}"
        assert comm.reduce_scatters == comm.all_gathers, f"{name}: {comm}"
        assert comm.halo_backward_bytes == comm.halo_bytes, f"{name}: {comm}"


def _all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t


def sum_grads_over_cp(model: torch.nn.Module, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Every parameter's gradient summed over the CP group (each rank holds the partial sum of its tokens)."""
    return {n: _all_reduce_sum(p.grad, group) for n, p in model.named_parameters() if p.grad is not None}


class ParityRunner:
    """Builds the reference (eager, whole batch) once and the compiled CP model once; ``run`` does one CP step.

    Extension points for other setups: ``wrap`` turns the CP copy into what gets compiled (e.g. applies
    ``fully_shard``; default: the model itself) and ``full_grads`` returns the whole-sequence gradient of every
    parameter by name on this rank (default: :func:`sum_grads_over_cp`).
    """

    def __init__(
        self,
        case: ParityCase,
        group: dist.ProcessGroup,
        *,
        wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
        full_grads: Callable[[torch.nn.Module, dist.ProcessGroup], dict[str, torch.Tensor]] = sum_grads_over_cp,
    ) -> None:
        self.case, self.group, self.full_grads = case, group, full_grads
        self.cp_size = dist.get_world_size(group)
        case.check_layout(self.cp_size)
        self.batch = case.batch()
        ref = case.build_model()
        out = ref(**self.batch, use_cache=False)
        out.loss.backward()
        self.ref_logits = out.logits.detach()
        self.ref_loss = out.loss.detach()
        self.ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
        self.model = case.build_model()
        if wrap is not None:
            self.model = wrap(self.model)
        self.backend = cpcompile.backend(group, inner=case.inner, **dict(case.backend_kwargs))
        self.compiled = torch.compile(self.model, backend=self.backend)

    def run(self, corrupt: Corruption | None = None) -> ParityOutcome:
        """One CP step. ``corrupt`` deliberately breaks the CP side (negative controls of the parity check):

        * ``label_shift``: the model gets the local labels unshifted as ``shift_labels`` (the chunk-boundary bug);
        * ``merge_documents``: the rewritten attention uses the global causal mask without the document condition
          (and the model's mask is not checked against it).
        """
        start = time.perf_counter()
        self.model.zero_grad(set_to_none=True)
        before = dict(cpcompile.counters)
        with _corruption(corrupt):
            with cpcompile.shard(self.batch, self.group, layout=self.case.layout) as local:
                if corrupt == "label_shift":
                    local["shift_labels"] = local["labels"]
                out = self.compiled(**local)
                out.loss.backward()
                logits = cpcompile.gather(out.logits.detach())
            comm = cpcompile.comm_stats()
        grads = self.full_grads(self.model, self.group)
        return ParityOutcome(
            case=self.case,
            cp_size=self.cp_size,
            ref_logits=self.ref_logits,
            cp_logits=logits,
            ref_loss=self.ref_loss,
            cp_loss=_all_reduce_sum(out.loss, self.group),
            ref_grads=self.ref_grads,
            cp_grads=grads,
            actions=[r.action for r in self.backend.reports],
            forms=[(r.mask_form, r.enable_gqa) for r in self.backend.reports],
            positions=[(r.kind, r.action) for r in self.backend.position_reports],
            counter_delta={k: v - before.get(k, 0) for k, v in cpcompile.counters.items()},
            comm=dataclasses.replace(comm),
            seconds=time.perf_counter() - start,
        )


@contextlib.contextmanager
def _corruption(corrupt: Corruption | None):
    """Patch cpcompile for one negative-control run (nothing for ``None`` and ``label_shift``)."""
    if corrupt != "merge_documents":
        yield
        return
    original = CPPlan.attention_docs

    def merged(plan, documents):  # the document ids every attention path reads
        return original(plan, False)

    with (
        mock.patch.object(CPPlan, "attention_docs", merged),
        mock.patch.object(ops, "_verify_model_mask_once", lambda *a: None),
    ):
        yield


def check_case(
    case: ParityCase, group: dist.ProcessGroup, *, controls: tuple[Corruption, ...] = (), **runner_kwargs
) -> dict:
    """Run ``case`` on this rank, assert parity and rewrites, then run each negative control.

    Returns a summary (max errors, seconds, and for each control whether the parity check caught it and the
    error it caused) for the parent test, which must assert that every control was caught.
    ``runner_kwargs`` go to :class:`ParityRunner`. The ``positions_off`` control compiles the case again with
    ``cpcompile.backend(..., positions="off")`` (positions left as the model computes them).
    """
    t0 = time.perf_counter()
    runner = ParityRunner(case, group, **runner_kwargs)
    outcome = runner.run()
    expected = case.expected_sites if case.expected_sites is not None else _layer_count(runner.model)
    assert_rewrites(outcome, expected)
    if case.expected_form is not None:
        assert set(outcome.forms) == {case.expected_form}, f"{case.name}: SDPA forms {outcome.forms}"
    if case.expected_positions is not None:
        assert outcome.positions == list(case.expected_positions), f"{case.name}: positions {outcome.positions}"
    assert_parity(outcome)
    summary = {
        "case": case.name,
        "cp": runner.cp_size,
        **outcome.errors(),
        "seconds": time.perf_counter() - t0,
        "controls": {},
    }
    for corrupt in controls:
        if corrupt == "positions_off":
            torch._dynamo.reset()  # compile the control afresh, with no cache entry of the rewritten graph
            off = dataclasses.replace(case, backend_kwargs=(*case.backend_kwargs, ("positions", "off")))
            bad = ParityRunner(off, group, **runner_kwargs).run()
            assert bad.positions == [], f"{case.name}: positions='off' still reported {bad.positions}"
        else:
            bad = runner.run(corrupt)
        try:
            assert_parity(bad)
        except AssertionError as e:
            summary["controls"][corrupt] = {"caught": True, **bad.errors(), "message": str(e).splitlines()[0]}
        else:
            summary["controls"][corrupt] = {"caught": False, **bad.errors()}
    return summary


def _layer_count(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    if config is not None:
        return config.num_hidden_layers
    return len(model.layers)
