"""The attention-pattern picture of ``cpcompile inspect``: which (query, key) pairs every CP rank computes.

Main API: :func:`cell_counts` (the pattern of a plan downsampled to cells of several tokens, from per-query
visible intervals) and :func:`attention_pattern_image` (the PNG drawn from those counts). Memory and time grow
with ``T + cells^2`` (at most 128 cells a side), never with ``T * T``: no mask of the whole sequence is built.
"""

from __future__ import annotations

import dataclasses

import torch

from cpcompile.mask import first_visible
from cpcompile.plan import CPPlan

__all__ = [
    "GUTTER_PX",
    "LEGEND_PX",
    "MARGIN_PX",
    "MAX_CELLS",
    "PANEL_PX",
    "TITLE_PX",
    "CellCounts",
    "PatternGeometry",
    "attention_pattern_image",
    "cell_counts",
    "pattern_geometry",
]

#: At most this many cells per side of a panel; longer sequences put several tokens in one cell.
MAX_CELLS = 128
#: A panel is about this many pixels wide (``pixels_per_cell = max(2, PANEL_PX // cells)``).
PANEL_PX = 512
#: Left gutter (rank labels), title band above the panels, legend band below, margin, in pixels.
GUTTER_PX, TITLE_PX, LEGEND_PX, MARGIN_PX = 56, 24, 24, 16

_PALETTE = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
]
_MASKED = (236, 236, 236)
_BACKGROUND = (255, 255, 255)
_TEXT = (20, 20, 20)


@dataclasses.dataclass(frozen=True)
class PatternGeometry:
    """Sizes of the attention-pattern PNG (see :func:`pattern_geometry`)."""

    tokens_per_cell: int
    cells: int
    pixels_per_cell: int
    panel: int
    width: int
    height: int


def pattern_geometry(padded_len: int, batch_size: int) -> PatternGeometry:
    """The PNG's layout for ``batch_size`` rows of ``padded_len`` tokens.

    ``tokens_per_cell = ceil(T_pad / MAX_CELLS)``, ``cells = ceil(T_pad / tokens_per_cell)``,
    ``pixels_per_cell = max(2, PANEL_PX // cells)``, ``panel = cells * pixels_per_cell``;
    ``width = GUTTER_PX + B * (panel + MARGIN_PX)``, ``height = TITLE_PX + panel + LEGEND_PX``.
    """
    k = -(-padded_len // MAX_CELLS)
    cells = -(-padded_len // k)
    px = max(2, PANEL_PX // cells)
    panel = cells * px
    return PatternGeometry(
        k, cells, px, panel, GUTTER_PX + batch_size * (panel + MARGIN_PX), TITLE_PX + panel + LEGEND_PX
    )


@dataclasses.dataclass(frozen=True)
class CellCounts:
    """A plan's attention pattern in cells of ``tokens_per_cell`` queries by ``tokens_per_cell`` keys.

    Cell ``(i, j)`` covers global queries ``[edges[i], edges[i + 1])`` and keys ``[edges[j], edges[j + 1])``
    (the last cell may be shorter).
    """

    tokens_per_cell: int
    #: ``[cells + 1]`` int64: the cell boundaries in global token indices (``edges[-1] = T_pad``).
    edges: torch.Tensor
    #: ``[B, cells, cells]`` int64: visible (query, key) pairs of every cell, per batch row.
    visible: torch.Tensor
    #: ``[cells, cells]`` int64: (query, key) pairs of every cell.
    total: torch.Tensor
    #: ``[T_pad]`` int64: the rank that holds every global token (``plan.indices`` inverted).
    token_owner: torch.Tensor

    @property
    def owner(self) -> torch.Tensor:
        """``[cells]``: the rank that holds the first token of every cell (the cell's colour)."""
        return self.token_owner[self.edges[:-1]]


def cell_counts(plan: CPPlan, tokens_per_cell: int, *, documents: bool = True, window: int | None = None) -> CellCounts:
    """Visible (query, key) pairs of every cell of ``tokens_per_cell`` tokens a side, for every rank's queries.

    Query ``q`` sees the keys ``[lo_q, q]`` with ``lo_q = first_visible(q)`` (:func:`cpcompile.plan.first_visible`,
    the interval form of :func:`cpcompile.plan.visible`), and ``lo`` never decreases along the sequence
    (documents are contiguous). So the number of keys below ``x`` that ``q`` sees is
    ``max(x - lo_q, 0) - max(x - q - 1, 0)``, its sum over a cell's queries follows from prefix sums of ``lo``, and
    a cell's count is the difference of those sums at its two key edges: O(B * (T_pad + cells^2)) time and
    memory, never one entry per (query, key) pair.
    """
    if not isinstance(tokens_per_cell, int) or tokens_per_cell < 1:
        raise ValueError(f"tokens_per_cell must be a positive int, got {tokens_per_cell!r}")
    T, B = plan.padded_len, plan.batch_size
    device = plan.doc_ids.device
    cells = -(-T // tokens_per_cell)
    edges = (torch.arange(cells + 1, device=device) * tokens_per_cell).clamp(max=T)
    starts, ends = edges[:-1], edges[1:]
    queries = torch.arange(T, device=device).expand(B, T)

    def keys_below_edges(first: torch.Tensor) -> torch.Tensor:
        """``[B, cells, cells + 1]``: sum over the queries of row cell ``i`` of ``max(x - first_q, 0)`` at every
        edge ``x`` (``first`` ``[B, T]`` non-decreasing along the sequence)."""
        prefix = torch.nn.functional.pad(first.cumsum(dim=1), (1, 0))  # [B, T + 1]
        below = torch.searchsorted(first.contiguous(), edges.expand(B, -1).contiguous())  # queries with first < x
        upto = torch.minimum(torch.maximum(below[:, None, :], starts[:, None]), ends[:, None])  # [B, cells, cells+1]
        count = upto - starts[:, None]
        summed = prefix.gather(1, upto.flatten(1)).view_as(upto) - prefix[:, starts][:, :, None]
        return count * edges - summed

    lo = first_visible(plan.attention_docs(documents), queries[0], window)  # [B, T]
    visible = (keys_below_edges(lo) - keys_below_edges(queries + 1)).diff(dim=2)
    size = ends - starts
    token_owner = torch.empty(T, dtype=torch.long, device=device)
    token_owner[plan.gathered_indices()] = torch.arange(plan.cp_size, device=device).repeat_interleave(plan.chunk_len)
    return CellCounts(tokens_per_cell, edges, visible, size[:, None] * size[None, :], token_owner)


def _owner_runs(token_owner: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(start, end, rank)`` of every run of consecutive global tokens held by one rank."""
    T = int(token_owner.shape[0])
    cuts = [0, *(torch.nonzero(token_owner[1:] != token_owner[:-1]).flatten() + 1).tolist(), T]
    return [(a, b, int(token_owner[a])) for a, b in zip(cuts, cuts[1:])]


def attention_pattern_image(plan: CPPlan, *, documents: bool = True, window: int | None = None):
    """A PIL image of which (query, key) pairs every rank computes under ``plan`` (Pillow required).

    One panel per batch row: rows are global query positions, columns keys, both in token order. A cell is
    coloured with the colour of the rank that holds its (first) query (labelled in the left gutter, next to
    each run of tokens that rank holds): bright where every pair of the cell attends and the keys are held by
    the same rank (the rank's own keys), dark where they are keys gathered from another rank, pale when only
    some pairs of the cell attend (a cell covers several tokens when ``T_pad > MAX_CELLS``), light gray when
    none does. Lines mark where the rank holding the tokens changes. Sizes: :func:`pattern_geometry`; the
    counts come from :func:`cell_counts`.
    """
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError as e:
        raise ImportError("the attention-pattern picture needs Pillow: pip install 'cpcompile[inspect]'") from e

    T, B, N = plan.padded_len, plan.batch_size, plan.cp_size
    geo = pattern_geometry(T, B)
    k, n, px = geo.tokens_per_cell, geo.cells, geo.pixels_per_cell
    counts = cell_counts(plan, k, documents=documents, window=window)
    colours = torch.tensor([_PALETTE[r % len(_PALETTE)] for r in range(N)], dtype=torch.int64)
    own, gathered, pale = colours, colours * 3 // 5, (colours + 255) // 2  # shades of a rank's colour
    owner = counts.owner.cpu()
    row_owner = owner[:, None].expand(n, n)
    same_owner = (owner[:, None] == owner[None, :])[..., None]
    full_colour = torch.where(same_owner, own[row_owner], gathered[row_owner])  # [n, n, 3]
    masked = torch.tensor(_MASKED, dtype=torch.int64)

    image = Image.new("RGB", (geo.width, geo.height), _BACKGROUND)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    runs = _owner_runs(counts.token_owner.cpu())
    for b in range(B):
        v = counts.visible[b].cpu()[..., None]
        rgb = torch.where(v == 0, masked, torch.where(v < counts.total.cpu()[..., None], pale[row_owner], full_colour))
        cells = Image.frombytes("RGB", (n, n), rgb.to(torch.uint8).contiguous().numpy().tobytes())
        panel = cells.resize((geo.panel, geo.panel), Image.NEAREST)
        x0, y0 = GUTTER_PX + b * (geo.panel + MARGIN_PX), TITLE_PX
        image.paste(panel, (x0, y0))
        for start, _, _ in runs[1:]:
            edge = round(start / k * px)
            draw.line([(x0, y0 + edge), (x0 + geo.panel - 1, y0 + edge)], fill=(60, 60, 60))
            draw.line([(x0 + edge, y0), (x0 + edge, y0 + geo.panel - 1)], fill=(170, 170, 170))
        draw.rectangle([x0 - 1, y0 - 1, x0 + geo.panel, y0 + geo.panel], outline=(60, 60, 60))
        draw.text((x0, 6), f"row {b}: queries (down) x keys (across)", fill=_TEXT, font=font)
    draw.text(
        (GUTTER_PX, TITLE_PX + geo.panel + 6),
        "bright = own keys | dark = keys gathered from other ranks | pale = cell partly visible | gray = masked",
        fill=_TEXT,
        font=font,
    )
    for start, end, r in runs:
        band = (end - start) / k * px
        if band >= 12:
            y = TITLE_PX + start / k * px + band / 2 - 6
            draw.text((6, y), f"rank {r}", fill=_PALETTE[r % len(_PALETTE)], font=font)
    return image
