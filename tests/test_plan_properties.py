"""Property-based tests of the CP plan, for every layout, against definitions written out by brute force.

For random lengths, document splits, CP sizes 1-8, batch sizes, windows and block sizes, in every layout of
``cpcompile.plan.LAYOUTS``: every token is held by exactly one rank and every rank holds the same number of
tokens (the minimal padding), shard -> gather is the identity, every token's shifted label is the one the
unsharded transformers model uses, the mask equals a mask built element by element from its definition, and
no rank holds more than ``MAX_RUNS`` runs of consecutive indices. For the balanced layout the computed
attention work per rank is within the bound its construction guarantees (see
``test_balanced_work_is_within_its_bound``).
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpcompile import layouts
from cpcompile.layouts import balance, token_work
from cpcompile.plan import IGNORE_INDEX, LAYOUTS, MAX_RUNS, AttentionForm, Workload, build_plan, count_runs

SETTINGS = settings(max_examples=60, deadline=None)
ALL_LAYOUTS = st.sampled_from(sorted(LAYOUTS))


@st.composite
def batches(draw):
    """A packed batch (random documents per row), a CP size, a window and a workload for the balanced layout."""
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
    # small blocks, so that the balanced layout has work to even out at these lengths
    form = st.builds(AttentionForm, st.booleans(), st.sampled_from([None, 2, 5]), st.integers(1, 3))
    forms = draw(st.lists(form, min_size=1, max_size=2))
    workload = Workload(forms=tuple(forms), block_size=draw(st.integers(1, 6)))
    return {"input_ids": ids, "position_ids": pos, "labels": labels}, cp_size, window, rows, workload


def plans(batch, cp_size, layout, workload):
    """Every rank's plan (rank 0's, with ``cp_rank`` changed: every rank builds the same layout, tested below)."""
    first = build_plan(batch, cp_size, 0, layout=layout, workload=workload)
    return [dataclasses.replace(first, cp_rank=r) for r in range(cp_size)]


@SETTINGS
@given(batches(), ALL_LAYOUTS)
def test_every_token_once_equal_counts_few_runs(case, layout):
    batch, N, _, _, workload = case
    B, T = batch["input_ids"].shape
    ps = [build_plan(batch, N, r, layout=layout, workload=workload) for r in range(N)]
    T_pad = -(-T // N) * N  # the least padding that gives every rank the same count
    for p in ps:
        assert torch.equal(p.indices, ps[0].indices)  # every rank computes the same layout
        assert p.indices.shape == (N, T_pad // N) and p.padded_len == T_pad
    held = sorted(ps[0].indices.flatten().tolist())
    assert held == list(range(T_pad))  # every token (real or padding) on exactly one rank
    for r in range(N):
        mine = ps[0].indices[r].tolist()
        assert mine == sorted(mine)  # ascending
        runs = 1 + sum(b != a + 1 for a, b in zip(mine, mine[1:]))
        assert runs <= MAX_RUNS and runs == int(count_runs(ps[0].indices)[r])
        assert runs <= {"contiguous": 1, "head_tail": 2}.get(layout, MAX_RUNS), (layout, mine)
    # every real token on exactly one rank, seen through the slicing the shim does
    index = torch.arange(T).expand(B, T)
    local = torch.cat([p.local(p.pad(index, -1)) for p in ps], dim=1)
    for b in range(B):
        assert sorted(int(i) for i in local[b] if i >= 0) == list(range(T))
    assert int((local < 0).sum()) == B * (T_pad - T)


@SETTINGS
@given(batches(), ALL_LAYOUTS)
def test_shard_then_gather_is_identity(case, layout):
    batch, N, _, _, workload = case
    ps = plans(batch, N, layout, workload)
    for key, pad in (("input_ids", 0), ("labels", IGNORE_INDEX)):
        x = batch[key]
        chunks = [p.local(p.pad(x, pad)) for p in ps]
        assert all(c.shape[1] == ps[0].chunk_len for c in chunks)
        assert torch.equal(ps[0].restore_order(torch.cat(chunks, dim=1)), x)  # what gather does
    assert torch.equal(ps[0].unpad(ps[0].position_ids), batch["position_ids"])


def transformers_shift(labels: torch.Tensor) -> torch.Tensor:
    """How transformers' ``ForCausalLMLoss`` shifts labels: pad one ignore label at the end, drop the first."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


@SETTINGS
@given(batches(), ALL_LAYOUTS)
def test_shifted_labels_match_the_unsharded_model(case, layout):
    batch, N, _, _, workload = case
    labels = batch["labels"]
    B, T = labels.shape
    ps = plans(batch, N, layout, workload)
    expected = transformers_shift(labels)
    for r, p in enumerate(ps):
        local = p.local(p.labels_shifted(labels))
        for i, t in enumerate(p.token_indices().tolist()):
            want = expected[:, t] if t < T else torch.full((B,), IGNORE_INDEX)
            assert torch.equal(local[:, i], want), (r, i, t)


def reference_mask(rows, T_pad, window, documents, queries):
    """Element by element: query ``q`` sees key ``k`` iff k <= q, same document (padding is one more
    document), and k > q - window."""
    B = len(rows)
    out = torch.zeros(B, 1, len(queries), T_pad, dtype=torch.bool)
    for b, row in enumerate(rows):
        doc = [d for d, n in enumerate(row) for _ in range(n)]
        doc += [len(row)] * (T_pad - len(doc))  # padding tokens: their own document
        for i, q in enumerate(queries):
            for k in range(T_pad):
                ok = k <= q
                if documents:
                    ok = ok and doc[k] == doc[q]
                if window is not None:
                    ok = ok and k > q - window
                out[b, 0, i, k] = ok
    return out


@SETTINGS
@given(batches(), st.booleans(), ALL_LAYOUTS)
def test_mask_equals_brute_force_definition(case, documents, layout):
    batch, N, window, rows, workload = case
    ps = plans(batch, N, layout, workload)
    for r, p in enumerate(ps):
        got = p.mask(documents=documents, window=window)
        assert got.shape == (len(rows), 1, p.chunk_len, p.padded_len)
        queries = p.token_indices().tolist()
        assert torch.equal(got, reference_mask(rows, p.padded_len, window, documents, queries)), r


def _work(plan, workload, rank):
    """Computed (query, key) pairs of ``rank``'s block kernel, per attention form."""
    bs = workload.block_size
    return [
        plan.visible_blocks(bs, bs, documents=f.documents, window=f.window, rank=rank).computed_pairs()
        for f in workload.forms
    ]


def _model(plan, f, bs):
    return token_work(plan.doc_ids if f.documents else torch.zeros_like(plan.doc_ids), bs, bs, f.window)


@SETTINGS
@given(batches())
def test_balanced_work_is_within_its_bound(case):
    """The balanced layout's guarantees, in the kernel's own measure (``CPPlan.visible_blocks``):

    1. every rank computes at most the work :func:`token_work` gives its tokens (the model it balances);
    2. its objective (sum over forms of layers x slowest rank) is at most the contiguous layout's and within
       0.5% of the head_tail layout's;
    3. with one attention form, when the level bands of the work's excess have at most MAX_RUNS runs per
       rank, the slowest rank has at most 0.5% more than the bands' bound: |work_r - mean| <= (runs of ranks
       0..r-1 + runs of ranks 0..r + 1) * delta, delta = the largest |token work - mean token work|
       (proof in the test's comment).
    """
    batch, N, _, _, workload = case
    bs = workload.block_size
    plan = build_plan(batch, N, 0, layout="balanced", workload=workload)
    models = [_model(plan, f, bs) for f in workload.forms]
    loads = []
    for r in range(N):
        work = _work(plan, workload, r)
        for f, w, m in zip(workload.forms, work, models):
            assert w <= int(m[plan.token_indices(r)].sum()), (f, r)
        loads.append(work)

    def objective(indices):
        return sum(f.layers * int(m[indices].sum(1).max()) for f, m in zip(workload.forms, models))

    ours = objective(plan.indices)
    others = {n: objective(build_plan(batch, N, 0, layout=n).indices) for n in ("contiguous", "head_tail")}
    assert ours <= others["contiguous"], others
    assert ours * 1000 <= others["head_tail"] * 1005, others
    if len(workload.forms) == 1 and N > 1:
        # A prefix of the bands' order is a sublevel set {E < y} of the excess E(x) = work[0, x) - x * mean.
        # Where such a set's run starts (or ends) at x, the tokens on either side have excess levels on
        # either side of y, each within delta / 2 of E(x), so E(x) is within delta / 2 of y: the set's
        # excess, the sum of E(end) - E(start) over its runs, is within runs * delta (+ delta / 2 where the
        # set holds one of the two ends, E(0) = E(T) = 0) of zero; a band is the difference of two prefixes.
        (m,) = models
        found = balance(plan.padded_len, N, plan.doc_ids, workload)
        bands = found.candidates[found.names.index(next(n for n in found.names if n.startswith("bands")))]
        mean = float(m.sum()) / N
        delta = float((m.double() - float(m.sum()) / plan.padded_len).abs().max())

        def prefix_runs(r):
            return int(count_runs(bands[:r].flatten().sort().values[None])[0]) if r else 0

        bound = max(prefix_runs(r) + prefix_runs(r + 1) + 1 for r in range(N)) * delta
        band_loads = m[bands].sum(1).double()
        assert float((band_loads - mean).abs().max()) <= bound + 1e-6 * mean
        if int(count_runs(bands).max()) <= MAX_RUNS:
            assert max(int(m[plan.indices[r]].sum()) for r in range(N)) <= 1.005 * (mean + bound) + 1e-9


@SETTINGS
@given(batches())
def test_halves_candidate_is_within_its_bound(case):
    """The ``halves`` candidate for every form's work: every token once, ``c`` per rank, at most
    ``ceil(log2 N) + 1`` runs per rank, and every rank's work within its bound.

    Each halving cuts a group's circle at the arc start whose work is within one token's work ``w`` of its share
    (the arc's work over all starts has exactly the share as mean and moves by at most ``w`` per start) plus
    ``HALVES_TOLERANCE``; a child's work per rank is then at most ``1.002 x`` its parent's plus ``w``, so after
    ``L`` halvings a rank has at most ``(mean + L w) 1.002^L``.
    """
    batch, N, _, _, workload = case
    if N == 1:
        return
    plan = build_plan(batch, N, 0, layout="contiguous")
    levels = (N - 1).bit_length()
    num, den = layouts.HALVES_TOLERANCE
    for f in workload.forms:
        m = _model(plan, f, workload.block_size)
        for cut_cost in (None, layouts._cut_cost(plan.doc_ids)):
            found = layouts._halves(m, N, cut_cost)
            assert torch.equal(found.flatten().sort().values, torch.arange(plan.padded_len))
            assert found.shape == (N, plan.chunk_len)
            assert int(count_runs(found).max()) <= levels + 1
            mean, w = float(m.sum()) / N, float(m.max())
            assert float(m[found].sum(1).max()) <= (mean + levels * w) * (den / num) ** levels + 1e-9


@SETTINGS
@given(batches(), ALL_LAYOUTS)
def test_documents_in_blocks_is_what_the_step_check_can_see(case, layout):
    """``documents_in_blocks`` against the step check itself, on dense masks: ``"shown"`` exactly when, for each
    rule the check accepts (the local rule, and with several runs the whole-sequence rule among a rank's tokens),
    the same rule without documents fails the check on some rank; else ``"hidden"`` when the same-document
    condition changes the keys some real query sees in the whole sequence, ``"irrelevant"`` when it changes none."""
    from cpcompile import ops

    batch, N, window, rows, workload = case
    ps = plans(batch, N, layout, workload)
    spec = ops.SiteSpec(
        site="t", layer="t", group_name="", cp_size=N, cp_rank=0, documents=True, window=window, kernel="dense",
        needs_grad=False,
    )  # fmt: skip
    told_apart = all(
        any(ops.mask_mismatch(spec, p, rule(p, documents=False, window=window)) is not None for p in ps)
        for rule in (type(ps[0]).local_rule_mask, type(ps[0]).local_global_mask)
    )
    real = [p.token_indices() < p.seq_len for p in ps]
    matters = any(
        not torch.equal(p.mask(documents=True, window=window)[:, :, q], p.mask(documents=False, window=window)[:, :, q])
        for p, q in zip(ps, real)
    )
    want = "shown" if told_apart else ("hidden" if matters else "irrelevant")
    assert {p.documents_in_blocks(window) for p in ps} == {want}, (rows, N, layout, window, told_apart, matters)
