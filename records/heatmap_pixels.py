"""The composition heatmaps logged during training, drawn straight into an RGB array: a colour lookup
table and ``np.repeat``, no matplotlib figure (~1000x cheaper than drawing one). NumPy only, so that a
run imports matplotlib only for the end-of-run report (:mod:`reports.plots`)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

RDBU_R_ANCHORS = np.array(
    [  # ColorBrewer RdBu, 11 classes, reversed: blue (negative) .. red (positive); matplotlib's RdBu_r
        (5, 48, 97),
        (33, 102, 172),
        (67, 147, 195),
        (146, 197, 222),
        (209, 229, 240),
        (247, 247, 247),
        (253, 219, 199),
        (244, 165, 130),
        (214, 96, 77),
        (178, 24, 43),
        (103, 0, 31),
    ],
    dtype=np.float64,
)
COLOR_LEVELS = 251
"""Colour levels of the heatmap lookup table; odd, so 0 gets the middle (white) level exactly."""
MASKED, SEPARATOR, BACKGROUND = COLOR_LEVELS, COLOR_LEVELS + 1, COLOR_LEVELS + 2
"""Table indices past the colour levels: masked pair (grey), line between layers, gap between panels."""


def _lookup_table() -> np.ndarray:
    """``[COLOR_LEVELS + 3, 3]`` uint8: the diverging map sampled evenly, then grey, dark grey, white."""
    at = np.linspace(0, len(RDBU_R_ANCHORS) - 1, COLOR_LEVELS)
    levels = np.stack([np.interp(at, np.arange(len(RDBU_R_ANCHORS)), RDBU_R_ANCHORS[:, c]) for c in range(3)], axis=1)
    extra = np.array([(217, 217, 217), (90, 90, 90), (255, 255, 255)], dtype=np.float64)
    return np.rint(np.concatenate([levels, extra])).astype(np.uint8)


LOOKUP_TABLE = _lookup_table()
PANEL_GAP = 8  # pixels of background between the Q, K and V panels


def symmetric_limit(scores: dict[str, np.ndarray]) -> float:
    """The largest ``|value|`` over every finite entry of every panel (1.0 if there is none or it is 0)."""
    largest = max((float(np.nanmax(np.abs(s))) for s in scores.values() if np.isfinite(s).any()), default=0.0)
    return largest if largest > 0 else 1.0


def default_cell_pixels(n_cells: int) -> int:
    """Square cell side: about 200 pixels per panel, between 4 and 48 pixels per cell."""
    return int(np.clip(200 // max(n_cells, 1), 4, 48))


def heatmap_image(
    scores: dict[str, np.ndarray], limit: float | None = None, cell_pixels: int | None = None
) -> np.ndarray:
    """The composition heatmaps as one ``[height, width, 3]`` uint8 image: a panel per kind, left to
    right in ``scores`` order, ``PANEL_GAP`` white pixels apart.

    ``scores[kind]``: ``[L, H, L, H]`` with NaN for masked pairs (``L >= 2``). Rows are writer heads (layers 0 .. L-2), columns reader heads
    (layers 1 .. L-1), row-major by (layer, head). Colours: a diverging map over ``[-limit, limit]``
    (default :func:`symmetric_limit`; values beyond it saturate), masked pairs grey, a 1-pixel dark
    line between layers. Each panel is ``(L-1)H`` cells of ``cell_pixels`` (default
    :func:`default_cell_pixels`) plus ``L-2`` lines, square.
    """
    n_layers, n_heads = next(iter(scores.values())).shape[:2]
    if n_layers < 2:
        raise ValueError("a one-layer model has no earlier->later head pairs to draw")
    side = (n_layers - 1) * n_heads
    limit = symmetric_limit(scores) if limit is None else float(limit)
    cell_pixels = default_cell_pixels(side) if cell_pixels is None else cell_pixels
    pixel_to_cell = _pixel_to_cell(side, n_heads, cell_pixels)  # [panel side in pixels], -1 on a line
    gap = np.broadcast_to(LOOKUP_TABLE[BACKGROUND], (len(pixel_to_cell), PANEL_GAP, 3))
    panels = []
    for values in scores.values():
        grid = values.reshape(n_layers * n_heads, n_layers * n_heads)[:side, n_heads:]  # writers x readers
        levels = np.full((side + 1, side + 1), SEPARATOR, dtype=np.uint8)  # the last row and column: the line colour
        levels[:side, :side] = _color_levels(grid, limit)
        cells = LOOKUP_TABLE[levels]  # colour the few cells, then upscale: 5x faster than colouring every pixel
        # one-axis takes with a repeated index (the -1 entries pick the line colour): 5x faster than 2-D fancy indexing
        panels += [np.take(np.take(cells, pixel_to_cell, axis=0), pixel_to_cell, axis=1), gap]
    return np.concatenate(panels[:-1], axis=1)


def _color_levels(grid: np.ndarray, limit: float) -> np.ndarray:
    """Table index per cell: the colour level of ``value / limit`` in [-1, 1], ``MASKED`` for NaN."""
    with np.errstate(invalid="ignore"):
        scaled = (np.clip(grid / limit, -1.0, 1.0) + 1.0) * (0.5 * (COLOR_LEVELS - 1))
    return np.where(np.isnan(grid), MASKED, np.rint(np.nan_to_num(scaled))).astype(np.uint8)


@lru_cache(maxsize=64)
def _pixel_to_cell(side: int, n_heads: int, cell_pixels: int) -> np.ndarray:
    """For each pixel along a panel side, the cell it shows, or -1 for the line between two layers."""
    pixels = np.repeat(np.arange(side), cell_pixels)
    boundaries = np.arange(n_heads, side, n_heads) * cell_pixels  # where each layer after the first begins
    pixels = np.insert(pixels, boundaries, -1)
    pixels.flags.writeable = False  # shared through the cache
    return pixels
