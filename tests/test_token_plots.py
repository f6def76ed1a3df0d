"""Token maps (vitexp/analysis/token_plots.py) mark a dropped patch and a fused one so that neither
can be mistaken for dark image content: a hatch over each, red for a dropped patch, white over a
tint of the token's colour for a fused one, and no dark fill."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import to_rgb
from matplotlib.patches import Rectangle

from vitexp.analysis import token_plots


def overlay_alpha(ax, row: int, col: int) -> float:
    return float(ax.images[-1].get_array()[row, col, 3])


def test_dropped_and_fused_patches_are_hatched_not_darkened():
    img = np.zeros((8, 8, 3))  # a black image: a dark fill would be invisible on it
    token = np.array([[0, 0], [-1, 1]])  # (0, 1) fused into token 0, (1, 0) dropped
    kept = np.array([[True, False], [False, True]])
    fig, ax = plt.subplots()
    try:
        token_plots._panel(ax, img, (2, 2), token, kept, None, "t")
        hatched = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_hatch()]
        dropped = [p for p in hatched if p.get_hatch() == "xxx"]
        fused = [p for p in hatched if p.get_hatch() == "///"]
        assert len(dropped) == 1 and dropped[0].get_xy() == (0.0, 4.0)  # column 0, row 1
        assert to_rgb(dropped[0].get_edgecolor()) == token_plots.DROPPED
        assert len(fused) == 1 and fused[0].get_xy() == (4.0, 0.0)
        assert to_rgb(fused[0].get_edgecolor()) == (1.0, 1.0, 1.0)  # a white hatch shows on black
        assert overlay_alpha(ax, 0, 1) > 0  # tinted in the token's colour
        overlay = ax.images[-1].get_array()
        assert (
            overlay[1, 0, :3].max() > 0.5 and overlay[1, 0, 3] > 0
        )  # the dropped cell is coloured, not dark
        assert overlay[0, 0, 3] == 0 and overlay[1, 1, 3] == 0  # kept patches stay clear
    finally:
        plt.close(fig)
