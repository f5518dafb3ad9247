"""Unit tests of the per-batch plan (no processes): slicing, padding, label shift, gather round trip, masks.

Expected values come from brute-force references written from the definitions in the ``cpcompile.plan``
docstring (python loops over lists), never from the plan's own methods.
"""

from __future__ import annotations

import pytest
import torch

from cpcompile.plan import IGNORE_INDEX, build_plan, document_ids
from cpcompile.runtime.sharding import _local_batch
from cpcompile.testing import packed_batch
from tests.harness.tolerances import EXACT

# (doc lengths per row): T = 37 (prime), 8 (a multiple of 2 and 4), 5 with one-token documents; B = 2..3;
# every T >= the largest CP size
LAYOUTS = [
    [[10, 20, 7], [5, 30, 2]],
    [[3, 5], [8], [1, 1, 6]],
    [[1, 1, 1, 1, 1], [5]],
]
CP_SIZES = [1, 2, 3, 4]


# -- brute-force references from the plan docstring ------------------------------------------------------
#: cpcompile.shard's defaults, for calling its slicing step without a process group.
LOCAL_DEFAULTS = dict(num_items_in_batch=None, dp_group=None, pad_token_id=0, hf_kwargs=True)


def ref_padded_len(T: int, n: int) -> int:
    return next(p for p in range(T, T + n) if p % n == 0)


def ref_positions(pos_row: list[int], padded_len: int) -> list[int]:
    """Padding tokens restart at position 0 (a separate document)."""
    return pos_row + list(range(padded_len - len(pos_row)))


def ref_doc_ids(pos_row: list[int]) -> list[int]:
    """A new document starts wherever position_ids[t] - position_ids[t-1] != 1 (and at t = 0)."""
    docs, d = [], 0
    for t, p in enumerate(pos_row):
        if t > 0 and p - pos_row[t - 1] != 1:
            d += 1
        docs.append(d)
    return docs


def ref_mask(pos: list[list[int]], n: int, rank: int, *, documents: bool, window: int | None) -> torch.Tensor:
    """Query i (global index rank*c + local) sees key j iff j <= i, [same document], [j > i - window]."""
    T = len(pos[0])
    Tp = ref_padded_len(T, n)
    c = Tp // n
    out = []
    for row in pos:
        docs = ref_doc_ids(ref_positions(row, Tp))
        rows = []
        for li in range(c):
            i = rank * c + li
            rows.append(
                [
                    j <= i and (not documents or docs[i] == docs[j]) and (window is None or j > i - window)
                    for j in range(Tp)
                ]
            )
        out.append([rows])
    return torch.tensor(out, dtype=torch.bool)


def ref_shift(labels: list[int]) -> list[int]:
    """transformers' shift: position t is trained on labels[t + 1]; the last token has no label."""
    return labels[1:] + [IGNORE_INDEX]


# -- tests -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", CP_SIZES)
@pytest.mark.parametrize("docs", LAYOUTS)
def test_slicing_padding_and_round_trip(docs, n):
    batch = packed_batch(docs, seed=3)
    B, T = batch["input_ids"].shape
    plans = [build_plan(batch, n, r, layout="contiguous") for r in range(n)]
    Tp = ref_padded_len(T, n)
    for r, plan in enumerate(plans):
        assert (plan.seq_len, plan.padded_len, plan.chunk_len, plan.num_padding) == (T, Tp, Tp // n, Tp - T)
        assert plan.token_indices().tolist() == list(range(r * Tp // n, (r + 1) * Tp // n))
        expected_pos = [ref_positions(row, Tp) for row in batch["position_ids"].tolist()]
        assert plan.position_ids.tolist() == expected_pos
        assert plan.doc_ids.tolist() == [ref_doc_ids(row) for row in expected_pos]
    # pad with a value, cut into chunks, put back together: every token exactly once, in order
    x = torch.randn(B, T, 3)
    padded = plans[0].pad(x, 0.5)
    assert padded.shape == (B, Tp, 3)
    torch.testing.assert_close(padded[:, :T], x, **EXACT)
    assert bool((padded[:, T:] == 0.5).all())
    chunks = [p.local(padded) for p in plans]
    assert all(ch.is_contiguous() and ch.shape == (B, Tp // n, 3) for ch in chunks)
    torch.testing.assert_close(plans[0].unpad(torch.cat(chunks, dim=1)), x, **EXACT)
    # unpad along another dimension (gathered logits laid out [B, H, T, ...])
    torch.testing.assert_close(plans[0].unpad(padded.transpose(1, 2), dim=2), x.transpose(1, 2), **EXACT)


@pytest.mark.parametrize("n", CP_SIZES)
@pytest.mark.parametrize("docs", LAYOUTS)
def test_local_batch_and_label_shift(docs, n):
    batch = packed_batch(docs, seed=4)
    B, T = batch["input_ids"].shape
    batch["token_weight"] = torch.rand(B, T)
    batch["note"] = "passed through"
    Tp = ref_padded_len(T, n)
    locals_ = [_local_batch(batch, build_plan(batch, n, r, layout="contiguous"), **LOCAL_DEFAULTS) for r in range(n)]

    def cat(key):
        return torch.cat([loc[key] for loc in locals_], dim=1).tolist()

    labels = batch["labels"].tolist()
    shifted = [ref_shift(row) + [IGNORE_INDEX] * (Tp - T) for row in labels]
    assert cat("shift_labels") == shifted
    assert cat("labels") == [row + [IGNORE_INDEX] * (Tp - T) for row in labels]
    assert cat("input_ids") == [row + [0] * (Tp - T) for row in batch["input_ids"].tolist()]
    assert cat("position_ids") == [ref_positions(row, Tp) for row in batch["position_ids"].tolist()]
    assert cat("token_weight") == [row + [0.0] * (Tp - T) for row in batch["token_weight"].tolist()]
    supervised = sum(v != IGNORE_INDEX for row in shifted for v in row)
    for loc in locals_:
        assert int(loc["num_items_in_batch"]) == supervised  # the global count on every rank
        assert loc["use_cache"] is False and loc["note"] == "passed through"
        assert all(loc[k].is_contiguous() for k in ("input_ids", "labels", "shift_labels", "position_ids"))


def test_label_shift_at_chunk_boundary():
    """The token before a chunk boundary is trained on the first token of the next chunk (not ignored)."""
    batch = packed_batch([[12]], seed=0, mask_first_label=False)
    plan = build_plan(batch, 2, 0, layout="contiguous")
    local0 = _local_batch(batch, plan, **LOCAL_DEFAULTS)
    assert local0["shift_labels"][0, -1].item() == batch["labels"][0, 6].item()


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("documents", [True, False])
@pytest.mark.parametrize("n", CP_SIZES)
@pytest.mark.parametrize("docs", LAYOUTS)
def test_mask_matches_definition(docs, n, documents, window):
    batch = packed_batch(docs, seed=5)
    pos = batch["position_ids"].tolist()
    for r in range(n):
        plan = build_plan(batch, n, r, layout="contiguous")
        expected = ref_mask(pos, n, r, documents=documents, window=window)
        assert torch.equal(plan.mask(documents=documents, window=window), expected), f"rank {r}"
        # asking for another rank's rows gives that rank's mask
        other = (r + 1) % n
        assert torch.equal(
            plan.mask(documents=documents, window=window, rank=other),
            ref_mask(pos, n, other, documents=documents, window=window),
        )


def test_mask_cache_is_per_form_and_rank():
    plan = build_plan(packed_batch([[10, 20, 7], [5, 30, 2]]), 2, 1, layout="contiguous")
    m = plan.mask(documents=True)
    assert plan.mask(documents=True) is m
    assert plan.mask(documents=False) is not m
    assert not torch.equal(plan.mask(documents=True, rank=0), m)


def test_padding_is_its_own_document():
    # the last document ends at position 2; padding restarts at 0, so it never joins that document
    batch = packed_batch([[4, 3]], seed=0)
    plan = build_plan(batch, 4, 3, layout="contiguous")  # T = 7 -> padded 8: rank 3 holds 6 (real) and 7 (padding)
    m = plan.mask(documents=True)[0, 0]
    assert m[1].tolist() == [False] * 7 + [True]  # the padding token sees only itself
    assert not bool(m[0, 7])  # the real token does not see the padding


def test_document_ids_definition():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 5, 6], [3, 4, 5, 6, 0, 2, 3, 4, 1]])
    assert document_ids(pos).tolist() == [ref_doc_ids(row) for row in pos.tolist()]


@pytest.mark.parametrize(
    "batch, n, rank, error, words",
    [
        ({"input_ids": torch.zeros(2, 8, dtype=torch.long)}, 0, 0, ValueError, "cp_size"),
        ({"input_ids": torch.zeros(2, 8, dtype=torch.long)}, 2, 2, ValueError, "cp_rank"),
        ({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, 4, 0, ValueError, "shorter than the CP size"),
        ({"input_ids": torch.zeros(2, 8)}, 2, 0, TypeError, "integer token ids"),
        ({"input_ids": torch.zeros(8, dtype=torch.long)}, 2, 0, ValueError, "[B, T]"),
        ({"tokens": torch.zeros(2, 8, dtype=torch.long)}, 2, 0, ValueError, "no 'input_ids'"),
        ([torch.zeros(2, 8, dtype=torch.long)], 2, 0, TypeError, "dict"),
        (
            {"input_ids": torch.zeros(2, 8, dtype=torch.long), "position_ids": torch.zeros(2, 7, dtype=torch.long)},
            2,
            0,
            ValueError,
            "position_ids",
        ),
        (
            {"input_ids": torch.zeros(2, 8, dtype=torch.long), "position_ids": -torch.ones(2, 8, dtype=torch.long)},
            2,
            0,
            ValueError,
            "negative",
        ),
        (
            {"input_ids": torch.zeros(2, 8, dtype=torch.long), "position_ids": torch.zeros(2, 8)},
            2,
            0,
            TypeError,
            "integer",
        ),
        (
            {"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8)},
            2,
            0,
            TypeError,
            "labels",
        ),
    ],
)
def test_build_plan_rejects(batch, n, rank, error, words):
    with pytest.raises(error) as info:
        build_plan(batch, n, rank, layout="contiguous")
    assert words in str(info.value)


@pytest.mark.parametrize("layout", ["contiguous", "balanced", "head_tail"])
@pytest.mark.parametrize("docs", LAYOUTS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_region_halo_reads_the_tokens_before_each_run(docs, n, layout):
    """A causal region's layout (``CPPlan.region_halo``): every token of a rank, at ``keep``, has the ``h`` global
    tokens before it right before it (zeros before token 0), whichever rank holds them: the rank's own tokens, the
    halo slots its routing receives (a window of ``h + 1`` without documents), or the zero after them. Halos of 1 to
    5 tokens, runs of one token included (T = 5 and 8 at CP 3 and 4)."""
    batch = packed_batch(docs)
    for h in (1, 2, 5):
        for rank in range(n):
            plan = build_plan(batch, n, rank, layout=layout)
            slots = 4 * h
            order, keep = plan.region_halo(h, slots)
            recv = plan.halo_routing(h + 1, slots, documents=False).recv_pos.tolist()
            mine = plan.token_indices().tolist()
            value = [g + 1.0 for g in range(plan.padded_len)]  # token g holds g + 1; zero is no token
            buffer = [value[g] for g in mine] + [value[g] if g >= 0 else 0.0 for g in recv] + [0.0]
            laid_out = [buffer[i] for i in order.tolist()]
            assert len(laid_out) == len(mine) + slots
            for i, g in enumerate(mine):
                p = int(keep[i])
                want = [value[j] if j >= 0 else 0.0 for j in range(g - h, g + 1)]
                assert laid_out[p - h : p + 1] == want, (rank, g, h)
