"""``examples/demo_cp.py`` runs end to end and its CP training matches the single-process run it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.harness.tiers import slow
from tests.harness.tolerances import DEMO_LOSS_ATOL, DEMO_PARAM_ATOL

ROOT = Path(__file__).resolve().parents[1]


def _run_demo() -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo_cp.py"), "--steps", "2", "--inner", "eager"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@slow  # the example end to end; its CP=2 parity is tests/test_parity.py's
def test_demo_runs_and_matches_single_process():
    proc = _run_demo()
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    rows = re.findall(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)\s*$", proc.stdout, flags=re.M)
    assert [int(r[0]) for r in rows] == [0, 1], proc.stdout
    for step, cp_loss, ref_loss, _ in rows:
        # recomputed from the two printed losses, not taken from the demo's own |diff| column
        assert abs(float(cp_loss) - float(ref_loss)) < DEMO_LOSS_ATOL, f"step {step}:\n{proc.stdout}"
    param = re.search(r"largest parameter difference after 2 AdamW steps: ([\d.e+-]+)", proc.stdout)
    assert param is not None, proc.stdout
    assert float(param.group(1)) < DEMO_PARAM_ATOL, proc.stdout
