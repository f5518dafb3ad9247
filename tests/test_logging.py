"""torch.compile's own tooling shows the backend's work: ``TORCH_LOGS=cpcompile`` and ``TORCH_TRACE`` + ``tlparse``.

Each case compiles a tiny Qwen3 (2 attention layers) as rank 0 of a CP group of 2 (a fake process group) in a
process of its own: a fresh interpreter with the environment variables set as a user would set them, or, for
``torch._logging.set_logs``, a process forked from the test harness's fork server.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.dist import run_alone

ROOT = Path(__file__).resolve().parents[1]

_IMPORTS = """
import logging, torch, cpcompile
from cpcompile import _compat
from cpcompile.testing import packed_batch, tiny_model
"""
#: Compile and run a tiny Qwen3 as rank 0 of 2 (a new backend, so the next run's graphs are backend 1's).
_RUN = """
with _compat.fake_process_group(0, 2) as group:
    model = torch.compile(tiny_model("qwen3"), backend=cpcompile.backend(group, inner="eager"))
    with cpcompile.shard(packed_batch([[10, 20, 6]]), group) as local:
        model(**local)
"""
_COMPILE = _IMPORTS + _RUN
SUMMARY = "cpcompile backend0 graph 0, CP rank 0 of 2: 2 SDPA site(s): 2 rewritten"
GRAPH_AFTER = "after the cpcompile passes"


def _compile(**env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "TORCH_TRACE")}
    environ["PYTHONPATH"] = str(ROOT) + os.pathsep + environ.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE], cwd=ROOT, env={**environ, **env}, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _lines_with(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


@pytest.fixture(scope="module")
def debug_run(tmp_path_factory) -> tuple[str, Path]:
    """One compile with ``TORCH_LOGS=+cpcompile`` and ``TORCH_TRACE``: (stderr, trace folder)."""
    trace = tmp_path_factory.mktemp("trace")
    return _compile(TORCH_LOGS="+cpcompile", TORCH_TRACE=str(trace)).stderr, trace


def test_torch_logs_plus_cpcompile_adds_the_graphs(debug_run):
    err, _ = debug_run
    assert _lines_with(err, SUMMARY), err[-3000:]
    assert _lines_with(err, "as Dynamo traced it") and _lines_with(err, GRAPH_AFTER)
    assert _lines_with(err, "cpcompile__compat_all_gather_start"), "the rewritten graph gathers K/V"


def _unasked_then_info() -> str:
    """What a process with no log settings writes to its stderr (fd 2) while it compiles one model (backend 0),
    turns cpcompile's INFO logs on (what ``TORCH_LOGS=cpcompile`` does) and compiles another."""
    import logging
    import tempfile

    import torch

    torch._logging.set_logs()  # torch's defaults, as in an interpreter started without TORCH_LOGS
    with tempfile.TemporaryFile() as captured:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            exec(_COMPILE, {})
            torch._logging.set_logs(modules={"cpcompile": logging.INFO})
            exec(_COMPILE, {})
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        return captured.read().decode()


def test_nothing_is_printed_unasked_and_info_prints_every_site_as_graphs_compile():
    # a new process forked from the harness's fork server (started without TORCH_LOGS)
    err = run_alone(_unasked_then_info)
    assert "backend0" not in err, err[-3000:]
    assert len(_lines_with(err, SUMMARY.replace("backend0", "backend1"))) == 1, err[-3000:]
    for layer in ("model.layers.0.self_attn", "model.layers.1.self_attn"):
        (row,) = _lines_with(err, layer)
        assert "bool-mask" in row and "rewritten" in row and "block" in row, row
    assert GRAPH_AFTER not in err, "the graphs are DEBUG output (+cpcompile)"


def test_torch_trace_holds_the_graphs_and_the_site_table(debug_run, tmp_path):
    _, trace = debug_run
    (log,) = trace.glob("*.log")
    artifacts = {}
    lines = log.read_text().splitlines()
    for i, line in enumerate(lines):
        if '{"artifact"' not in line:
            continue
        record = json.loads(line[line.index("{") :])
        payload = []
        for follow in lines[i + 1 :]:
            if not follow.startswith("\t"):
                break
            payload.append(follow[1:])
        name = record["artifact"]["name"]
        if name.startswith("cpcompile"):
            artifacts[name] = (record, "\n".join(payload))
    assert sorted(artifacts) == ["cpcompile_graph_after", "cpcompile_graph_before", "cpcompile_sites"]
    for record, _ in artifacts.values():
        assert (record["frame_id"], record["frame_compile_id"]) == (0, 0), "not attached to Dynamo's compile id"
    assert "as Dynamo traced it" in artifacts["cpcompile_graph_before"][1]
    assert "all_gather_start" in artifacts["cpcompile_graph_after"][1]
    sites = json.loads(artifacts["cpcompile_sites"][1])
    assert (sites["rank"], sites["cp_size"]) == (0, 2)
    assert [(s["layer"], s["action"]) for s in sites["sites"]] == [
        ("model.layers.0.self_attn", "rewritten"),
        ("model.layers.1.self_attn", "rewritten"),
    ]

    tlparse = shutil.which("tlparse") or shutil.which("tlparse", path=str(Path(sys.executable).parent))
    if tlparse is None:
        pytest.skip("tlparse is an optional test dependency (pip install tlparse); the trace itself was checked")
    out = tmp_path / "tl_out"
    proc = subprocess.run(
        [tlparse, str(log), "-o", str(out), "--no-browser", "--plain-text"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    shown = sorted(p.name.rsplit("_", 1)[0] for p in (out / "-_0_0_0").glob("cpcompile_*"))
    assert shown == ["cpcompile_graph_after", "cpcompile_graph_before", "cpcompile_sites"], shown
