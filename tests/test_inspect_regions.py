"""`cpcompile inspect` shows the head-parallel and state-passing regions training runs, with their bytes.

A mixer of the model's own code is found by inspect as training finds it (``regions="found"``: probe, classify,
test, run; :mod:`cpcompile.regions`), and a refused one carries the reason training's error gives. Each CLI run is a
subprocess of its own: a found function is registered for the rest of its process. Expected bytes come from the
shapes and the documented formula (each all-to-all: ``(N - 1) / N`` of its input), never from the tool.
"""

from __future__ import annotations

import json

import pytest

import cpcompile
from cpcompile.testing import tiny_config
from tests.harness.tiers import slow
from tests.models.user_cores import HEAD_DIM, HEADS
from tests.test_inspect import _run_cli

CP, T, DOCS = 2, 37, "10,27"  # padded to 38: 19 tokens per rank
FP32 = 4


def _mixing(tmp_path, factory: str, *extra: str) -> list[dict]:
    dump = tmp_path / "dump"
    args = [f"tests.models.user_cores:{factory}", "--cp-size", str(CP), "--seq-len", str(T), "--docs", DOCS]
    run = _run_cli(*args, *extra, "--dump", str(dump))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((dump / "summary.json").read_text())["mixing"]


def test_a_found_mixer_is_shown_head_parallel_with_its_all_to_all_bytes(tmp_path):
    mixing = _mixing(tmp_path, "decayed_heads_lm")
    mixer = [m for m in mixing if m["layer"] == "mixer"]
    assert [(m["rank"], m["op"], m["action"]) for m in mixer] == [(0, "_decayed", "head_parallel"),
                                                                  (1, "_decayed", "head_parallel")], mixing  # fmt: skip
    c = (T + 1) // CP
    into = c * HEADS * HEAD_DIM + c * HEADS  # x [1, c, H, D] and g [1, c, H] per rank, all heads
    back = CP * c * (HEADS // CP) * HEAD_DIM  # y [1, N c, H / N, D]: every token of this rank's heads
    expected = (into + back) * FP32 * (CP - 1) // CP
    assert {m["all_to_all_bytes_per_call"] for m in mixer} == {expected}, mixer
    assert {m["split"] for m in mixer} == {"its heads (dim 2), every token"}, mixer  # x is [B, S, H, D]


def test_a_mixer_training_refuses_shows_refused_with_the_reason(tmp_path):
    """The negative control: a function that repeats its groups with ``repeat`` (not a map over the heads as the
    ranks split them) stays refused, and the first refusal names why no region was found."""
    mixing = _mixing(tmp_path, "tiled_groups_lm")
    refused = [m for m in mixing if m["action"] == "refused"]
    assert refused and not any(m["action"] == "head_parallel" for m in mixing), mixing
    first = refused[0]["reason"]
    assert "no head-parallel region: not tiled_groups" in first and "repeat combines values of different heads" in first


@slow
def test_a_method_is_found_on_cpu_and_refused_on_meta_with_the_fix(tmp_path):
    on_meta = _mixing(tmp_path / "meta", "scan_method_lm")
    assert not any(m["action"] == "head_parallel" for m in on_meta), on_meta
    assert any("pass --device cpu" in m["reason"] for m in on_meta), on_meta
    on_cpu = _mixing(tmp_path / "cpu", "scan_method_lm", "--device", "cpu")
    assert [m["action"] for m in on_cpu if m["layer"] == "mixer"] == ["head_parallel"] * CP, on_cpu


@pytest.mark.parametrize("recurrence", ["heads", pytest.param("state", marks=slow)])
def test_gated_delta_rule_bytes_per_call_heads_grow_with_the_length_state_do_not(tmp_path, recurrence):
    config = tiny_config("qwen3_next")
    config.save_pretrained(tmp_path)
    rows = {}
    for seq_len in (37, 101):
        result = cpcompile.inspect.inspect_model(
            str(tmp_path), cp_size=CP, seq_len=seq_len, ranks=[0], recurrence=recurrence
        )
        rows[seq_len] = [m for g in result.graphs for m in g.mixing if m.op == "torch_chunk_gated_delta_rule"]
    short, long = rows[37], rows[101]
    assert len(short) == len(long) == 1, rows
    if recurrence == "state":  # one all-gather of fixed-size summaries
        assert short[0].action == "state_passing" and short[0].all_to_all_bytes_per_call == 0, short
        assert short[0].split == "every head, its tokens", short
        assert short[0].all_gather_bytes_per_call == long[0].all_gather_bytes_per_call > 0, rows
        return
    hk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    hv, dv = config.linear_num_value_heads, config.linear_value_head_dim
    for seq_len, (row,) in rows.items():
        c = -(-seq_len // CP)
        into = c * (2 * hk * dk + hv * dv + 2 * hv)  # q, k, v, the decay g and beta of this rank's tokens
        back = CP * c * (hv // CP) * dv  # the output, every token of this rank's value heads
        expected = (into + back) * FP32 * (CP - 1) // CP
        assert (row.action, row.all_to_all_bytes_per_call, row.all_gather_bytes_per_call, row.split) == (
            "head_parallel", expected, 0, "its heads (dim 2), every token"), row  # fmt: skip
