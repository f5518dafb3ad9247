"""What ``cpcompile inspect`` and its dump show about position sources (one process; inspect makes its own
fake process group for every traced rank, so this module holds none)."""

from __future__ import annotations

import json

import cpcompile
from cpcompile.testing import tiny_config


def test_inspect_lists_rewritten_positions(tmp_path):
    inspection = cpcompile.inspect.inspect_model("tests.models.positions:titan_style", cp_size=2, seq_len=37)
    rows = [(g.rank, p.layer, p.kind, p.action) for g in inspection.graphs for p in g.positions]
    assert rows == [(r, f"layers.{i}.attn", "table_slice", "rewritten") for r in (0, 1) for i in (0, 1)]
    text = inspection.report()
    assert "positions computed from the local sequence length" in text
    assert "static trace" not in text  # inspect traces with training's symbolic length: found by the symbol
    written = cpcompile.inspect.write_dump(inspection, str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(p["rank"], p["layer"], p["action"]) for p in summary["positions"]] == [
        (r, f"layers.{i}.attn", "rewritten") for r in (0, 1) for i in (0, 1)
    ]
    rank1 = json.loads((tmp_path / "rank1" / "summary.json").read_text())
    assert [p["kind"] for p in rank1["graphs"][0]["positions"]] == ["table_slice", "table_slice"]
    after = (tmp_path / "rank1" / "graph0_after.py").read_text()
    assert after.count("torch.ops.cpcompile.token_positions.default(") == 2
    assert str(tmp_path / "rank1" / "graph0_after.py") in written


def test_inspect_reports_refused_and_mask_sources(tmp_path):
    mixed = cpcompile.inspect.inspect_model("tests.models.positions:mixed_positions", cp_size=2, seq_len=37, ranks=[1])
    assert [(p.node, p.kind, p.action) for g in mixed.graphs for p in g.positions] == [
        ("ones_like", "factory", "refused")
    ]
    assert "(node cumsum): cumsum mixes the values of different positions" in mixed.report()
    tiny_config("llama").save_pretrained(tmp_path)
    llama = cpcompile.inspect.inspect_model(str(tmp_path), cp_size=2, seq_len=37, ranks=[0])
    assert [(p.kind, p.action) for g in llama.graphs for p in g.positions] == [("arange", "mask")] * 2


def test_inspect_reports_a_decision_on_the_local_length():
    """A branch on the length that a rank's 19 tokens take otherwise than the whole 37: refused in the report, as
    training would refuse it, with the line and the decision; 24 tokens (12 per rank) decide alike."""
    refused = cpcompile.inspect.inspect_model("tests.models.positions:length_branch", cp_size=2, seq_len=37)
    rows = [(g.rank, p.node, p.kind, p.action) for g in refused.graphs for p in g.positions]
    assert ("length", "refused") in {(kind, action) for _, _, kind, action in rows}, rows
    assert {rank for rank, node, _, _ in rows if node == "(shape guard)"} == {0, 1}, rows
    text = refused.report()
    assert "it decided `T <= 24`" in text and "tests/models/positions.py:" in text, text
    alike = cpcompile.inspect.inspect_model("tests.models.positions:length_branch", cp_size=2, seq_len=24)
    assert all(p.node != "(shape guard)" for g in alike.graphs for p in g.positions)
