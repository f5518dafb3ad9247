"""What finding a sequence mixer costs: the first step of a model whose mixer the backend finds (``regions="found"``)
against the same model with the mixer registered (``cpcompile.cores.register_head_parallel``), CP=2.

The model is :func:`tests.models.user_cores.user_core_lm` (a mixer of the user's own code, then one packed-document
attention layer), ``--hidden`` wide, with the core named by ``--cores``:

* ``decayed_heads``: the recurrence as one ``[S, S]`` decay matrix per head (an ``einsum`` over the sequence);
* ``looped_heads``: the recurrence as a Python loop over the tokens;
* ``grouped_heads``: a loop with a per-token gate of 2 groups of heads, split with them.

Found, the first step traces the frame three times (probe, classify, run) and runs the core eagerly on random inputs
of the traced shapes (its causality and its split over heads, two draws); registered, it traces once. Each
(core, registration) pair runs on two new gloo processes (a found core stays registered in its process), one thread
each: ``first step`` is the slowest rank's first training step (compilation included), ``later step`` the median of
``--steps`` steps after it (the graphs are the same, so the ratio should be about 1). The ``found / registered``
column divides the found row's first step by the registered row's, measured one after the other in this run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks._common import packed_doc_lens, print_table

CORES = ("decayed_heads", "looped_heads", "grouped_heads")


def _worker(rank: int, world: int, core: str, registered: bool, hidden: int, doc_lens, steps: int) -> dict:
    import torch.distributed as dist

    import cpcompile
    from cpcompile.testing import packed_batch
    from tests.models.user_cores import user_core_lm

    torch.set_num_threads(1)
    group = dist.group.WORLD
    model = user_core_lm(core=core, registered=registered, hidden=hidden)
    backend = cpcompile.backend(group, inner="aot_eager")
    compiled = torch.compile(model, backend=backend)
    batch = packed_batch(doc_lens, vocab_size=128, seed=0)
    times = []
    for _ in range(1 + steps):
        start = time.perf_counter()
        with cpcompile.shard(batch, group) as local:
            compiled(**local).loss.backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    if not any(r.action == "head_parallel" for r in backend.mixing_reports):
        raise RuntimeError(f"{core} did not run head-parallel: {backend.mixing_reports}")
    return {"first": times[0], "later": statistics.median(times[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq", type=int, default=256, help="global sequence length T of each row")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--docs", default="32,128", help="document length range lo,hi of the packed rows")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cores", default=",".join(CORES))
    args = ap.parse_args()
    from tests.harness.dist import run_distributed

    lo, hi = (int(x) for x in args.docs.split(","))
    doc_lens = packed_doc_lens(args.seq, args.batch, lo, hi)
    rows = []
    for core in args.cores.split(","):
        measured = {}
        for registered in (True, False):
            res = run_distributed(
                _worker, 2, core, registered, args.hidden, doc_lens, args.steps, timeout_s=1800, fresh=True
            )
            measured[registered] = (max(r["first"] for r in res), max(r["later"] for r in res))
        for registered in (True, False):
            first, later = measured[registered]
            rows.append(
                {
                    "core": core,
                    "mixer": "registered" if registered else "found",
                    "first step (s)": first,
                    "later step (ms)": 1e3 * later,
                    "first step, found / registered": first / measured[True][0],
                    "later step, found / registered": later / measured[True][1],
                }
            )
    print_table(
        f"finding a mixer: first and later training steps at CP=2, T={args.seq}, B={args.batch}, documents "
        f"{lo}..{hi} tokens, hidden {args.hidden}, aot_eager",
        rows,
    )


if __name__ == "__main__":
    main()
