"""The head-parallel exchanges (``cpcompile::heads_from_sequence``, ``cpcompile::sequence_from_heads``): a tensor
moves between the sequence split and the head split exactly.

- The permutation the exchanges use (``CPPlan.gathered_order``) puts the rank-major chunks of every rank's tokens
  (each rank's ``token_indices()``, from its own plan) into token order with the padding last, and its inverse
  takes them back: every layout, CP 2-8, lengths that are not a multiple of N, packed documents (hypothesis).
- On gloo ranks (CP=2; CP=3 and 4 in the slow tier), every layout, T a multiple of N and not: rank r's
  ``heads_from_sequence`` of the tokens ``cpcompile.shard`` gave it equals heads ``[r*H/N, (r+1)*H/N)`` of the
  global tensor, padded with the padding the plan appends (built in the test from the global tensor); the round
  trip gives the local tokens back; the backward of ``sum(w * heads_from_sequence(x))`` equals the one-process
  gradient at this rank's tokens; the bytes in ``comm_stats()`` equal the shapes' count. Negative control: the
  same exchange left in rank-major order differs from the global slice under the balanced and head_tail layouts
  (and equals it under contiguous, where the two orders coincide). The ops compiled with AOTAutograd at two
  lengths: one graph, the eager values and gradients. H % N != 0 is a ``ValueError`` naming the numbers and the fix.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpcompile.plan import LAYOUTS, Workload, build_plan
from tests.harness.dist import run_distributed
from tests.harness.tiers import slow
from tests.harness.tolerances import EXACT

SETTINGS = settings(max_examples=50, deadline=None)

B, H, D = 2, 12, 2  # 12 heads: split by 2, 3 and 4 ranks
SITE = "test_heads_exchange"
#: Small kernel blocks: at these lengths the balanced layout then gives each rank several runs of tokens.
WORKLOAD = Workload(block_size=2)


# -- the permutation, in one process -------------------------------------------------------------------------
@st.composite
def batches(draw):
    n = draw(st.integers(2, 8))
    T = draw(st.integers(n, 12 * n))  # every rank holds at least one token
    rows = []
    for _ in range(draw(st.integers(1, 2))):
        cuts = sorted(set(draw(st.lists(st.integers(1, max(T - 1, 1)), max_size=3)))) if T > 1 else []
        bounds = [0, *[c for c in cuts if c < T], T]
        rows.append([b - a for a, b in zip(bounds, bounds[1:])])
    pos = torch.tensor([[p for length in row for p in range(length)] for row in rows])
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    block = draw(st.integers(1, 4))
    return {"input_ids": torch.zeros_like(pos), "position_ids": pos}, n, layout, Workload(block_size=block)


@SETTINGS
@given(batches())
def test_gathered_order_maps_rank_major_chunks_to_token_order(case):
    batch, n, layout, workload = case
    T = batch["input_ids"].shape[1]
    plans = [build_plan(batch, n, r, layout=layout, workload=workload) for r in range(n)]
    c = plans[0].chunk_len
    assert n * c >= T > n * (c - 1)  # the padding is fewer than N tokens
    # what an all-to-all of equal chunks leaves on every rank: rank 0's tokens, then rank 1's, ...
    rank_major = torch.cat([p.token_indices() for p in plans])
    for p in plans:
        order = p.gathered_order()
        assert torch.equal(rank_major[order], torch.arange(n * c)), (layout, p.cp_rank)  # token order, padding last
        assert torch.equal(torch.argsort(order), rank_major)  # the way back (sequence_from_heads)


# -- the exchanges, on gloo ranks ----------------------------------------------------------------------------
def _cases(n: int) -> list[tuple[str, int]]:
    return [(layout, T) for layout in sorted(LAYOUTS) for T in (8 * n, 8 * n + 1)]


def _global(T: int, seed: int) -> torch.Tensor:
    return torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(seed))


def _exchange_worker(rank, world_size, cases):
    import torch.distributed as dist
    import torch.fx as fx

    import cpcompile
    from cpcompile.ops import (
        emit_heads_from_sequence,
        emit_sequence_from_heads,
        heads_from_sequence,
        heads_order,
        sequence_from_heads,
    )
    from cpcompile.runtime import current_plan

    n, h = world_size, H // world_size
    heads = slice(rank * h, (rank + 1) * h)
    out = {}
    for layout, T in cases:
        x = _global(T, seed=T)
        batch = {"input_ids": torch.zeros(B, T, dtype=torch.long), "x": x}
        with cpcompile.shard(batch, dist.group.WORLD, layout=layout, workload=WORKLOAD, hf_kwargs=False) as local:
            plan = current_plan()
            name, c, T_pad = plan.group_name, plan.chunk_len, plan.padded_len
            # the one-process tensor: x, then the padding shard appends to a float key (0.0)
            x_pad = torch.cat([x, torch.zeros(B, T_pad - T, H, D)], dim=1)
            weight = _global(T_pad, seed=1000 + T)  # one weight per (token, head, value), padding rows too
            whole = x_pad.clone().requires_grad_()
            (weight * whole).sum().backward()  # the one-process gradient

            x_local = local["x"].clone().requires_grad_()
            order = heads_order(x_local.detach(), 1, n, SITE)
            y = heads_from_sequence(x_local, order, 1, 2, name, SITE, True)
            (weight[:, :, heads] * y).sum().backward()
            back = sequence_from_heads(y.detach(), order, 1, 2, name, SITE, False)
            comm = cpcompile.comm_stats()
            counted = (
                comm.heads_exchanges,
                comm.heads_bytes,
                comm.heads_backward_bytes,
                dict(comm.heads_bytes_by_site),
            )
            # negative control: the all-to-all's chunks left rank-major (identity order), not in token order
            rank_major = heads_from_sequence(x_local.detach(), torch.arange(n * c), 1, 2, name, SITE, False)

            graph = fx.Graph()
            node = graph.placeholder("x")
            emitted, emitted_order = emit_heads_from_sequence(graph, node, 1, 2, n, name, SITE)
            graph.output((emitted, emit_sequence_from_heads(graph, emitted, emitted_order, 1, 2, name, SITE)))
            emitted_y, emitted_back = fx.GraphModule(torch.nn.Module(), graph)(local["x"])
        per_exchange = (n - 1) * B * c * h * D * 4  # fp32 bytes received from the other ranks, one direction
        out[(layout, T)] = {
            "y": y.detach(),
            "expected": x_pad[:, :, heads],
            "back": back,
            "x_local": local["x"],
            "grad": x_local.grad,
            "grad_expected": whole.grad[:, plan.token_indices()],
            "rank_major": rank_major,
            # the forward and the way back; the gradient's all-to-all counted with the forward, not again
            "bytes": (counted, (2, 2 * per_exchange, per_exchange, {SITE: 2 * per_exchange})),
            "emitted": (emitted_y, emitted_back),
        }
    return out


# Generous limits: they only cut a hang (the machine may be shared).
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def cp2():
    return run_distributed(_exchange_worker, 2, _cases(2), timeout_s=TIMEOUT_S)


def _each(results):
    for rank, res in enumerate(results):
        for (layout, T), r in res.items():
            yield f"rank {rank}, {layout}, T={T}", layout, r


def _check_heads(results):
    for where, _, r in _each(results):
        torch.testing.assert_close(r["y"], r["expected"], **EXACT, msg=lambda m, w=where: f"{w}: {m}")
        torch.testing.assert_close(r["emitted"][0], r["expected"], **EXACT, msg=lambda m, w=where: f"{w}: {m}")


def _check_round_trip(results):
    for where, _, r in _each(results):
        torch.testing.assert_close(r["back"], r["x_local"], **EXACT, msg=lambda m, w=where: f"{w}: {m}")
        torch.testing.assert_close(r["emitted"][1], r["x_local"], **EXACT, msg=lambda m, w=where: f"{w}: {m}")


def _check_grads(results):
    for where, _, r in _each(results):
        torch.testing.assert_close(r["grad"], r["grad_expected"], **EXACT, msg=lambda m, w=where: f"{w}: {m}")


def _check_bytes(results):
    for where, _, r in _each(results):
        got, expected = r["bytes"]
        assert got == expected, f"{where}: (exchanges, bytes, backward bytes, bytes by site) {got}, expected {expected}"


def _check_rank_major_control(results):
    for where, layout, r in _each(results):
        same = torch.equal(r["rank_major"], r["expected"])
        # contiguous: rank-major chunks are the token order; the other layouts interleave the ranks' runs
        assert same == (layout == "contiguous"), f"{where}: rank-major order equals the global slice: {same}"


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_heads_from_sequence_is_the_global_head_slice(cp2):
    _check_heads(cp2)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_round_trip_is_the_identity(cp2):
    _check_round_trip(cp2)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_backward_is_the_one_process_gradient(cp2):
    _check_grads(cp2)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_bytes_in_comm_stats(cp2):
    _check_bytes(cp2)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_rank_major_order_is_not_the_global_slice(cp2):
    _check_rank_major_control(cp2)


@slow
@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("cp", [3, 4])
def test_exchanges_cp3_cp4(cp):
    results = run_distributed(_exchange_worker, cp, _cases(cp), timeout_s=TIMEOUT_S)
    for check in (_check_heads, _check_round_trip, _check_grads, _check_bytes, _check_rank_major_control):
        check(results)


def _compiled_worker(rank, world_size):
    import torch.distributed as dist

    import cpcompile
    from cpcompile import _compat

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return _compat.lookup_inner_backend("aot_eager")(gm, example_inputs)

    def exchange(x, name):
        order = torch.ops.cpcompile.heads_order(x.detach(), 1, world_size, SITE)
        return torch.ops.cpcompile.heads_from_sequence(x, order, 1, 2, name, SITE, True)

    compiled = torch.compile(exchange, backend=counting, fullgraph=True)
    h = H // world_size
    out = []
    for T in (16, 19):
        batch = {"input_ids": torch.zeros(B, T, dtype=torch.long), "x": _global(T, seed=T)}
        with cpcompile.shard(batch, dist.group.WORLD, layout="balanced", workload=WORKLOAD, hf_kwargs=False) as local:
            name = cpcompile.runtime.current_plan().group_name
            weight = _global(cpcompile.runtime.current_plan().padded_len, seed=T)[:, :, rank * h : (rank + 1) * h]
            runs = []
            # the compiled call takes shard's tensor itself: its sequence dim is marked dynamic (a copy's is not)
            for x, fn in (
                (local["x"].requires_grad_(), compiled),
                (local["x"].detach().clone().requires_grad_(), exchange),
            ):
                y = fn(x, name)
                (weight * y).sum().backward()
                runs.append((y.detach(), x.grad))
            out.append(runs)
    return {"graphs": len(graphs), "runs": out}


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_compiled_with_a_dynamic_length():
    """Dynamo and AOTAutograd trace the ops with a symbolic local length (the fake implementations): one graph for
    two lengths (one not a multiple of N), the eager values and gradients."""
    results = run_distributed(_compiled_worker, 2, timeout_s=TIMEOUT_S)
    for rank, res in enumerate(results):
        assert res["graphs"] == 1, f"rank {rank}: {res['graphs']} graphs for two lengths"
        for (y, grad), (y_eager, grad_eager) in res["runs"]:
            torch.testing.assert_close(y, y_eager, **EXACT)
            torch.testing.assert_close(grad, grad_eager, **EXACT)


def _uneven_worker(rank, world_size):
    import torch.distributed as dist

    import cpcompile
    from cpcompile.ops import heads_from_sequence, heads_order

    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "x": torch.zeros(1, 8, 3, D)}
    with cpcompile.shard(batch, dist.group.WORLD, hf_kwargs=False) as local:
        name = cpcompile.runtime.current_plan().group_name
        order = heads_order(local["x"], 1, world_size, SITE)
        with pytest.raises(ValueError) as err:
            heads_from_sequence(local["x"], order, 1, 2, name, SITE, False)
    return str(err.value)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_heads_not_a_multiple_of_the_cp_size_raise():
    for message in run_distributed(_uneven_worker, 2, timeout_s=TIMEOUT_S):
        assert f"the head-parallel exchange at {SITE} got 3 heads" in message, message
        assert "multiple of 2" in message and "use a CP size that divides 3" in message, message
