"""Shared helpers of the benchmark scripts: the machine line, the command line, tables, packed batches."""

from __future__ import annotations

import gc
import math
import os
import platform
import random
import shlex
import sys

import torch
from tabulate import tabulate

__all__ = ["machine", "command", "print_table", "packed_doc_lens", "lognormal_doc_lens", "step_peak_mib"]


def machine() -> str:
    """One line naming the CPU, cores, load and torch version this run used."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cpu}, {os.cpu_count()} cores, load average {load:.1f} at start, torch {torch.__version__}"


def command() -> str:
    """The command that reproduces this run (from the repository root)."""
    return "PYTHONPATH=. python " + " ".join(shlex.quote(a) for a in sys.argv)


def print_table(title: str, rows: list[dict], floatfmt: str = ".3g") -> None:
    print(f"\n### {title}\n")
    print(f"machine: {machine()}")
    print(f"command: `{command()}`\n")
    print(tabulate(rows, headers="keys", tablefmt="github", floatfmt=floatfmt))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def step_peak_mib(step, barrier=lambda: None) -> float:
    """The peak resident memory of one call of ``step`` above the process's resident size before it, in MiB:
    after a garbage collection and ``barrier()`` (the other ranks at the same point), the kernel's peak (VmHWM) is
    reset to the current resident size (Linux ``/proc/self/clear_refs``) and read again after the step."""
    gc.collect()
    barrier()
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    step()
    return (_status_kib("VmHWM") - before) / 1024.0


def packed_doc_lens(total: int, rows: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """``rows`` rows of random document lengths in ``[lo, hi)`` that add up to ``total`` each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        lens: list[int] = []
        while sum(lens) < total:
            lens.append(int(torch.randint(lo, hi, (1,), generator=g)))
        lens[-1] -= sum(lens) - total
        out.append([n for n in lens if n > 0])
    return out


def lognormal_doc_lens(total: int, mean: float, seed: int, sigma: float = 1.0) -> list[int]:
    """Document lengths of log-normal distribution (``mean`` tokens, ``sigma`` of the log) adding up to ``total``,
    drawn from ``random.Random(seed)``; the last document is cut to fit."""
    rng = random.Random(seed)
    mu = math.log(mean) - sigma**2 / 2
    out: list[int] = []
    while sum(out) < total:
        out.append(max(1, int(rng.lognormvariate(mu, sigma))))
    out[-1] -= sum(out) - total
    return [n for n in out if n > 0]


def row_doc_lens(total: int, docs: str, lognormal_mean: int | None) -> tuple[list[list[int]], str]:
    """One packed row of ``total`` tokens and its description: documents of uniform lengths in ``docs``
    (``"lo,hi"``), or of log-normal lengths with mean ``lognormal_mean`` (sigma 1.0 of the log, seed 0) when given."""
    if lognormal_mean:
        return [lognormal_doc_lens(total, lognormal_mean, 0)], (
            f"log-normal documents of mean {lognormal_mean} (sigma 1.0, seed 0)"
        )
    lo, hi = (int(x) for x in docs.split(","))
    return packed_doc_lens(total, 1, lo, hi), f"documents {lo}..{hi} tokens"
