"""What running a layer whole on every rank costs: a layer registered with ``cpcompile.cores.register_replicated``
against the same recurrence in a function of its own, run head-parallel, and the one-process model.

The model is :func:`tests.models.user_cores.inline_forward_lm` (a mixer, then one packed-document attention
layer), ``--hidden`` wide, 6 heads of 4 channels, whose mixer computes a per-head decayed recurrence as a ``[S, S]``
decay matrix per head and normalises across the heads:

* ``replicated``: the decay matrix built in the layer's ``forward`` (``form="matrix"``), the ``forward`` registered
  with ``register_replicated``: every rank runs the layer on the whole sequence;
* ``head_parallel``: the same values from ``decayed_heads``, a module-level function registered with
  ``register_head_parallel`` (``form="function"``): every rank runs it on the whole sequence of its heads, and the
  rest of the layer on its own tokens;
* ``one process``: the ``head_parallel`` model under plain ``torch.compile``, on the whole batch.

Each run is a set of new gloo processes of one thread. After two warm-up steps (compilation) the peak resident set
(VmHWM) is reset and one forward+backward step runs: ``peak MiB`` is the largest rank's peak above its resident
size before the step. ``step ms`` is the slowest rank's median of ``--steps`` steps. ``A2A MiB/step`` is the
largest rank's forward bytes received in the heads exchanges (``comm_stats().heads_bytes``, last step). Ratios
divide by the one-process row of the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks._common import packed_doc_lens, print_table, step_peak_mib


def _worker(rank: int, world: int, form: str, plain: bool, hidden: int, doc_lens, steps: int) -> dict:
    import torch.distributed as dist

    import cpcompile
    from cpcompile.testing import packed_batch
    from tests.models.user_cores import inline_forward_lm

    torch.set_num_threads(1)
    model = inline_forward_lm(form=form, hidden=hidden, registered=not plain)
    batch = packed_batch(doc_lens, vocab_size=128, seed=0)
    group = dist.group.WORLD
    backend = "aot_eager" if plain else cpcompile.backend(group, inner="aot_eager")
    compiled = torch.compile(model, backend=backend)

    def step():
        if plain:
            compiled(**batch).loss.backward()
        else:
            with cpcompile.shard(batch, group) as local:
                compiled(**local).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    step()
    peak = step_peak_mib(step, lambda: dist.barrier(group))
    times = []
    for _ in range(steps):
        dist.barrier(group)
        start = time.perf_counter()
        step()
        dist.barrier(group)
        times.append(time.perf_counter() - start)
    actions = [] if plain else [r.action for r in backend.mixing_reports]
    heads = 0 if plain else cpcompile.comm_stats().heads_bytes
    return {"peak": peak, "step": statistics.median(times), "heads": heads, "actions": actions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq", type=int, default=1024, help="global sequence length T of each row")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--docs", default="64,512", help="document length range lo,hi of the packed rows")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cp", default="2,4")
    args = ap.parse_args()
    from tests.harness.dist import run_distributed

    lo, hi = (int(x) for x in args.docs.split(","))
    doc_lens = packed_doc_lens(args.seq, args.batch, lo, hi)
    runs = [("one process", 1, "function", True)]
    for cp in (int(x) for x in args.cp.split(",")):
        runs += [("head_parallel", cp, "function", False), ("replicated", cp, "matrix", False)]
    rows, base = [], None
    for name, cp, form, plain in runs:
        res = run_distributed(_worker, cp, form, plain, args.hidden, doc_lens, args.steps, timeout_s=1800, fresh=True)
        expected = {"head_parallel": "head_parallel", "replicated": "replicated"}.get(name)
        if expected is not None and expected not in res[0]["actions"]:
            raise RuntimeError(f"{name} at CP={cp} ran {res[0]['actions']}")
        peak, step = max(r["peak"] for r in res), max(r["step"] for r in res)
        base = base or (peak, step)
        rows.append(
            {
                "CP": cp,
                "mixer": name,
                "peak MiB (max rank)": peak,
                "peak / one process": peak / base[0] if base[0] else float("nan"),
                "step ms (slowest rank)": 1e3 * step,
                "step / one process": step / base[1],
                "A2A MiB/step (fwd)": max(r["heads"] for r in res) / 2**20,
            }
        )
    print_table(
        f"a layer run whole on every rank against head-parallel: T={args.seq}, B={args.batch}, documents "
        f"{lo}..{hi} tokens, hidden {args.hidden}, 6 heads, aot_eager",
        rows,
    )


if __name__ == "__main__":
    main()
