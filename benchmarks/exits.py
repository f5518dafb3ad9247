"""How the examples end under torchrun: exit status and what the ranks print at exit, over consecutive launches.

Each launch is ``torchrun --standalone --nproc-per-node 2`` of one example for ``--steps`` steps (CP=2 on CPU,
both on ``cpcompile.gloo_backend()``): the Trainer example (``examples/sft_trainer_cp.py --trainer hf``) and the
FSDP2 example (``examples/train_fsdp_cp.py``). A launch is clean when torchrun exits 0 (every rank exited 0) and
the captured output holds none of the markers below: an unwaited functional collective at exit, a C++
terminate, glibc's heap checks, a rank killed by a signal.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import print_table  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Fragments of what a process prints when it does not end cleanly.
MARKERS = {
    "unwaited collective": "unwaited collective",
    "C++ terminate": "terminate called",
    "glibc heap check": "malloc(): ",
    "glibc free check": "free(): ",
    "signal": "Signal ",
}
#: example -> its arguments after the script
EXAMPLES = {
    "Trainer (sft_trainer_cp.py --trainer hf)": ["examples/sft_trainer_cp.py", "--trainer", "hf", "--batch", "4"],
    "FSDP2 (train_fsdp_cp.py)": ["examples/train_fsdp_cp.py"],
}


def launch(args: list[str], steps: int) -> tuple[int, list[str], float]:
    """One torchrun launch: its exit status, the markers found in its output, seconds."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args]
        + ["--steps", str(steps)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = proc.stdout + proc.stderr
    return proc.returncode, [name for name, m in MARKERS.items() if m in output], time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="launches per example")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    rows = []
    for name, example in EXAMPLES.items():
        statuses, found, seconds = [], [], []
        for i in range(args.runs):
            status, markers, s = launch(example, args.steps)
            statuses.append(status)
            found.extend(markers)
            seconds.append(s)
            print(f"{name} {i + 1}/{args.runs}: exit {status} {markers} in {s:.0f} s", flush=True)
        rows.append(
            {
                "example": name,
                "launches": args.runs,
                "exit 0": sum(s == 0 for s in statuses),
                **{marker: found.count(marker) for marker in MARKERS},
                "mean s": sum(seconds) / len(seconds),
            }
        )
    print_table(f"torchrun, 2 processes, CP=2, {args.steps} steps: how {args.runs} launches ended", rows, ".0f")


if __name__ == "__main__":
    main()
