"""The attention-pattern picture's cell counts (no dense mask) against the plan's dense masks, at every layout.

``cell_counts`` never builds a mask of the whole sequence; the reference here does: every rank's rows of
``CPPlan.mask`` (itself tested against a brute-force definition in tests/test_plan*.py) put in token order and
summed over each cell. The picture drawn from the counts shows each rank's colour on its own tokens, also where
the layout gives a rank several runs of tokens.
"""

from __future__ import annotations

import pytest
import torch

from cpcompile.inspect.picture import attention_pattern_image, cell_counts, pattern_geometry
from cpcompile.plan import LAYOUTS, build_plan
from cpcompile.testing import packed_batch


def dense_cells(plan, k: int, documents: bool, window: int | None):
    """Cell counts, cell sizes and token owners from the dense ``[B, T_pad, T_pad]`` mask of all ranks."""
    T, B = plan.padded_len, plan.batch_size
    full = torch.zeros(B, T, T, dtype=torch.long)
    owner = torch.empty(T, dtype=torch.long)
    for r in range(plan.cp_size):
        rows = plan.token_indices(r)
        full[:, rows] = plan.mask(documents=documents, window=window, rank=r)[:, 0].long()
        owner[rows] = r
    n = -(-T // k)
    padded = torch.zeros(B, n * k, n * k, dtype=torch.long)
    padded[:, :T, :T] = full
    valid = torch.zeros(n * k, n * k, dtype=torch.long)
    valid[:T, :T] = 1
    return padded.view(B, n, k, n, k).sum(dim=(2, 4)), valid.view(n, k, n, k).sum(dim=(1, 3)), owner


CASES = [
    # (documents per row, CP size, tokens per cell, window)
    ([[10, 20, 34]], 2, 1, None),
    ([[100, 200], [300]], 3, 3, None),
    ([[40, 3, 70, 44], [1, 100, 56]], 4, 5, 24),
    ([[7, 1, 1, 30], [39]], 5, 4, 3),
    ([[129]], 7, 7, None),
    ([[5]], 5, 2, None),
]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("documents", [True, False])
@pytest.mark.parametrize(("docs", "cp_size", "k", "window"), CASES)
def test_cell_counts_equal_dense_mask_sums(docs, cp_size, k, window, documents, layout):
    plan = build_plan(packed_batch(docs), cp_size, 0, layout=layout)
    counts = cell_counts(plan, k, documents=documents, window=window)
    visible, total, owner = dense_cells(plan, k, documents, window)
    assert torch.equal(counts.visible, visible)
    assert torch.equal(counts.total, total)
    assert torch.equal(counts.token_owner, owner)
    assert torch.equal(counts.owner, owner[torch.arange(visible.shape[1]) * k])


def test_picture_colours_every_run_of_a_rank_in_its_colour():
    """head_tail at CP=4, T=64: rank r holds tokens [8r, 8r+8) and [56-8r, 64-8r); one pixel per token row."""
    plan = build_plan(packed_batch([[64], [64]]), 4, 0, layout="head_tail")
    geo = pattern_geometry(64, 2)  # 64 cells of 1 token, 8 px each
    rgb = attention_pattern_image(plan).convert("RGB")

    def cell(i, j):
        return rgb.getpixel((56 + j * geo.pixels_per_cell + 4, 24 + i * geo.pixels_per_cell + 4))

    owner = {t: r for r in range(4) for t in plan.token_indices(r).tolist()}
    diagonal = {}
    for t in range(64):  # a token sees itself: its cell has its rank's own-keys colour
        diagonal.setdefault(owner[t], set()).add(cell(t, t))
    assert all(len(c) == 1 for c in diagonal.values()), diagonal
    assert len({next(iter(c)) for c in diagonal.values()}) == 4  # four ranks, four colours
    # query 60 (rank 0's second run) against key 3 (rank 0's first run): own keys; key 12 (rank 1): gathered
    assert cell(60, 3) == cell(0, 0)
    assert cell(60, 12) not in (cell(0, 0), cell(12, 12), cell(0, 12))
