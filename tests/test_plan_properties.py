"""Property-based tests of the CP plan against definitions written out by brute force.

For random lengths, document splits, CP sizes 1-8, batch sizes and windows: shard -> gather is the identity,
every real token lands on exactly one rank, every token's shifted label is the one the unsharded
transformers model uses, and the mask equals a mask built element by element from its definition.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpcompile.plan import IGNORE_INDEX, build_plan

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def batches(draw):
    """A packed batch (random documents per row), a CP size and a window."""
    cp_size = draw(st.integers(1, 8))
    B = draw(st.integers(1, 3))
    T = draw(st.integers(cp_size, 40))
    rows = []
    for _ in range(B):
        cuts = draw(st.lists(st.integers(1, max(T - 1, 1)), max_size=4, unique=True)) if T > 1 else []
        bounds = [0, *sorted(c for c in cuts if c < T), T]
        rows.append([b - a for a, b in zip(bounds, bounds[1:])])
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (B, T), generator=g)
    pos = torch.tensor([[p for n in row for p in range(n)] for row in rows])
    labels = torch.randint(0, 100, (B, T), generator=g)
    labels[torch.rand(B, T, generator=g) < 0.2] = IGNORE_INDEX
    window = draw(st.one_of(st.none(), st.integers(1, T + 2)))
    return {"input_ids": ids, "position_ids": pos, "labels": labels}, cp_size, window, rows


def plans(batch, cp_size):
    return [build_plan(batch, cp_size, r) for r in range(cp_size)]


@SETTINGS
@given(batches())
def test_shard_then_gather_is_identity(case):
    batch, N, _, _ = case
    ps = plans(batch, N)
    for key, pad in (("input_ids", 0), ("labels", IGNORE_INDEX)):
        x = batch[key]
        chunks = [p.local(p.pad(x, pad)) for p in ps]
        assert all(c.shape[1] == ps[0].chunk_len for c in chunks)
        assert torch.equal(ps[0].unpad(torch.cat(chunks, dim=1)), x)
    assert torch.equal(ps[0].unpad(ps[0].position_ids), batch["position_ids"])


@SETTINGS
@given(batches())
def test_every_real_token_on_exactly_one_rank(case):
    batch, N, _, _ = case
    B, T = batch["input_ids"].shape
    ps = plans(batch, N)
    index = torch.arange(T).expand(B, T)
    held = torch.cat([p.local(p.pad(index, -1)) for p in ps], dim=1)
    for b in range(B):
        real = [int(i) for i in held[b] if i >= 0]
        assert sorted(real) == list(range(T))  # each real token exactly once
    assert int((held < 0).sum()) == B * (ps[0].padded_len - T)  # the rest is padding


def transformers_shift(labels: torch.Tensor) -> torch.Tensor:
    """How transformers' ``ForCausalLMLoss`` shifts labels: pad one ignore label at the end, drop the first."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


@SETTINGS
@given(batches())
def test_shifted_labels_match_the_unsharded_model(case):
    batch, N, _, _ = case
    labels = batch["labels"]
    B, T = labels.shape
    ps = plans(batch, N)
    expected = transformers_shift(labels)
    for r, p in enumerate(ps):
        local = p.local(p.labels_shifted(labels))
        for i in range(p.chunk_len):
            t = r * p.chunk_len + i
            want = expected[:, t] if t < T else torch.full((B,), IGNORE_INDEX)
            assert torch.equal(local[:, i], want), (r, i, t)


def reference_mask(rows, T_pad, window, documents, rank, c):
    """Element by element: query ``q`` sees key ``k`` iff k <= q, same document (padding is one more
    document), and k > q - window."""
    B = len(rows)
    out = torch.zeros(B, 1, c, T_pad, dtype=torch.bool)
    for b, row in enumerate(rows):
        doc = [d for d, n in enumerate(row) for _ in range(n)]
        doc += [len(row)] * (T_pad - len(doc))  # padding tokens: their own document
        for i in range(c):
            q = rank * c + i
            for k in range(T_pad):
                ok = k <= q
                if documents:
                    ok = ok and doc[k] == doc[q]
                if window is not None:
                    ok = ok and k > q - window
                out[b, 0, i, k] = ok
    return out


@SETTINGS
@given(batches(), st.booleans())
def test_mask_equals_brute_force_definition(case, documents):
    batch, N, window, rows = case
    ps = plans(batch, N)
    for r, p in enumerate(ps):
        got = p.mask(documents=documents, window=window)
        assert got.shape == (len(rows), 1, p.chunk_len, p.padded_len)
        assert torch.equal(got, reference_mask(rows, p.padded_len, window, documents, r, p.chunk_len)), r
