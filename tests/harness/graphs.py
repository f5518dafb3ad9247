"""Running the cpcompile pass on a captured Dynamo graph in one process (no process group needed)."""

from __future__ import annotations

import itertools

import torch

from cpcompile.options import BackendOptions
from cpcompile.passes.common import PassContext
from cpcompile.passes.sdpa_cp import SiteReport, cp_attention_pass

_runs = itertools.count()


def context(*, cp_size: int = 2, refuse: str = "raise", site_prefix: str | None = None, **options) -> PassContext:
    """The pass context of rank 0 of a CP group of ``cp_size`` named ``"g"``; ``options``: BackendOptions
    (default ``attention="dense"``: SDPA stays in the graph, under the plan's mask)."""
    options.setdefault("dump_dir", None)
    options.setdefault("attention", "dense")
    return PassContext(
        options=BackendOptions(**options),
        group_name="g",
        cp_size=cp_size,
        cp_rank=0,
        graph_id=0,
        site_prefix=f"test{next(_runs)}" if site_prefix is None else site_prefix,  # site ids: unique per process
        refuse=refuse,
    )


def run_pass(gm: torch.fx.GraphModule, *, cp_size: int = 2, refuse: str = "raise", **options) -> list[SiteReport]:
    """Rewrite ``gm``'s attention in place with the :func:`context` of these arguments."""
    return cp_attention_pass(gm, context(cp_size=cp_size, refuse=refuse, **options))


def counter_delta(before: dict[str, int]) -> dict[str, int]:
    """The ``cpcompile.passes.counters`` that changed since the snapshot ``before``, by how much."""
    import cpcompile

    return {k: v - before.get(k, 0) for k, v in cpcompile.passes.counters.items() if v != before.get(k, 0)}


def dynamo_graph(model: torch.nn.Module, **inputs) -> torch.fx.GraphModule:
    """The one graph Dynamo traces of ``model(**inputs)`` (no pass applied; Dynamo is reset first)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture)(**inputs)
    assert len(graphs) == 1, f"expected one graph of {type(model).__name__}, got {len(graphs)}"
    return graphs[0]
