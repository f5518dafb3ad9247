"""The runtime shim: ``shard`` (slice a global batch for this rank), ``gather``, ``comm_stats``, ``sync_grads``.

The compiled graph cannot carry the per-batch layout (FSDP2 splits a model into one graph per layer, and the
layer graphs never see ``position_ids``), so :func:`shard` activates a :class:`~cpcompile.plan.CPPlan` for the
duration of a ``with`` block and the rewritten graph reads it at run time through the custom ops of
:mod:`cpcompile.ops` (:func:`active_context` is their way in).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import threading
import warnings
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from cpcompile import _compat, failsafe
from cpcompile.layouts import DEFAULT_LAYOUT, LAYOUTS, AttentionForm, Workload
from cpcompile.plan import IGNORE_INDEX, CPPlan, build_plan

__all__ = [
    "CommStats",
    "active_context",
    "check_group",
    "comm_stats",
    "compiled_workload",
    "current_plan",
    "default_pad_value",
    "gather",
    "real_tokens",
    "record_attention_form",
    "record_attention_free_graph",
    "shard",
    "sync_grads",
]


@dataclasses.dataclass
class StepRecord:
    """What ran in one :func:`shard` step: rewritten attention calls, and compiled graphs without attention."""

    #: Calls of rewritten attention sites (``cpcompile::site_plan``).
    sites: int = 0
    #: Frames of the compiled graphs of this CP group that have no rewritten attention and ran in the step.
    attention_free: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Active:
    """The active :func:`shard` context: its plan, CP group and collective counts."""

    plan: CPPlan
    group: dist.ProcessGroup | None
    comm: CommStats = dataclasses.field(default_factory=lambda: CommStats())
    #: The model masks already compared with the plan in this step (written only by the attention ops).
    checked_masks: set = dataclasses.field(default_factory=set)
    ran: StepRecord = dataclasses.field(default_factory=StepRecord)


class _State(threading.local):
    """The shard context that is active in this thread; owned by :func:`shard`."""

    def __init__(self) -> None:
        self.active: Active | None = None
        self.last_comm: CommStats | None = None


_STATE = _State()


def current_plan() -> CPPlan | None:
    """The plan of the innermost active :func:`shard` context of this thread, or ``None``."""
    current = _STATE.active
    return None if current is None else current.plan


def check_group(cp_group: object, what: str = "cp_group") -> tuple[int, int, str]:
    dim = "dp" if what == "dp_group" else "cp"
    if _compat.is_non_member_group(cp_group):
        raise ValueError(
            f"{what} is the placeholder torch.distributed.new_group returns to ranks outside the group, so this "
            f"process (global rank {dist.get_rank()}) is not a member of it; pass the CP group that contains this "
            "rank (every rank calls new_group for every group and keeps the one it belongs to)"
        )
    if not isinstance(cp_group, dist.ProcessGroup):
        raise TypeError(
            f"{what} must be a torch.distributed.ProcessGroup, got {type(cp_group).__name__}; create one with "
            f"torch.distributed.new_group(ranks) or DeviceMesh.get_group('{dim}')"
        )
    rank = dist.get_rank(cp_group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of {what} "
            f"(ranks {dist.get_process_group_ranks(cp_group)}); pass the {dim.upper()} group that contains this rank"
        )
    return dist.get_world_size(cp_group), rank, _compat.group_name_of(cp_group)


@contextlib.contextmanager
def shard(
    batch: Mapping[str, object],
    cp_group: dist.ProcessGroup,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    dp_group: dist.ProcessGroup | None = None,
    pad_token_id: int = 0,
    hf_kwargs: bool = True,
    check_batch: bool = True,
    dynamic: bool = True,
    layout: str = DEFAULT_LAYOUT,
    workload: Workload | None = None,
    pad_values: Mapping[str, int | float | bool] | None = None,
) -> Iterator[dict[str, object]]:
    """Slice the FULL global ``batch`` for this CP rank and activate its plan for the compiled model.

    Args:
        batch: dict of ``[B, T, ...]`` tensors, identical on every rank of ``cp_group``. ``input_ids`` is
            required; ``position_ids`` (default ``arange(T)`` per row; packed documents restart at 0) and
            ``labels`` (unshifted, ``-100`` ignored) are optional; any other ``[B, T, ...]`` tensor is sliced
            the same way and anything that is not a tensor is passed through.
        cp_group: the context-parallel process group. A group of size 1 slices nothing.
        num_items_in_batch: loss denominator. Default: the number of supervised tokens of this batch
            (labels ``!= -100`` after the shift), summed over ``dp_group`` when one is given. Pass a
            precomputed count to use it as is (then ``dp_group`` must be ``None``).
        dp_group: the data-parallel process group when data parallelism splits the global batch further
            (each DP rank passes its own rows). The supervised-token count is all-reduced (summed) over it,
            so the loss denominator is the count of the whole global batch and the per-rank losses of all
            DP and CP ranks add up to the global mean. One small all-reduce per batch.
        pad_token_id: token id used to pad ``T`` up to a multiple of the CP size.
        hf_kwargs: add the keyword arguments a transformers causal LM needs (``use_cache=False`` so the model
            builds its packed-document mask, and with labels ``shift_labels``/``num_items_in_batch``).
        check_batch: (default ``True``) decide the batch validation together and check that every rank of
            ``cp_group`` passed the same global batch with the same options, in one control round per step
            through the group's store (never a collective): every rank posts its verdict, the keys, shapes and
            dtypes of the batch, an int64 fingerprint of every tensor's contents (token ids, positions and so
            the document boundaries, labels, extra keys), the layout, the balanced layout's workload and the
            options that change what a rank holds. A difference raises the same ``ValueError`` on every rank,
            naming the ranks and what differs, before anything is compiled or communicated. ``False`` skips
            the round (one store write instead); ranks that pass different batches then run silently wrong,
            and a batch whose ``T`` or ``B`` differs between ranks reaches the K/V collectives. Every rank must
            pass the same value.
        dynamic: mark the sequence dim of the local tensors dynamic (below); ``False`` lets Dynamo specialise
            on the chunk length (one compile per length, concrete sizes in the graph).
        layout: which global tokens every rank holds (:data:`cpcompile.plan.LAYOUTS`): ``"balanced"``
            (default: every rank computes the same attention work for this batch, :mod:`cpcompile.layouts`),
            ``"contiguous"`` (rank ``r`` holds ``[r*c, (r+1)*c)``) or ``"head_tail"`` (pieces ``r`` and
            ``2N-1-r`` of ``2N``). Chosen per batch; changing it, or the documents, between steps does not
            recompile.
        workload: what ``"balanced"`` evens out (:class:`cpcompile.plan.Workload`). Default: the attention
            forms (documents, sliding window, number of layers) and the kernel's block size of the layers
            compiled for ``cp_group`` so far (:func:`compiled_workload`); before the first compilation, full
            causal attention over packed documents in blocks of :data:`cpcompile.layouts.DEFAULT_BLOCK_SIZE`.
        pad_values: value that pads each extra ``[B, T, ...]`` key (not ``input_ids``, ``position_ids``,
            ``labels``) where ``T`` is padded up to a multiple of the CP size, e.g. ``{"targets": -100}``. Keys
            not given get :func:`default_pad_value` of their dtype: ``-100`` for integers (the ignore index of
            pre-shifted targets), ``0.0`` for floats (loss masks, advantages), ``False`` for bools, so that
            padding stays out of losses that ignore ``-100`` or weight tokens by a mask. Losses of any other
            form mask padding with :func:`real_tokens`.

    With ``dynamic`` (the default) the sequence dim of every local per-token tensor is marked dynamic, so
    packed batches of changing length compile once with a symbolic length instead of once per length.

    Yields:
        ``local``: this rank's tokens of every per-token tensor (in ascending global order), their global
        ``position_ids``, and with labels ``labels`` (this rank's tokens), ``shift_labels`` (shifted over the
        whole row before the tokens are distributed) and
        ``num_items_in_batch``, so that the per-rank losses add up to the global mean.

    An error in the batch validation or in the ``with`` block is reported to the other CP ranks, and a rank
    that another rank's failure leaves waiting raises :class:`~cpcompile.failsafe.RankFailedError` naming it
    (:mod:`cpcompile.failsafe`); once that happened on ``cp_group``, ``shard`` raises it again at once.
    """
    cp_size, cp_rank, group_name = check_group(cp_group)
    if dp_group is not None:
        check_group(dp_group, "dp_group")
    if _STATE.active is not None:
        raise RuntimeError(
            "cpcompile.shard contexts cannot be nested: a shard context is already active in this thread; "
            "finish the current step's `with cpcompile.shard(...)` block before starting another"
        )
    if not isinstance(check_batch, bool):
        raise TypeError(f"check_batch must be True or False, got {check_batch!r}")
    options = _ShardOptions(
        layout=layout,
        workload=workload,
        num_items_in_batch=num_items_in_batch,
        dp_group=dp_group,
        pad_token_id=pad_token_id,
        hf_kwargs=hf_kwargs,
        dynamic=dynamic,
        pad_values=pad_values,
    )
    comm = CommStats()
    failsafe.enter_step(cp_group, comm)
    with failsafe.scope(cp_group, "the batch validation of cpcompile.shard", in_step=True):
        if check_batch and cp_size > 1:
            plan, workload, pads = _checked_plan(batch, cp_group, cp_rank, group_name, comm, options)
        else:
            workload, pads = _validate_options(batch, group_name, options)
            plan = build_plan(batch, cp_size, cp_rank, layout=layout, workload=workload, group_name=group_name)
            if cp_size > 1:
                failsafe.set_fingerprint(cp_group, "")
                if layout == "balanced" and _AGREED_WORKLOAD.get(group_name, _UNSET) != workload:
                    _agree_on_workload(cp_group, group_name, workload, comm)
                else:
                    failsafe.skip(cp_group, "a step without the batch check (cpcompile.shard(check_batch=False))", comm)
        local = _local_batch(
            batch,
            plan,
            num_items_in_batch=num_items_in_batch,
            dp_group=dp_group,
            pad_token_id=pad_token_id,
            hf_kwargs=hf_kwargs,
            pad_values=pads,
        )
    if dynamic:
        mark_local_dynamic(local, plan.chunk_len)
    context = Active(plan, cp_group, comm)
    _STATE.active = context
    try:
        yield local
        if cp_size > 1:
            _warn_if_no_attention(context, group_name)
    except BaseException as e:
        where = "the `with cpcompile.shard(...)` block"
        explained = _padding_error(e, batch, plan, pads)
        if explained is not None:
            failsafe.on_failure(cp_group, explained, where=where, in_step=True)
            raise explained from e
        failsafe.on_failure(cp_group, e, where=where, in_step=True)
        raise
    finally:
        _STATE.active = None
        _STATE.last_comm = context.comm


def record_attention_free_graph(group_name: str, frame: str) -> None:
    """Note that a graph compiled for ``group_name`` without rewritten attention ran (called by the backend)."""
    current = _STATE.active
    if current is not None and current.plan.group_name == group_name and frame not in current.ran.attention_free:
        current.ran.attention_free.append(frame)


#: (group name, frames) already warned about by :func:`_warn_if_no_attention`.
_WARNED_NO_ATTENTION: set[tuple[str, tuple[str, ...]]] = set()


def _warn_if_no_attention(context: Active, group_name: str) -> None:
    """Warn once when compiled graphs of the group ran in this step but no rewritten attention did.

    A warning, not an error: a model without attention (token-wise layers only) is exact under CP, and the
    backend cannot tell it from a model whose attention ran outside the compiled graphs (a
    ``@torch.compiler.disable`` function, a graph break around it), which attends over this rank's chunk only.
    """
    ran = context.ran
    if ran.sites or not ran.attention_free:
        return
    key = (group_name, tuple(ran.attention_free))
    if key in _WARNED_NO_ATTENTION:
        return
    _WARNED_NO_ATTENTION.add(key)
    warnings.warn(
        f"cpcompile.shard: the model ran {len(ran.attention_free)} graph(s) compiled for CP group {group_name!r} "
        f"in this step ({'; '.join(ran.attention_free)}) and none of them held attention: if the model has "
        "attention, it ran outside the compiled graphs (inside a @torch.compiler.disable function, or cut off by "
        "a graph break) and attended over this rank's tokens only, which is wrong under context parallelism. "
        "Let Dynamo trace the attention (remove the disable, fix the graph break: TORCH_LOGS=graph_breaks). A "
        "model without attention can ignore this warning",
        stacklevel=3,
    )


#: What was compiled per CP group: group name -> ((documents, window) -> layer names, block sizes of the kernel).
#: Written by :func:`record_attention_form` (the pass, for every site it rewrites), read by :func:`shard`.
_FORMS: dict[str, tuple[dict[tuple[bool, int | None], set[str]], set[int]]] = {}
_FORMS_LOCK = threading.Lock()


def record_attention_form(group_name: str, layer: str, documents: bool, window: int | None, block_size: int) -> None:
    """Note that ``layer``, compiled for the CP group ``group_name``, attends in this form with this block size."""
    with _FORMS_LOCK:
        forms, blocks = _FORMS.setdefault(group_name, ({}, set()))
        forms.setdefault((documents, window), set()).add(layer)
        blocks.add(block_size)


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


def compiled_workload(group_name: str) -> Workload:
    """The :class:`~cpcompile.plan.Workload` of the layers compiled for ``group_name`` so far (default before).

    Every form counts its distinct layers; the block size is the smallest the compiled sites use.
    """
    with _FORMS_LOCK:
        forms, blocks = _FORMS.get(group_name, ({}, set()))
        counts = {key: len(layers) for key, layers in forms.items()}
        block = min(blocks, default=Workload.block_size)
    if not counts:
        return Workload()
    # sorted: every rank builds the same workload whatever order its graphs compiled in
    ordered = sorted(counts.items(), key=lambda kv: (not kv[0][0], kv[0][1] is not None, kv[0][1] or 0))
    return Workload(forms=tuple(AttentionForm(d, w, n) for (d, w), n in ordered), block_size=block)


def mark_local_dynamic(local: Mapping[str, object], chunk_len: int) -> None:
    """Mark the sequence dim (dim 1, of size ``chunk_len``) of every per-token tensor of ``local`` dynamic."""
    for value in local.values():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == chunk_len:
            _compat.mark_seq_dynamic(value, 1)


def _local_batch(
    batch: Mapping[str, object],
    plan: CPPlan,
    *,
    num_items_in_batch: int | torch.Tensor | None,
    dp_group: dist.ProcessGroup | None,
    pad_token_id: int,
    hf_kwargs: bool,
    pad_values: Mapping[str, int | float | bool] | None = None,
) -> dict[str, object]:
    local: dict[str, object] = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            local[key] = value
        elif key == "position_ids":
            continue
        elif key == "attention_mask":
            if not bool(value.all()):
                raise ValueError(
                    "batch['attention_mask'] masks out tokens; cpcompile.shard supports padding-free packed "
                    "batches: drop padding, concatenate the documents and mark them with position_ids that "
                    "restart at 0 (the transformers packing convention)"
                )
        elif key == "input_ids":
            local[key] = plan.local(plan.pad(value, pad_token_id))
        elif key == "labels":  # int64 whatever integer type came in: the loss (cross entropy) needs it
            local[key] = plan.local(plan.pad(value.to(torch.long), IGNORE_INDEX))
        else:
            pad = (pad_values or {}).get(key, default_pad_value(value.dtype))
            local[key] = plan.local(plan.pad(value, pad))
    local["position_ids"] = plan.local(plan.position_ids)
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and hf_kwargs:
        shifted = plan.labels_shifted(labels.to(torch.long))
        local["shift_labels"] = plan.local(shifted)
        if num_items_in_batch is None:
            num_items_in_batch = (shifted != IGNORE_INDEX).sum()
            if dp_group is not None:
                dist.all_reduce(num_items_in_batch, group=dp_group)
        local["num_items_in_batch"] = torch.as_tensor(num_items_in_batch, device=labels.device)
    if hf_kwargs:
        local["use_cache"] = False
    return local


def _padding_error(
    exc: BaseException, batch: Mapping[str, object], plan: CPPlan, pads: Mapping[str, object]
) -> ValueError | None:
    """The ``ValueError`` to raise instead of an index error in the ``shard`` block when integer extra keys were
    padded with the default ``-100`` (an index key such as ``segment_ids`` then indexes out of range)."""
    index_error = isinstance(exc, IndexError) or (isinstance(exc, RuntimeError) and "index out of range" in str(exc))
    if not index_error or plan.num_padding == 0:
        return None
    keys = [
        k
        for k, v in batch.items()
        if isinstance(v, torch.Tensor)
        and k not in _OWN_PADDING
        and k not in pads
        and not (v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool)
    ]
    if not keys:
        return None
    fix = ", ".join(f"{k!r}: 0" for k in keys)
    return ValueError(
        f"an index went out of range in the `with cpcompile.shard(...)` block ({type(exc).__name__}: "
        f"{str(exc).splitlines()[0] if str(exc) else ''}), and the integer key(s) {keys} of the batch were padded "
        f"with {IGNORE_INDEX} (T = {plan.seq_len} is padded to {plan.padded_len}, a multiple of the CP size "
        f"{plan.cp_size}): -100 is the default so that pre-shifted targets ignore padding, but an index key "
        "(segment ids, token type ids) cannot hold it. Pass a value the model accepts, e.g. "
        f"cpcompile.shard(..., pad_values={{{fix}}}), and mask padding in the loss with cpcompile.real_tokens()"
    )


#: Keys whose padding cpcompile decides (``pad_token_id`` for ``input_ids``, the ignore index for ``labels``).
_OWN_PADDING = ("input_ids", "position_ids", "labels", "attention_mask")


def default_pad_value(dtype: torch.dtype) -> int | float | bool:
    """The value :func:`shard` pads an extra key of ``dtype`` with: ``False`` (bool), ``-100`` (integers: the
    ignore index of pre-shifted targets), ``0.0`` (floats: a loss mask or advantage of 0 adds nothing)."""
    if dtype == torch.bool:
        return False
    if dtype.is_floating_point or dtype.is_complex:
        return 0.0
    return IGNORE_INDEX


def _pad_values(batch: Mapping[str, object], pad_values: Mapping[str, object] | None) -> dict[str, object]:
    """Check ``shard(pad_values=...)`` against the batch (before any collective); return it as a dict."""
    if pad_values is None:
        return {}
    if not isinstance(pad_values, Mapping):
        raise TypeError(
            f"pad_values must be a dict of batch key -> pad value, got {type(pad_values).__name__}; "
            'e.g. pad_values={"targets": -100}'
        )
    extra = sorted(k for k, v in batch.items() if isinstance(v, torch.Tensor) and k not in _OWN_PADDING)
    for key, pad in pad_values.items():
        if key in _OWN_PADDING:
            raise ValueError(
                f"pad_values[{key!r}]: cpcompile pads {key!r} itself (input_ids with pad_token_id, labels with "
                f"-100, position_ids as a separate document); pad_values applies to the other keys: {extra}"
            )
        if key not in extra:
            raise ValueError(
                f"pad_values names {key!r}, which is not a tensor of the batch; the extra keys are {extra}"
            )
        dtype = batch[key].dtype
        ok = (
            isinstance(pad, bool)
            if dtype == torch.bool
            else isinstance(pad, (int, float)) and not isinstance(pad, bool)
            if dtype.is_floating_point
            else isinstance(pad, int) and not isinstance(pad, bool)
        )
        if not ok:
            kind = "a bool" if dtype == torch.bool else "a number" if dtype.is_floating_point else "an int"
            raise TypeError(f"pad_values[{key!r}] = {pad!r} does not fit batch[{key!r}] of dtype {dtype}; pass {kind}")
    return dict(pad_values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ShardOptions:
    """The options of one :func:`shard` call that change what a rank holds (compared across the CP ranks)."""

    layout: str
    workload: Workload | None
    num_items_in_batch: int | torch.Tensor | None
    dp_group: dist.ProcessGroup | None
    pad_token_id: int
    hf_kwargs: bool
    dynamic: bool
    pad_values: Mapping[str, int | float | bool] | None

    def summary(self) -> dict:
        """What every CP rank must pass alike, JSON-serialisable (the workload is added by the caller)."""
        items = self.num_items_in_batch
        if isinstance(items, torch.Tensor):
            items = "a tensor" if items.numel() != 1 else items.item()
        return {
            "layout": self.layout,
            "num_items_in_batch": items,
            # each CP rank belongs to its own DP group: compare its size, not its name
            "dp_group": None if self.dp_group is None else f"a group of {dist.get_world_size(self.dp_group)}",
            "pad_token_id": self.pad_token_id,
            "hf_kwargs": self.hf_kwargs,
            "dynamic": self.dynamic,
            "pad_values": None if self.pad_values is None else repr(sorted(dict(self.pad_values).items())),
        }


_UNSET = object()


def _validate_options(
    batch: Mapping[str, object], group_name: str, options: _ShardOptions
) -> tuple[Workload | None, dict[str, object]]:
    """Check the options of :func:`shard` against each other and the batch; return the workload and pad values."""
    if options.dp_group is not None and options.num_items_in_batch is not None:
        raise ValueError(
            f"cpcompile.shard got both num_items_in_batch={options.num_items_in_batch!r} and dp_group: pass either "
            "a precomputed global count or dp_group (to sum this batch's count over the DP ranks), not both"
        )
    if options.layout not in LAYOUTS:
        raise ValueError(f"layout={options.layout!r} is not a known layout; choose one of {sorted(LAYOUTS)}")
    workload = options.workload
    if workload is None and options.layout == "balanced":
        workload = compiled_workload(group_name)
    return workload, _pad_values(batch, options.pad_values)


#: Keys whose contents the batch check names by meaning; any other tensor is named by its key.
_CONTENTS = {
    "input_ids": "the token ids",
    "position_ids": "the positions (document boundaries: a new document wherever a position does not step by +1)",
    "labels": "the labels",
    "attention_mask": "the attention mask",
}


def _checked_plan(
    batch: Mapping[str, object],
    group: dist.ProcessGroup,
    cp_rank: int,
    group_name: str,
    comm: CommStats,
    options: _ShardOptions,
) -> tuple[CPPlan, Workload | None, dict[str, object]]:
    """Validate the batch and options, and compare them across the CP group in one control round.

    Every rank posts its validation verdict and a summary of its batch (keys, shapes and dtypes, an int64
    fingerprint of every tensor's contents, the layout, workload and options); every rank raises the same
    ``ValueError`` when one rank's batch is invalid or the summaries differ. The group's later rounds of this
    step carry a digest of the summary.
    """
    plan, workload, pads, summary, error = None, None, {}, None, None
    try:
        workload, pads = _validate_options(batch, group_name, options)
        size = dist.get_world_size(group)
        plan = build_plan(batch, size, cp_rank, layout=options.layout, workload=workload, group_name=group_name)
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


def _batch_summary(batch: Mapping[str, object], options: _ShardOptions, workload: Workload | None) -> dict:
    tensors = {k: v for k, v in sorted(batch.items()) if isinstance(v, torch.Tensor)}
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


def real_tokens() -> torch.Tensor:
    """Bool ``[B, c]`` of the active :func:`shard` context: True for this rank's tokens of the batch, False for
    the padding that makes ``T`` a multiple of the CP size. Multiply a hand-written per-token loss by it (or
    index with it) so that padding never contributes, whatever the padded keys hold."""
    return active_context("cpcompile.real_tokens").plan.real_tokens()


def active_context(what: str) -> Active:
    """The active :func:`shard` context of this thread; ``RuntimeError`` naming ``what`` needed it otherwise."""
    current = _STATE.active
    if current is None:
        raise RuntimeError(
            f"{what} needs an active CP plan, but no cpcompile.shard context is active; call the model as "
            "`with cpcompile.shard(batch, cp_group) as local: model(**local)`"
        )
    return current


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, dim: int, group: dist.ProcessGroup, rank: int, size: int) -> torch.Tensor:
        ctx.dim, ctx.rank, ctx.size = dim, rank, size
        moved = t.movedim(dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] * size, *moved.shape[1:]))
        _compat.all_gather_into(out, moved, group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # no plan lookup: backward usually runs after the shard context has ended
        c = grad.shape[ctx.dim] // ctx.size
        return grad.narrow(ctx.dim, ctx.rank * c, c).contiguous(), None, None, None, None


def gather(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Gather this rank's per-token tensor into the whole sequence, in original token order, without padding.

    ``t`` has this rank's tokens along ``dim`` (e.g. logits ``[B, c, V]``); the result has the global length
    ``T`` there, whatever the plan's layout. Autograd-aware: the backward returns the incoming gradient of this
    rank's tokens, which is
    right when every rank computes the same function of the gathered tensor. Call inside the
    :func:`shard` context of the batch.
    """
    current = active_context("cpcompile.gather")
    plan = current.plan
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"cpcompile.gather expects a tensor, got {type(t).__name__}")
    dim = dim % t.dim()
    if t.shape[dim] != plan.chunk_len:
        raise ValueError(
            f"cpcompile.gather: tensor has {t.shape[dim]} elements along dim {dim}, expected this rank's chunk "
            f"length {plan.chunk_len} (global length {plan.seq_len}, CP size {plan.cp_size}); pass the per-token "
            "output of the model called with this shard context's `local` batch and the right `dim`"
        )
    full = t if plan.cp_size == 1 else _GatherSeq.apply(t, dim, current.group, plan.cp_rank, plan.cp_size)
    return plan.restore_order(full, dim)


# -- collective counts ------------------------------------------------------------------------------------
@dataclasses.dataclass
class CommStats:
    """Collectives the CP attention issued on this rank for one batch (one ``shard`` context), and control rounds;
    apart, the all-gathers of the ops that mix tokens outside attention (:mod:`cpcompile.passes.mixing`).

    Forward all-gathers are counted as they run; every gathered K/V that needs a gradient adds one
    reduce-scatter of the same size in backward.
    """

    #: Number of all-gather calls (one for K, one for V per attention call).
    all_gathers: int = 0
    #: Bytes this rank received from the other ranks in those all-gathers: (N-1) chunks each.
    all_gather_bytes: int = 0
    #: Number of backward reduce-scatters (one per gathered tensor that requires grad).
    reduce_scatters: int = 0
    #: Bytes this rank sends in those reduce-scatters: (N-1) chunks each.
    reduce_scatter_bytes: int = 0
    #: Number of halo exchanges of sliding-window sites (one for K, one for V per attention call).
    halo_exchanges: int = 0
    #: Bytes this rank received in those exchanges (only the keys its queries see that other ranks hold).
    halo_bytes: int = 0
    #: Bytes this rank sends back in their backward (the gradients of the keys it received).
    halo_backward_bytes: int = 0
    #: Control rounds through the CP group's store (never a collective of the group; see
    #: :mod:`cpcompile.failsafe`): the first-call mask check of each attention site, and one per batch with
    #: ``shard(check_batch=True)``. None on later steps otherwise.
    control_rounds: int = 0
    #: Bytes this rank wrote to and read from the store for them (and, on a group's first step, the few bytes
    #: that let its peers check that its process is alive).
    control_bytes: int = 0
    #: All-gathers of the inputs of ops that mix tokens outside attention, run on the whole sequence (a causal
    #: conv1d, a token shift, a cumsum), and the bytes this rank received in them; each that needs a gradient
    #: adds a reduce-scatter of the same size in backward (``sequence_reduce_scatter_bytes``).
    sequence_gathers: int = 0
    sequence_gather_bytes: int = 0
    sequence_reduce_scatter_bytes: int = 0

    def record_sequence_gather(self, t: torch.Tensor, cp_size: int, needs_grad: bool) -> None:
        nbytes = (cp_size - 1) * t.numel() * t.element_size()
        self.sequence_gathers += 1
        self.sequence_gather_bytes += nbytes
        if needs_grad:
            self.sequence_reduce_scatter_bytes += nbytes

    def record_halo(self, nbytes: int, needs_grad: bool) -> None:
        self.halo_exchanges += 1
        self.halo_bytes += nbytes
        if needs_grad:
            self.halo_backward_bytes += nbytes

    def record_gather(self, t: torch.Tensor, cp_size: int, needs_grad: bool) -> None:
        nbytes = (cp_size - 1) * t.numel() * t.element_size()
        self.all_gathers += 1
        self.all_gather_bytes += nbytes
        if needs_grad:
            self.reduce_scatters += 1
            self.reduce_scatter_bytes += nbytes

    def record_control(self, nbytes: int, rounds: int = 1) -> None:
        self.control_rounds += rounds
        self.control_bytes += nbytes


def comm_stats() -> CommStats:
    """Collective counts and bytes of the active :func:`shard` context, or of the last one that ended."""
    active = _STATE.active
    if active is not None:
        return active.comm
    if _STATE.last_comm is None:
        raise RuntimeError("cpcompile.comm_stats(): no cpcompile.shard context has run in this thread yet")
    return _STATE.last_comm


def sync_grads(parameters, cp_group: dist.ProcessGroup) -> None:
    """Sum the gradients of ``parameters`` over ``cp_group`` (for models not wrapped in FSDP/DDP).

    Each CP rank's gradient is the partial sum over its own tokens; after this call every rank holds the
    gradient of the whole sequence. A parameter whose gradient is ``None`` on some ranks only (an MoE expert
    that only some ranks' tokens were routed to) contributes zeros there and gets the sum everywhere; one that
    has no gradient on any rank stays ``None``. Every rank must pass the same parameters in the same order
    (``ValueError`` on every rank otherwise). Two small all-reduces (the number of parameters, which gradients
    exist), then one flat all-reduce per dtype.
    """
    with failsafe.scope(cp_group, "cpcompile.sync_grads"):
        _sum_grads(list(parameters), cp_group)


def _sum_grads(params: list[torch.Tensor], cp_group: dist.ProcessGroup) -> None:
    if not params:
        return
    device = params[0].device
    n = len(params)
    # every rank passes as many parameters (a fixed-size all-reduce first), then which gradients exist anywhere
    count = torch.tensor([n, -n], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=cp_group)
    if int(count[0]) != n or int(count[1]) != -n:
        raise ValueError(
            f"cpcompile.sync_grads: the CP ranks passed different numbers of parameters (between "
            f"{-int(count[1])} and {int(count[0])}); pass the same model's parameters, in the same order, on "
            "every rank"
        )
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(present, op=dist.ReduceOp.MAX, group=cp_group)
    grads = []
    for p, anywhere in zip(params, present.tolist()):
        if not anywhere:
            continue
        if p.grad is None:  # another rank's tokens reached this parameter: this rank's part is zero
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group])
        dist.all_reduce(flat, group=cp_group)
        offset = 0
        for g in group:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
