"""``shard``: slice a global batch for this CP rank and activate its plan for the compiled model.

:func:`shard` checks the CP group and the options (:mod:`cpcompile.runtime.shard_options`), decides the batch
together with the other CP ranks (:mod:`cpcompile.runtime.batch_check`), builds the plan
(:func:`cpcompile.plan.build_plan`), slices every per-token tensor (:func:`_local_batch`) and activates the plan
for the ``with`` block (:mod:`cpcompile.runtime.context`). Errors in the block reach the other CP ranks through
:mod:`cpcompile.failsafe`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from cpcompile import _compat, failsafe
from cpcompile.layouts import DEFAULT_LAYOUT, Workload
from cpcompile.plan import IGNORE_INDEX, CPPlan, build_plan
from cpcompile.runtime.batch_check import checked_plan, unchecked_round
from cpcompile.runtime.block_masks import check_block_masks, is_block_masks, local_block_masks
from cpcompile.runtime.comm import CommStats
from cpcompile.runtime.context import Active, activated, check_token_mixing, ensure_inactive, record_exact
from cpcompile.runtime.shard_options import OWN_PADDING, ShardOptions, default_pad_value, validate_options

__all__ = ["check_group", "mark_local_dynamic", "shard"]


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
    recurrence: str = "heads",
) -> Iterator[dict[str, object]]:
    """Slice the FULL global ``batch`` for this CP rank and activate its plan for the compiled model.

    Args:
        batch: dict of ``[B, T, ...]`` tensors, identical on every rank of ``cp_group``. ``input_ids`` is
            required; ``position_ids`` (default ``arange(T)`` per row; packed documents restart at 0) and
            ``labels`` (unshifted, ``-100`` ignored) are optional; any other ``[B, T, ...]`` tensor is sliced
            the same way and anything that is not a tensor is passed through, but for flex_attention
            ``BlockMask`` values (or dicts of them) built for the whole global batch, as torchtitan's trainer
            builds its masks: each is checked and handed to the model as a BlockMask of the same ``mask_mod``
            that the compiled flex sites evaluate at global indices (:mod:`cpcompile.runtime.block_masks`).
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
            recompile (but for a model with a state-passing core under ``recurrence="state"``, once per new largest
            number of runs per rank).
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
        recurrence: how the gated delta rule (transformers' ``torch_chunk_gated_delta_rule``: Qwen3-Next,
            Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid), Mamba2's SSD (``mamba2_chunk_scan``: Mamba2, Bamba, Granite-4
            hybrid, Falcon-H1, Nemotron-H, Zamba2) and RecurrentGemma's RG-LRU run under CP
            (:mod:`cpcompile.cores`): ``"heads"`` (default: head-parallel, an all-to-all gives each rank the whole
            sequence for its heads, bytes growing with ``T``) or ``"state"`` (state passing: each rank runs the
            core on its own tokens and the ranks all-gather one fixed-size state summary per run, whatever ``T``;
            the core then runs once per run of the rank's tokens with ``dv + dk`` value columns, the SSD with
            ``P + N`` channels per head, the RG-LRU with twice its channels, so it costs more compute and memory
            than ``"heads"`` and moves fewer bytes). The other recurrent cores (the selective scan, WKV, the
            lightning-attention layer) run as they do with ``"heads"`` whatever it says: state passing is not
            implemented for them. Compiled graphs are guarded on it (and,
            with ``"state"``, on the plan's largest number of runs per rank: one compile per number of runs).

    With ``dynamic`` (the default) the sequence dim of every local per-token tensor is marked dynamic, so
    packed batches of changing length compile once with a symbolic length instead of once per length.

    Yields:
        ``local``: this rank's tokens of every per-token tensor (in ascending global order), their global
        ``position_ids``, and with labels ``labels`` (this rank's tokens), ``shift_labels`` (shifted over the
        whole row before the tokens are distributed) and
        ``num_items_in_batch``, so that the per-rank losses add up to the global mean.

    The loss contract: the loss each CP rank computes is its share, and the shares summed over the CP ranks are
    the one-process loss (their gradients, summed by :func:`sync_grads` or FSDP2, its gradients). transformers'
    loss gets there through ``num_items_in_batch``; a mean ``cross_entropy``/``nll_loss`` over tokens the model
    computes itself (nanoGPT's ``F.cross_entropy(..., ignore_index=-1)``) is made this rank's share by the
    compiled graph (:mod:`cpcompile.passes.mixing`, ``mean_share``): the model returns its tokens' loss summed,
    divided by the count of targets that are not ``ignore_index`` on every rank (padding tokens ignored).
    A sequence classifier's loss over pooled rows (last-token pooling, ``pooled``) is whole on every rank instead,
    as the pooled logits are: its gradients, summed over the CP ranks, are the one-process gradients; do not add
    its values over the CP ranks.

    An error in the batch validation or in the ``with`` block is reported to the other CP ranks, and a rank
    that another rank's failure leaves waiting raises :class:`~cpcompile.failsafe.RankFailedError` naming it
    (:mod:`cpcompile.failsafe`); once that happened on ``cp_group``, ``shard`` raises it again at once.
    """
    cp_size, cp_rank, group_name = check_group(cp_group)
    if dp_group is not None:
        check_group(dp_group, "dp_group")
    ensure_inactive()
    if not isinstance(check_batch, bool):
        raise TypeError(f"check_batch must be True or False, got {check_batch!r}")
    options = ShardOptions(
        layout=layout,
        workload=workload,
        num_items_in_batch=num_items_in_batch,
        dp_group=dp_group,
        pad_token_id=pad_token_id,
        hf_kwargs=hf_kwargs,
        dynamic=dynamic,
        pad_values=pad_values,
        recurrence=recurrence,
    )
    comm = CommStats()
    failsafe.enter_step(cp_group, comm)
    with failsafe.scope(cp_group, "the batch validation of cpcompile.shard", in_step=True):
        if check_batch and cp_size > 1:
            plan, workload, pads = checked_plan(batch, cp_group, cp_rank, group_name, comm, options)
        else:
            workload, pads = validate_options(batch, group_name, options)
            plan = build_plan(batch, cp_size, cp_rank, layout=layout, workload=workload, group_name=group_name)
            check_block_masks(batch, plan.batch_size, plan.seq_len)
            if cp_size > 1:
                unchecked_round(cp_group, group_name, layout, workload, comm)
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
    context = Active(plan, cp_group, comm, recurrence=recurrence)
    record_exact([v for v in local.values() if isinstance(v, torch.Tensor)], context)
    with activated(context) as context:
        try:
            yield local
            if cp_size > 1:
                check_token_mixing(context, group_name)
        except BaseException as e:
            where = "the `with cpcompile.shard(...)` block"
            explained = _padding_error(e, batch, plan, pads)
            if explained is not None:
                failsafe.on_failure(cp_group, explained, where=where, in_step=True)
                raise explained from e
            failsafe.on_failure(cp_group, e, where=where, in_step=True)
            raise


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
        if is_block_masks(value) and plan.cp_size > 1:
            local[key] = local_block_masks(value)
        elif not isinstance(value, torch.Tensor):
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
        and k not in OWN_PADDING
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
