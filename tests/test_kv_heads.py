"""K/V heads exchanged before the model expands them to the query heads, in every common spelling.

Graph level (one process): for each spelling of tests.models.kv_heads the rewritten graph exchanges ``[B, Hkv, c, D]``
tensors (KV heads, not query heads), attends with ``enable_gqa=True`` and keeps no expansion; tiling
(``repeat``), which is not grouped-query order, is left as it is (the expanded tensors are gathered).
Parity (CP=2, the rewritten graph run as traced, against the unsharded eager model, tests.harness.parity): every
spelling with full attention, and two with a sliding window (a halo exchange); the bytes each rank all-gathered are
(N-1) chunks of the KV heads.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cpcompile
from cpcompile import _compat
from cpcompile.testing import packed_batch
from tests.harness.dist import run_distributed
from tests.harness.graphs import dynamo_graph, run_pass
from tests.harness.parity import ParityCase, check_case
from tests.models.kv_heads import SPELLINGS, kv_heads_lm

DOCS = ((10, 20, 7), (5, 30, 2))  # T = 37


def _captured(spelling: str, **kwargs) -> torch.fx.GraphModule:
    return dynamo_graph(kv_heads_lm(spelling, **kwargs), **packed_batch([list(r) for r in DOCS]))


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_kv_heads_are_gathered_before_the_expansion(spelling):
    gm = _captured(spelling)  # 4 query heads, 2 KV heads, head dim 8
    reports = run_pass(gm, cp_size=4)
    grouped = spelling != "tile"
    heads = 2 if grouped else 4
    assert [r.kv_heads for r in reports] == [heads, heads]
    assert all(shape[1] == heads for r in reports for shape in r.gathered_shapes), reports
    gathered = [n.args[0] for n in gm.graph.nodes if n.target is _compat.all_gather_start]
    assert len(gathered) == 4
    for node in gathered:
        shape = node.meta["example_value"].shape if "example_value" in node.meta else None
        if shape is not None:  # a source the model made (a transpose the pass inserts has no recorded value)
            assert shape[1] == heads, (node.name, shape)
    left = [n for n in gm.graph.nodes if n.op == "call_method" and n.target in ("expand", "repeat_interleave")]
    assert (not left) if grouped else True, [n.name for n in left]
    if grouped:
        # the expansion is gone: the attention gets the KV heads and enable_gqa
        ops = [n for n in gm.graph.nodes if n.target in _compat.SDPA_TARGETS]
        assert ops and all(n.kwargs["enable_gqa"] for n in ops)


def _worker(rank, world_size):
    import torch.distributed as dist

    out = []
    for spelling, window in [(s, None) for s in SPELLINGS] + [("repeat_interleave", 5), ("bthd_expand", 5)]:
        if True:
            case = ParityCase(
                model="tests.models.kv_heads:kv_heads_lm",
                doc_lens=DOCS,
                overrides=(("spelling", spelling), ("window", window)),
            )
            torch._dynamo.reset()  # one model class compiled 12 times: stay under Dynamo's recompile limit
            summary = check_case(case, dist.group.WORLD)
            out.append((spelling, window, summary, dataclasses.asdict(cpcompile.comm_stats())))
    return out


@pytest.mark.timeout(450)
def test_every_spelling_is_exact_and_moves_kv_heads_only():
    results = run_distributed(_worker, 2, timeout_s=420)
    c = 19  # 37 tokens padded to 38, over 2 ranks
    for spelling, window, summary, comm in results[0]:
        print(f"{spelling} window={window}: logits {summary['logits']:.1e} grad {summary['grad']:.1e}")
        heads = 4 if spelling == "tile" else 2
        if window is None:  # 2 layers x (K, V) x (N-1) chunks of [B=2, heads, c, head dim 8] fp32
            assert comm["all_gather_bytes"] == 2 * 2 * 1 * 2 * heads * c * 8 * 4, (spelling, comm)
        else:
            assert comm["all_gathers"] == 0 and comm["halo_exchanges"] == 4, (spelling, comm)
