"""The batch check of :func:`cpcompile.shard`: every CP rank passed the same global batch with the same options.

With ``check_batch=True`` (the default) every rank posts, in one control round through the group's store
(:func:`cpcompile.failsafe.agree`), its validation verdict and a summary of its batch: keys, shapes and dtypes,
an int64 fingerprint of every tensor's contents, the layout, workload and options (:func:`checked_plan`). Without
it, the ranks still agree on the balanced layout's workload whenever it changes (:func:`unchecked_round`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import torch
import torch.distributed as dist

from cpcompile import failsafe
from cpcompile.layouts import Workload
from cpcompile.plan import CPPlan, build_plan
from cpcompile.runtime.block_masks import block_mask_tensors, check_block_masks
from cpcompile.runtime.comm import CommStats
from cpcompile.runtime.shard_options import ShardOptions, validate_options

__all__ = ["checked_plan", "unchecked_round"]

_UNSET = object()


#: The last workload every rank of a CP group (by name) agreed to balance with.
_AGREED_WORKLOAD: dict[str, Workload | None] = {}


def _agree_on_workload(group: dist.ProcessGroup, group_name: str, workload: Workload | None, comm: CommStats) -> None:
    """With ``shard(check_batch=False)``: check, in one control round, that every rank balances with the same
    workload, whenever it changes (the batch check compares it on every step otherwise).

    Every rank computes every rank's tokens from its own workload, so two workloads would split the sequence
    two ways (tokens held twice or never). The compiled workload changes when graphs compile, which every rank
    does in the same step; a rank that compiled other attention layers than its peers is reported here.
    """
    posts = failsafe.agree(
        group, "workload", None, what="the balanced layout's workload", payload=repr(workload), stats=comm
    )
    if len(set(posts)) > 1:
        ranks = {p: [r for r, q in enumerate(posts) if q == p] for p in posts}
        raise failsafe.mark_agreed(
            ValueError(
                "cpcompile.shard(layout='balanced'): the CP ranks would balance different workloads "
                f"(ranks by workload: {sorted(ranks.items(), key=lambda kv: kv[1])}); every rank must compile the "
                "same attention layers before the step: pass the same workload=cpcompile.Workload(...) on every "
                "rank, or use layout='contiguous'"
            )
        )
    _AGREED_WORKLOAD[group_name] = workload


def unchecked_round(
    group: dist.ProcessGroup, group_name: str, layout: str, workload: Workload | None, comm: CommStats
) -> None:
    """The control round of a step with ``shard(check_batch=False)`` on a CP group of more than one rank: the
    workload agreement when the balanced layout's workload changed, a skipped round otherwise."""
    failsafe.set_fingerprint(group, "")
    if layout == "balanced" and _AGREED_WORKLOAD.get(group_name, _UNSET) != workload:
        _agree_on_workload(group, group_name, workload, comm)
    else:
        failsafe.skip(group, "a step without the batch check (cpcompile.shard(check_batch=False))", comm)


#: Keys whose contents the batch check names by meaning; any other tensor is named by its key.
_CONTENTS = {
    "input_ids": "the token ids",
    "position_ids": "the positions (document boundaries: a new document wherever a position does not step by +1)",
    "labels": "the labels",
    "attention_mask": "the attention mask",
}


def checked_plan(
    batch: Mapping[str, object],
    group: dist.ProcessGroup,
    cp_rank: int,
    group_name: str,
    comm: CommStats,
    options: ShardOptions,
) -> tuple[CPPlan, Workload | None, dict[str, object]]:
    """Validate the batch and options, and compare them across the CP group in one control round.

    Every rank posts its validation verdict and a summary of its batch (keys, shapes and dtypes, an int64
    fingerprint of every tensor's contents, the layout, workload and options); every rank raises the same
    ``ValueError`` when one rank's batch is invalid or the summaries differ. The group's later rounds of this
    step carry a digest of the summary.
    """
    plan, workload, pads, summary, error = None, None, {}, None, None
    try:
        workload, pads = validate_options(batch, group_name, options)
        size = dist.get_world_size(group)
        plan = build_plan(batch, size, cp_rank, layout=options.layout, workload=workload, group_name=group_name)
        check_block_masks(batch, plan.batch_size, plan.seq_len)
        summary = _batch_summary(batch, options, workload)
    except (ValueError, TypeError) as e:
        error = e
    step = failsafe.current_step(group)
    what = "the batch validation of cpcompile.shard"
    posts = failsafe.agree(group, "batch", error, what=what, payload=summary, stats=comm)
    differences = _differences(posts)
    if differences:
        raise failsafe.mark_agreed(
            ValueError(
                f"cpcompile.shard: the CP ranks passed different batches or options in step {step} "
                f"(check_batch=True, the default):\n" + "\n".join(f"  - {d}" for d in differences) + "\nEvery "
                "rank of the CP group must pass the same FULL global batch with the same shard(...) options: "
                "give the CP ranks of one data-parallel replica the same data (same sampler seed and DP rank)"
            )
        )
    digest = hashlib.sha256(json.dumps(posts[0], sort_keys=True).encode()).hexdigest()[:16]
    failsafe.set_fingerprint(group, digest)
    if options.layout == "balanced":
        _AGREED_WORKLOAD[group_name] = workload
    return plan, workload, pads


def _batch_summary(batch: Mapping[str, object], options: ShardOptions, workload: Workload | None) -> dict:
    tensors = {k: v for k, v in sorted(batch.items()) if isinstance(v, torch.Tensor)}
    for key, value in sorted(batch.items()):  # a BlockMask: its block tables and the tensors its mask_mod reads
        tensors.update(block_mask_tensors(key, value))
    prints = torch.stack([_fingerprint(v) for v in tensors.values()]).tolist()  # one host synchronisation
    return {
        "shapes": {k: [list(v.shape), str(v.dtype)] for k, v in tensors.items()},
        "passed through": sorted(str(k) for k, v in batch.items() if not isinstance(v, torch.Tensor)),
        "options": options.summary(),
        "workload": repr(workload) if options.layout == "balanced" else None,
        "contents": dict(zip(tensors, prints)),
    }


def _by_value(values: list) -> str:
    """``rank 0: v, ranks [1, 2]: w`` for per-rank values (JSON-comparable)."""
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(json.dumps(v, sort_keys=True), []).append(r)
    return "; ".join(
        f"{'rank' if len(rs) == 1 else 'ranks'} {rs[0] if len(rs) == 1 else rs}: {v}" for v, rs in groups.items()
    )


def _groups(values: list) -> list[list[int]]:
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(json.dumps(v, sort_keys=True), []).append(r)
    return sorted(groups.values())


def _differences(posts: list[dict]) -> list[str]:
    """What differs between the ranks' batch summaries, one line per difference (the same on every rank)."""
    out = []
    shapes = [p["shapes"] for p in posts]
    keys = [sorted(s) for s in shapes]
    if len({json.dumps(k) for k in keys}) > 1:
        out.append(f"the tensor keys of the batch differ ({_by_value(keys)})")
    for key in sorted(set().union(*shapes)):
        values = [s.get(key) for s in shapes]
        if len({json.dumps(v) for v in values}) == 1:
            continue
        dims = [None if v is None else v[0] for v in values]
        parts = []
        for d, name in ((0, "B (rows)"), (1, "T (sequence length)")):
            sizes = [None if s is None or len(s) <= d else s[d] for s in dims]
            if len(set(map(str, sizes))) > 1:
                parts.append(f"{name}: {_by_value(sizes)}")
        if not parts:
            parts.append(f"shape and dtype: {_by_value(values)}")
        out.append(f"batch[{key!r}] " + "; ".join(parts))
    others = [p["passed through"] for p in posts]
    if len({json.dumps(o) for o in others}) > 1:
        out.append(f"the keys passed through (not tensors) differ ({_by_value(others)})")
    for name in posts[0]["options"]:
        values = [p["options"][name] for p in posts]
        if len({json.dumps(v) for v in values}) > 1:
            out.append(f"shard(..., {name}=...) differs ({_by_value(values)})")
    workloads = [p["workload"] for p in posts]
    if len(set(workloads)) > 1:
        out.append(
            f"the balanced layout's workload differs ({_by_value(workloads)}): every rank must compile the same "
            "attention layers before the step: pass the same workload=cpcompile.Workload(...) on every rank, "
            "or use layout='contiguous'"
        )
    if not out:  # same shapes and options: compare the contents
        for key in posts[0]["contents"]:
            values = [p["contents"][key] for p in posts]
            if len(set(values)) > 1:
                what = _CONTENTS.get(key, "the values")
                out.append(f"batch[{key!r}]: {what} differ (ranks grouped by value: {_groups(values)})")
    return out


#: Position weights of :func:`_fingerprint`, by device and length (a step reuses the previous step's).
_WEIGHTS: dict[tuple[str, int], torch.Tensor] = {}


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """An int64 fingerprint of a tensor's values (position-weighted sum with wrap-around, so that a change of one
    value or a permutation changes it; exact integer arithmetic, so equal tensors give equal fingerprints on
    every device). One pass over the tensor and one host synchronisation when read."""
    x = t.detach().reshape(-1)
    if x.dtype.is_floating_point or x.dtype.is_complex:  # compare the bits (a NaN equals itself)
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
        x = x.contiguous().view(ints.get(x.element_size(), torch.uint8))
    x = x.to(torch.int64)
    n = x.numel()
    key = (str(x.device), n)
    w = _WEIGHTS.get(key)
    if w is None:
        w = (torch.arange(1, n + 1, device=x.device, dtype=torch.int64) * 2654435761) % 4294967291 + 1
        if len(_WEIGHTS) > 16:
            _WEIGHTS.clear()
        _WEIGHTS[key] = w
    return (x * w).sum() + n
