"""Workers of tests/test_safe_defaults.py: CP ranks that disagree (batches, options, paths through the step).

Every scenario records what each rank raised and how long it took (:func:`tests.harness.workers._outcome`); the
parent asserts that every rank raised the named error within seconds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.harness.workers import _outcome, _step

#: Short waits: a rank blocked by a live peer raises after PEER_TIMEOUT_S.
PEER_TIMEOUT_S = 3.0
GRACE_S = 1.0
#: T = 16 at CP=2: chunks of 8.
DOCS = [[10, 6], [16]]


def _group(world_size: int, peer_timeout_s: float = 120.0):
    """A fresh CP group whose ranks wait ``peer_timeout_s`` for each other: long enough for a first compile that
    takes longer on one rank; :func:`_short` afterwards."""
    import cpcompile

    group = dist.new_group(list(range(world_size)))
    options = cpcompile.failsafe.FailsafeOptions(peer_timeout_s=peer_timeout_s, report_grace_s=GRACE_S)
    cpcompile.failsafe.configure(group, options)
    return group


def _short(group) -> None:
    import cpcompile

    options = cpcompile.failsafe.FailsafeOptions(peer_timeout_s=PEER_TIMEOUT_S, report_grace_s=GRACE_S)
    cpcompile.failsafe.configure(group, options)


def _compiled(model, group):
    import cpcompile

    torch._dynamo.reset()
    return torch.compile(model, backend=cpcompile.backend(group, inner="eager"))


class MaskAttention(nn.Module):
    """Attention under a bool mask the test chooses (see :class:`MaskLM`)."""

    def __init__(self, mask: str, hidden: int, heads: int = 2) -> None:
        super().__init__()
        self.mask, self.heads = mask, heads
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, position_ids, prefix=None):
        from tests.models.tiny import doc_ids

        # the branch is decided first, so that the graph after the break computes q, k and v itself
        docs = self.mask == "branch" and bool((torch.diff(position_ids, dim=-1) != 1).any())
        B, T, H = x.shape
        q, k, v = (lin(x).view(B, T, self.heads, H // self.heads).transpose(1, 2) for lin in (self.q, self.k, self.v))
        idx = torch.arange(T, device=x.device)
        causal = idx[None, :] <= idx[:, None]
        if self.mask == "causal":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal.expand(B, 1, T, T))
        elif self.mask == "segments":  # documents as the caller's per-token segment ids say, not as the batch's
            same = prefix[:, :, None] == prefix[:, None, :]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=(same & causal)[:, None])
        elif self.mask == "prefix":
            both = prefix[:, :, None] & prefix[:, None, :]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=(causal | both)[:, None])
        elif docs:
            doc = doc_ids(position_ids)
            mask = (doc[:, :, None] == doc[:, None, :]) & causal
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(B, T, H)


class MaskLM(nn.Module):
    """One attention layer (``attn``) whose bool mask the test chooses.

    ``mask``: ``"causal"`` (causal, across packed documents), ``"segments"`` (causal within the segments that the
    per-token input ``prefix`` numbers: a same-document mask whose ids the caller may get wrong), ``"prefix"``
    (causal, plus bidirectional inside the prefix marked by the per-token input ``prefix``), ``"branch"`` (the
    document mask only when the local positions hold a document boundary, else ``is_causal``: a data-dependent
    branch).
    """

    def __init__(self, mask: str, vocab: int = 128, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.attn = MaskAttention(mask, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, position_ids, labels=None, shift_labels=None, num_items_in_batch=None, **kw):
        from tests.models.tiny import lm_output

        x = self.embed(input_ids)
        logits = self.head(x + self.attn(x, position_ids, kw.get("prefix")))
        return lm_output(logits, labels, shift_labels, num_items_in_batch)


@torch.compiler.disable
def _hidden_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class HiddenAttentionLM(nn.Module):
    """Causal attention inside a ``@torch.compiler.disable`` function: Dynamo never shows it to the backend."""

    def __init__(self, vocab: int = 128, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, position_ids, labels=None, shift_labels=None, num_items_in_batch=None, **kw):
        from tests.models.tiny import lm_output

        x = self.embed(input_ids)
        B, T, H = x.shape
        q, k, v = (t.view(B, T, 2, H // 2).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        out = _hidden_sdpa(q, k, v).transpose(1, 2).reshape(B, T, H)
        return lm_output(self.head(x + out), labels, shift_labels, num_items_in_batch)


def _model_step(cm, batch, group, *, backward=True, **kw) -> float:
    import cpcompile

    with cpcompile.shard(batch, group, **kw) as local:
        loss = cm(**local).loss
        if backward:
            loss.backward()
    return float(loss.detach())


def disagree_worker(rank: int, world_size: int) -> dict:
    """Ranks given different batches or options, and ranks that take different paths; ``{case: outcome}``."""
    import cpcompile
    from cpcompile import _compat
    from cpcompile.testing import packed_batch
    from tests.harness.workers import _fail_model

    batch = packed_batch(DOCS, seed=0)
    out: dict = {}

    def mine(other: dict) -> dict:
        return other if rank == world_size - 1 else batch

    def enter(b, group, **kw):
        with cpcompile.shard(b, group, **kw):
            pass

    # 1. different batches on the last rank, caught by the default check in shard (one group, stays usable)
    group = _group(world_size)
    cm = _fail_model(group)
    out["warm"] = _outcome(lambda: _step(cm, batch, group))
    _short(group)
    ids = batch["input_ids"].clone()
    ids[1, 3] += 1
    other_docs = packed_batch([[8, 8], [16]], seed=0)
    longer = packed_batch([[10, 10], [20]], seed=0)
    more_rows = packed_batch([[10, 6], [16], [16]], seed=0)
    cases = {
        "ids": (dict(batch, input_ids=ids), {}),
        "docs": (dict(batch, position_ids=other_docs["position_ids"]), {}),
        "labels": (dict(batch, labels=batch["labels"].roll(1, dims=1)), {}),
        "T": (longer, {}),
        "B": (more_rows, {}),
        "layout": (batch, {"layout": "contiguous"}),
        "pad_token_id": (batch, {"pad_token_id": 3}),
    }
    for name, (other, kw) in cases.items():
        out[name] = _outcome(lambda: enter(mine(other), group, **(kw if rank == world_size - 1 else {})))
    # a shape that changes on one rank at a later step: refused in shard, before the model recompiles or any
    # collective runs; the next good step runs
    out["T_model"] = _outcome(lambda: _step(cm, mine(longer), group))
    out["after"] = _outcome(lambda: _step(cm, batch, group))
    # the opt-out: different batches pass unchecked (nothing compared)
    out["opt_out"] = _outcome(lambda: enter(mine(dict(batch, input_ids=ids)), group, check_batch=False))

    # 2. the check on some ranks only: the ranks that hold the round see at once that the last rank skipped it
    group = _group(world_size)
    cm = _fail_model(group)
    _step(cm, batch, group, layout="contiguous")
    _short(group)
    last = rank == world_size - 1
    out["check_one_rank"] = _outcome(lambda: _step(cm, batch, group, layout="contiguous", check_batch=not last))
    out["check_one_rank_next"] = _outcome(lambda: _step(cm, batch, group))

    # 3. the last rank skips backward() (a local NaN check) and starts the next step; its peers are in backward
    group = _group(world_size)
    cm = _fail_model(group)
    _step(cm, batch, group)
    _short(group)

    def skip_backward():
        _model_step(cm, batch, group, backward=not last)
        _model_step(cm, batch, group)

    out["skipped_backward"] = _outcome(skip_backward)

    # 4. the last rank raises inside the shard block, catches the error and goes on with the next step
    group = _group(world_size)
    cm = _fail_model(group)
    _step(cm, batch, group)
    _short(group)

    def caught():
        try:
            with cpcompile.shard(batch, group) as local:
                if last:
                    raise KeyError("the last rank's own code failed inside the shard block")
                cm(**local).loss.backward()
        except KeyError:
            pass  # the user catches it and goes on with the next step
        _step(cm, batch, group)

    out["caught_in_block"] = _outcome(caught)
    out["caught_in_block_next"] = _outcome(lambda: _step(cm, batch, group))

    # 5. a data-dependent branch in the model's mask code: the rank whose chunk holds a document boundary would
    #    take the document mask, the others is_causal; its predicate mixes the sequence and is refused
    group = _group(world_size)  # a rank that compiles the other branch keeps its peers waiting for the compile
    cm = _compiled(MaskLM("branch"), group)
    one_doc = packed_batch([[16], [16]], seed=1)
    out["branch_same"] = _outcome(lambda: _model_step(cm, one_doc, group, layout="contiguous"))
    split = packed_batch([[4, 12], [16]], seed=1)  # boundary in rank 0's chunk only
    out["branch"] = _outcome(lambda: _model_step(cm, split, group, layout="contiguous"))

    # 6. masks checked on every new batch: a same-document mask whose segment ids ignore the batch's documents
    #    (all zero) passes a one-document batch, then is refused on the packed one; a prefix-LM mask whose prefix
    #    is an input, refused when the prefix appears
    group = _group(world_size)
    cm = _compiled(MaskLM("segments"), group)
    one_segment = dict(one_doc, prefix=torch.zeros(2, 16, dtype=torch.long))
    out["mask_causal_first"] = _outcome(lambda: _model_step(cm, one_segment, group))
    _short(group)
    stale = dict(batch, prefix=torch.zeros_like(batch["input_ids"]))
    out["mask_causal_packed"] = _outcome(lambda: _model_step(cm, stale, group))
    out["pending_after_mismatch"] = _compat.pending_collectives()  # the check ran before the K/V exchange
    group = _group(world_size)
    cm = _compiled(MaskLM("prefix"), group)
    no_prefix = dict(one_doc, prefix=torch.zeros(2, 16, dtype=torch.bool))
    prefix = torch.zeros(2, 16, dtype=torch.bool)
    prefix[:, :6] = True
    out["mask_prefix_first"] = _outcome(lambda: _model_step(cm, no_prefix, group, layout="contiguous"))
    _short(group)
    out["mask_prefix_second"] = _outcome(
        lambda: _model_step(cm, dict(one_doc, prefix=prefix), group, layout="contiguous")
    )

    # 7. attention hidden from Dynamo: the step runs compiled graphs but no rewritten attention: an error on every
    #    rank, every step; next to a compiled model in the same step too (the check is per backend); a model
    #    without token mixing is accepted when declared
    group = _group(world_size)
    cm = _compiled(HiddenAttentionLM(), group)
    out["hidden"] = [_outcome(lambda: _model_step(cm, one_doc, group)) for _ in range(2)]
    seen = _compiled(MaskLM("segments"), group)
    hidden = torch.compile(HiddenAttentionLM(), backend=cpcompile.backend(group, inner="eager"))

    def both():
        with cpcompile.shard(one_segment, group) as local:
            (seen(**local).loss + hidden(**local).loss).backward()

    out["hidden_next_to_compiled"] = _outcome(both)
    out["compiled_alone"] = _outcome(lambda: _model_step(seen, one_segment, group))
    from tests.models.attention import mlp_lm

    declared = torch.compile(mlp_lm(), backend=cpcompile.backend(group, inner="eager", token_mixing="none"))
    out["declared_without_mixing"] = _outcome(lambda: _model_step(declared, one_doc, group))
    undeclared = torch.compile(mlp_lm(), backend=cpcompile.backend(group, inner="eager"))
    out["undeclared_without_mixing"] = _outcome(lambda: _model_step(undeclared, one_doc, group))
    return out


def misuse_worker(rank: int, world_size: int) -> dict:
    """Every bad input of the misuse table on one CP group of ``world_size``; ``{case: (type, message)}``.

    Every rank passes the same bad input, except ``T_changes`` (the last rank's batch is longer).
    """
    import cpcompile
    from cpcompile.testing import packed_batch
    from tests.harness.workers import _error_of
    from tests.models.attention import attention_lm

    group = _group(world_size)
    batch = packed_batch([[10, 7], [17]], seed=0)  # T = 17: padded at CP = 2 and 3
    ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    last = rank == world_size - 1

    def enter(b, **kw):
        def run():
            with cpcompile.shard(b, group, **kw):
                pass

        return run

    out = {}
    out["B0"] = _error_of(enter({"input_ids": ids[:0], "position_ids": pos[:0]}))
    out["T0"] = _error_of(enter({"input_ids": ids[:, :0]}))
    out["keys_T"] = _error_of(enter(dict(batch, labels=labels[:, :-2])))
    out["T_changes"] = _error_of(enter(packed_batch([[10, 9], [19]], seed=0) if last else batch))
    out["labels_float"] = _error_of(enter(dict(batch, labels=labels.float())))
    out["positions_jump"] = _error_of(enter(dict(batch, position_ids=torch.cat([pos[:, :12], pos[:, 12:] + 3], 1))))
    out["positions_continue"] = _error_of(enter(dict(batch, position_ids=pos + 5 * (pos == torch.arange(17)))))
    out["layout"] = _error_of(enter(batch, layout="zigzag"))
    out["pad_values_key"] = _error_of(enter(batch, pad_values={"segment_ids": 0}))

    # int32 labels: taken as int64 (the loss needs it), same loss as int64 labels
    model = _compiled(attention_lm("packed_docs"), group)

    def loss_of(b):
        with cpcompile.shard(b, group) as local:
            dtype = local["labels"].dtype, local["shift_labels"].dtype
            return float(model(**local).loss), dtype

    out["labels_int32"] = _error_of(lambda: loss_of(dict(batch, labels=labels.int())))
    out["labels_int32_loss"] = (loss_of(dict(batch, labels=labels.int())), loss_of(batch))
    _short(group)

    # the model called with a batch sliced for another CP size
    def other_size():
        with cpcompile.shard(batch, group) as local:
            c = local["input_ids"].shape[1]
            model(**{k: v[:, : c - 1] if isinstance(v, torch.Tensor) and v.dim() == 2 else v for k, v in local.items()})

    out["other_cp_size"] = _error_of(other_size)

    # torch.compile(dynamic=True) on a transformers model in eval mode (dropout 0.0): refused naming dynamic=True
    from cpcompile.testing import tiny_model

    torch._dynamo.reset()
    long_waits = cpcompile.failsafe.FailsafeOptions(peer_timeout_s=120, report_grace_s=GRACE_S)
    cpcompile.failsafe.configure(group, long_waits)  # a compile may take longer on one rank
    dyn = torch.compile(tiny_model("llama").eval(), backend=cpcompile.backend(group, inner="eager"), dynamic=True)

    def dynamic_true():
        with cpcompile.shard(batch, group) as local:
            dyn(**local)

    out["dynamic_true"] = _error_of(dynamic_true)
    _short(group)
    # an integer extra key used as an index (segment ids) padded with the default -100: the rank holding the
    # padding fails in the embedding; the others go on into a collective (gather) and learn it from the group
    segments = nn.Embedding(2, 4)

    def segment_ids(pad_values=None):
        b = dict(batch, segment_ids=(pos > 4).long())
        with cpcompile.shard(b, group, hf_kwargs=False, pad_values=pad_values) as local:
            cpcompile.gather(segments(local["segment_ids"]))

    out["segment_ids_fixed"] = _error_of(lambda: segment_ids({"segment_ids": 0}))
    out["segment_ids"] = _error_of(segment_ids)
    return out


def grads_worker(rank: int, world_size: int) -> dict:
    """Gradients that exist on different parameters of different ranks (two MoE experts of the same shape, each
    reached by one rank's tokens only): ``sync_grads`` and ``clip_grad_norm_``. Returns each rank's gradients
    before and after, for the parent to sum."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import cpcompile
    from tests.harness.workers import _error_of

    group = dist.new_group(list(range(world_size)))
    g = torch.Generator().manual_seed(rank)
    experts = [nn.Linear(4, 4, bias=False) for _ in range(2)]
    unused = nn.Linear(4, 4, bias=False)
    x = torch.randn(3, 4, generator=g)
    experts[rank % 2](x).square().sum().backward()  # rank 0 routes to expert 0, rank 1 to expert 1
    params = [e.weight for e in experts] + [unused.weight]
    out: dict = {"before": [None if p.grad is None else p.grad.clone() for p in params]}
    cpcompile.sync_grads(params, group)
    out["after"] = [None if p.grad is None else p.grad.clone() for p in params]
    out["count_mismatch"] = _error_of(lambda: cpcompile.sync_grads(params[: 2 + rank], group))

    # DTensor (FSDP2-style, sharded over the ranks) gradients: rank 1 holds none at all
    mesh = init_device_mesh("cpu", (world_size,))
    locals_ = [torch.randn(2, 4, generator=g) for _ in range(2)]
    sharded = [DTensor.from_local(torch.zeros(2, 4), mesh, [Shard(0)], run_check=False) for _ in range(2)]
    for p, local in zip(sharded, locals_):
        p.grad = DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=False) if rank == 0 else None
    out["dtensor_locals"] = locals_ if rank == 0 else []
    out["dtensor_norm"] = float(cpcompile.clip_grad_norm_(sharded, max_norm=1e9))
    return out
