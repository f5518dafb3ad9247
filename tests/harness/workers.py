"""Module-level worker functions for the multi-process tests (spawned processes import them from here)."""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from cpcompile.layouts import Workload
from tests.harness.parity import ParityCase, ParityRunner, run_control

#: The global packed batch of the family parity tests: documents longer than the test windows, T = 64
#: (chunks of 32 at CP=2, 22 at CP=3 with 2 padding tokens, 16 at CP=4), one document crossing every chunk
#: boundary.
FAMILY_DOCS = ((24, 30, 10), (5, 50, 9))


#: The balanced layout's workload in the parity cases: blocks of 4 tokens, so that T = 64 has something to balance.
BALANCED_WORKLOAD = Workload(block_size=4)


def balanced_case(family: str, **fields) -> ParityCase:
    """The parity case of a transformers family under the balanced layout on :data:`FAMILY_DOCS`: kernel blocks of
    8 and a workload in blocks of 4, so that the layout has something to balance at T = 64 (with the kernel's
    default block every layout computes the same single block) and ranks hold several runs of tokens."""
    defaults = dict(
        doc_lens=FAMILY_DOCS,
        inner="eager",
        backend_kwargs=(("block_size", 8),),
        layout="balanced",
        shard_kwargs=(("workload", BALANCED_WORKLOAD),),
    )
    return ParityCase(model=family, **{**defaults, **fields})


def family_case(family: str, **fields) -> ParityCase:
    """The parity case of a transformers family on :data:`FAMILY_DOCS`, compiled as training should compile it
    (``config=model.config``, ``fullgraph=True``); ``fields`` override :class:`tests.harness.parity.ParityCase`
    fields."""
    defaults = dict(doc_lens=FAMILY_DOCS, batch_seed=1, use_config=True, fullgraph=True)
    return ParityCase(model=family, **{**defaults, **fields})


def parity_worker(
    rank: int,
    world_size: int,
    cases: list[ParityCase],
    controls: dict[str, tuple[str, ...]] | None = None,
    profile: bool = False,
) -> dict:
    """Run each case (one CP step next to the reference) in one spawned group; every rank returns
    ``{case.name: (ParityOutcome, {control: how it was caught})}`` for the parent to assert on (``profile``:
    the outcomes count the step's gloo collectives)."""
    group = dist.new_group(list(range(world_size)))
    results = {}
    for case in cases:
        torch._dynamo.reset()
        runner = ParityRunner(case, group)
        outcome = runner.run(profile=profile)
        caught = {c: run_control(case, group, c, runner) for c in (controls or {}).get(case.name, ())}
        results[case.name] = (outcome, caught)
    return results


def _random_docs(gen: torch.Generator, batch_size: int, lo: int, hi: int) -> list[list[int]]:
    T = int(torch.randint(lo, hi + 1, (1,), generator=gen))
    rows = []
    for _ in range(batch_size):
        cuts = sorted(torch.randperm(T - 1, generator=gen)[: int(torch.randint(0, 3, (1,), generator=gen))] + 1)
        bounds = [0, *[int(c) for c in cuts], T]
        rows.append([b - a for a, b in zip(bounds, bounds[1:])])
    return rows


def compile_behaviour_worker(rank: int, world_size: int, steps: int) -> dict:
    """Recompilations over ``steps`` random packed lengths, a compiled function, and activation checkpointing:
    every step's :class:`tests.harness.parity.ParityOutcome` (rank 0) for the parent to assert on."""
    from cpcompile.testing import packed_batch

    group = dist.new_group(list(range(world_size)))
    out: dict = {}

    # 1. variable lengths: count backend invocations (one per compiled graph); every step next to the reference
    torch._dynamo.reset()
    compiles = []

    def counting(model, be):
        def backend(gm, example_inputs):
            # one entry per compilation: whether the graph got a symbolic (dynamic) size among its inputs
            compiles.append(any(isinstance(x, torch.SymInt) for x in example_inputs))
            return be(gm, example_inputs)

        return torch.compile(model, backend=backend)

    runner = ParityRunner(family_case("llama"), group, compile=counting)
    gen = torch.Generator().manual_seed(123)  # same on every rank: every rank builds the same batches
    lengths, outcomes = [], []
    for step in range(steps):
        docs = _random_docs(gen, 2, 17, 70)
        lengths.append(sum(docs[0]))
        outcomes.append(runner.run(batch=packed_batch(docs, seed=step)))
    out["compiles"], out["lengths"], out["steps"] = len(compiles), lengths, outcomes
    out["first_dynamic"] = compiles[0]

    # 2. torch.compile of a function that calls the (uncompiled) model, fullgraph
    torch._dynamo.reset()

    def compiled_function(model, be):
        @torch.compile(backend=be, fullgraph=True)
        def step_fn(m, local):
            return m(**local)

        return lambda **local: step_fn(model, local)

    out["function"] = ParityRunner(family_case("qwen3", batch_seed=3), group, compile=compiled_function).run()

    # 3. activation checkpointing of the decoder layers
    torch._dynamo.reset()
    case = family_case("llama", checkpointing=True, fullgraph=False)
    out["checkpointing"] = ParityRunner(case, group).run(profile=True)
    return out if rank == 0 else {}


def _error_of(fn) -> tuple[str, str]:
    """``(exception type name, message)`` of ``fn()``, or ``("none", "")`` when it returns."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the parent asserts on the type and message
        return type(e).__name__, str(e)
    return "none", ""


def bad_input_worker(rank: int, world_size: int) -> dict:
    """Every misuse of shard/backend/gather on a CP group; returns ``{case: (type, message)}`` per rank."""
    import cpcompile
    from cpcompile.testing import packed_batch, tiny_model

    group = dist.new_group(list(range(world_size)))
    only_rank0 = dist.new_group([0])  # every rank must call new_group; rank 1 gets the non-member placeholder
    batch = packed_batch([[10, 6], [16]], seed=0)

    def shard_with(b, g=group, **kw):
        def run():
            with cpcompile.shard(b, g, **kw):
                pass

        return run

    def edit(**changes):
        b = dict(batch)
        b.update(changes)
        return b

    out = {}
    ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    out["different_lengths"] = _error_of(shard_with(edit(position_ids=pos[:, :-2])))
    out["missing_input_ids"] = _error_of(shard_with({"position_ids": pos, "labels": labels}))
    out["negative_positions"] = _error_of(shard_with(edit(position_ids=pos - 3)))
    out["float_positions"] = _error_of(shard_with(edit(position_ids=pos.float())))
    out["labels_shape"] = _error_of(shard_with(edit(labels=labels[:, :, None])))
    out["labels_length"] = _error_of(shard_with(edit(labels=labels[:, 1:])))
    out["group_not_pg"] = _error_of(shard_with(batch, g="cp"))
    out["backend_group_not_pg"] = _error_of(lambda: cpcompile.backend([0, 1]))
    out["group_without_rank"] = _error_of(shard_with(batch, g=only_rank0)) if rank != 0 else ("skip", "")
    out["backend_group_without_rank"] = _error_of(lambda: cpcompile.backend(only_rank0)) if rank != 0 else ("skip", "")
    out["too_short"] = _error_of(shard_with({"input_ids": ids[:, :1]}))

    # a global batch that differs between ranks: caught by the opt-in check, on every rank, before the model
    other = dict(batch)
    other["input_ids"] = ids.clone()
    if rank == 1:
        other["input_ids"][0, 5] += 1
    out["check_batch_differs"] = _error_of(shard_with(other, check_batch=True))
    out["check_batch_same"] = _error_of(shard_with(batch, check_batch=True))
    other_labels = dict(batch)
    if rank == 1:
        other_labels["labels"] = labels.roll(1, dims=1)
    out["check_batch_labels"] = _error_of(shard_with(other_labels, check_batch=True))

    # flex BlockMasks passed in the batch (built for the whole sequence, as torchtitan's trainer does)
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    docs = (pos == 0).cumsum(-1)

    def same_document(b, h, q_idx, kv_idx):
        return docs[b, q_idx] == docs[b, kv_idx]

    B, T = ids.shape
    out["block_mask_length"] = _error_of(shard_with(edit(masks=create_block_mask(causal, B, None, T - 2, T - 2))))
    out["block_mask_rows"] = _error_of(shard_with(edit(masks={"full": create_block_mask(causal, 3, None, T, T)})))
    tables = create_block_mask(causal, B, None, T, T, BLOCK_SIZE=4)
    kv_blocks = BlockMask.from_kv_blocks(tables.kv_num_blocks, tables.kv_indices, BLOCK_SIZE=4, seq_lengths=(T, T))
    out["block_mask_without_mask_mod"] = _error_of(shard_with(edit(masks=kv_blocks)))
    if rank == 1:  # another rank's documents in the mask only: its mask_mod reads other document ids
        docs = docs.roll(1, dims=1)
    out["check_batch_block_mask"] = _error_of(shard_with(edit(masks=create_block_mask(same_document, B, None, T, T))))

    def nested():
        with cpcompile.shard(batch, group):
            with cpcompile.shard(batch, group):
                pass

    out["nested"] = _error_of(nested)
    out["gather_outside"] = _error_of(lambda: cpcompile.gather(torch.zeros(2, 8)))

    # the compiled model called outside shard: fails in the first attention's mask op, before any collective
    torch._dynamo.reset()
    model = tiny_model("llama")
    cm = torch.compile(model, backend=cpcompile.backend(group, inner="eager"))
    out["model_outside_shard"] = _error_of(lambda: cm(**batch, use_cache=False))

    # eager attention under CP: refused at compile time, naming the layer and the fix
    torch._dynamo.reset()
    eager = tiny_model("llama", attn_implementation="eager")
    ce = torch.compile(eager, backend=cpcompile.backend(group, inner="eager"))

    def eager_run():
        with cpcompile.shard(batch, group) as local:
            ce(**local)

    out["eager_attention"] = _error_of(eager_run)

    # the runtime guard of the window: a site whose window differs from the model's mask (window 3 < chunk 8)
    from cpcompile import ops

    q = torch.zeros(2, 4, 8, 16)
    with cpcompile.shard(batch, group):
        plan = cpcompile.runtime.current_plan()
        model_mask = plan.mask(documents=True, window=3)[..., plan.token_indices()]

        def site(name, window):
            spec = ops.SiteSpec(
                site=f"test-site-{name}-{rank}",
                layer="test.layer",
                group_name=plan.group_name,
                cp_size=world_size,
                cp_rank=rank,
                documents=True,
                window=window,
                kernel="dense",
                needs_grad=False,
            )
            return lambda: torch.ops.cpcompile.site_check(q, model_mask, ops.register_site(spec))

        out["window_right"] = _error_of(site("right", 3))
        out["window_wrong"] = _error_of(site("wrong", 4))
        out["window_missing"] = _error_of(site("none", None))
    # every rank is still in step: one more collective succeeds
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    out["in_step"] = float(t)
    return out


def failing_worker(rank: int, world_size: int) -> None:
    """Rank 1 raises while rank 0 waits in a collective that rank 1 never joins."""
    if rank == 1:
        raise ValueError("rank 1 failed on purpose")
    t = torch.ones(1)
    dist.all_reduce(t)


def sleeping_worker(rank: int, world_size: int) -> None:
    import time

    time.sleep(3600)


# -- fail together: one rank fails, every rank raises -----------------------------------------------------
#: Packed documents of the fail-together tests: T = 16, chunks of 8 at CP=2. Rank 0's chunk lies inside the
#: first document of each row; rank 1's chunk holds a document boundary (token 10 of row 0, 12 of row 1).
FAIL_DOCS = [[10, 6], [12, 4]]
#: Short waits for the fail-together tests: a rank blocked by a live failed peer raises after PEER_TIMEOUT_S.
FAIL_PEER_TIMEOUT_S = 4.0
FAIL_GRACE_S = 1.0
#: Peer timeout while a peer's first call compiles before it reaches its failure (compiling takes seconds on 2
#: loaded cores): the case is about the reason reaching the peer, not about the bound.
FIRST_CALL_PEER_TIMEOUT_S = 30.0


def _fail_setup(world_size: int, inner: str = "eager"):
    """A fresh CP group and a compiled tiny LM whose bool mask is causal + same document, from position_ids."""
    group = dist.new_group(list(range(world_size)))
    return group, _fail_model(group, inner)


def _fail_model(group, inner: str = "eager"):
    """The fail-together model, compiled afresh. ``inner="eager"`` (the rewritten graph as traced: the failure
    paths under test are cpcompile's control rounds) unless a scenario is about a compiled joint graph."""
    import cpcompile
    from tests.models import attention as _models

    torch._dynamo.reset()
    return torch.compile(_models.attention_lm("packed_docs"), backend=cpcompile.backend(group, inner=inner))


def _short_waits(group, peer_timeout_s: float = FAIL_PEER_TIMEOUT_S) -> None:
    import cpcompile

    options = cpcompile.failsafe.FailsafeOptions(peer_timeout_s=peer_timeout_s, report_grace_s=FAIL_GRACE_S)
    cpcompile.failsafe.configure(group, options)


def _step(cm, batch, group, **kw) -> float:
    import cpcompile

    with cpcompile.shard(batch, group, **kw) as local:
        loss = cm(**local).loss
        loss.backward()
    return float(loss.detach())


def _outcome(fn) -> dict:
    """What ``fn()`` raised: type name, message, isinstance flags and seconds until it raised."""
    import cpcompile

    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the parent asserts on the type and message
        return {
            "type": type(e).__name__,
            "message": str(e) + "".join(f"\n{n}" for n in getattr(e, "__notes__", ())),
            "rank_failed": isinstance(e, cpcompile.RankFailedError),
            "value_error": isinstance(e, ValueError),
            "mask_mismatch": isinstance(e, cpcompile.MaskMismatchError),
            "failed": getattr(e, "failed", None),
            "dead": getattr(e, "dead", None),
            "seconds": time.monotonic() - start,
            "raised_at": time.time(),
        }
    return {"type": "none", "message": "", "seconds": time.monotonic() - start}


def fail_together_worker(rank: int, world_size: int) -> dict:
    """Asymmetric failures on live ranks, each on a fresh CP group; returns ``{scenario: outcome}`` per rank."""
    import cpcompile
    from cpcompile.testing import packed_batch

    batch = packed_batch(FAIL_DOCS, seed=0)
    bad = dict(batch, position_ids=batch["position_ids"] - 3) if rank == 1 else batch  # negative on rank 1 only
    out: dict = {}

    # 1. the model builds its packed-document mask from position_ids that shard was not given: rank 0's diagonal
    #    block matches cpcompile's causal mask, rank 1's does not (its chunk holds a document boundary)
    group, cm = _fail_setup(world_size)

    def unshared_positions():
        with cpcompile.shard({"input_ids": batch["input_ids"], "labels": batch["labels"]}, group) as local:
            plan = cpcompile.runtime.current_plan()
            cm(**{**local, "position_ids": plan.local(batch["position_ids"])})

    out["mask_mismatch"] = _outcome(unshared_positions)
    out["mask_mismatch_comm"] = dataclasses.asdict(cpcompile.comm_stats())

    # 2. one rank's batch fails validation, with the batch check (the default): decided in the check's round
    group = dist.new_group(list(range(world_size)))

    def enter(b, **kw):
        with cpcompile.shard(b, group, **kw):
            pass

    out["bad_batch_checked"] = _outcome(lambda: enter(bad, check_batch=True))
    out["checked_group_usable"] = _step(_fail_model(group), batch, group, check_batch=True)

    # 3. with the batch check opted out (check_batch=False), on the first call: the peer learns it in the
    #    first-call mask check's round (the contiguous layout: no workload round either)
    unchecked = dict(check_batch=False, layout="contiguous")
    group, cm = _fail_setup(world_size)
    out["bad_batch_first_call"] = _outcome(lambda: _step(cm, bad, group, **unchecked))
    out["bad_batch_first_call_next"] = _outcome(lambda: _step(cm, batch, group, **unchecked))

    # 4. with the check opted out, on a later step: the peer goes on into the model and learns it in the
    #    attention's control round of the step
    group, cm = _fail_setup(world_size)
    _step(cm, batch, group, **unchecked)
    _short_waits(group)
    out["bad_batch_later"] = _outcome(lambda: _step(cm, bad, group, **unchecked))
    out["bad_batch_later_next"] = _outcome(lambda: _step(cm, batch, group, **unchecked))

    # 5. one rank calls the compiled model outside shard while its peer is inside (first call, later step)
    for name, warm in (("outside_first_call", False), ("outside_later", True)):
        group, cm = _fail_setup(world_size)
        with cpcompile.shard(batch, group) as local:
            saved = dict(local)
        if warm:
            _step(cm, batch, group)
        _short_waits(group, FAIL_PEER_TIMEOUT_S if warm else FIRST_CALL_PEER_TIMEOUT_S)
        out[name] = _outcome(lambda: _step(cm, batch, group) if rank == 0 else cm(**saved))
        out[name + "_next"] = _outcome(lambda: _step(cm, batch, group))

    # 6. rank 1 fails in its own code, outside cpcompile, while rank 0 runs a step: without fail_together its
    #    peer learns nothing but that it did not come (after the group's timeout); with it, the reason too
    for name, report in (("own_code_unreported", False), ("own_code_fail_together", True)):
        group, cm = _fail_setup(world_size)
        _step(cm, batch, group)
        _short_waits(group)

        def data_loader_fails():
            raise RuntimeError("the data loader of rank 1 failed")

        def own_code():
            if rank == 0:
                _step(cm, batch, group)
            elif report:
                with cpcompile.fail_together(group):
                    data_loader_fails()
            else:
                data_loader_fails()

        out[name] = _outcome(own_code)
        if rank == 1:  # stay alive (a notebook) until rank 0 has raised, so that it cannot see this process exit
            time.sleep(FAIL_PEER_TIMEOUT_S + FAIL_GRACE_S + 2)
        out[name + "_next"] = _outcome(lambda: _step(cm, batch, group))
    return out


def killed_rank_worker(rank: int, world_size: int, where: str) -> dict | None:
    """Rank 1 kills its own process (``SIGKILL``) ``where``: "between_forward_and_backward" of a later step, or
    "before_first_call" (its peer then waits in the first-call mask check's control round)."""
    import os
    import signal

    import cpcompile
    from cpcompile.testing import packed_batch

    batch = packed_batch(FAIL_DOCS, seed=0)
    group, cm = _fail_setup(world_size, inner="aot_eager")  # a peer dies while this rank runs a compiled backward
    if where == "between_forward_and_backward":
        _step(cm, batch, group)

    def step():
        with cpcompile.shard(batch, group) as local:
            if rank == 1 and where == "before_first_call":
                os.kill(os.getpid(), signal.SIGKILL)
            loss = cm(**local).loss
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()

    return {"killed": _outcome(step), "next": _outcome(step)}
