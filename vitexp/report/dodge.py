"""Markers of different rows that would hide one another on a plot's axis are set apart on the page, never
in the data; a row with a cost but no accuracy, or an accuracy but no cost, is drawn in a strip beside
the axis, never inside it (:mod:`vitexp.report.plots` draws them, this module places them).

Its reasoning: docs/tables.md, "vitexp/report/dodge.py".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count
from typing import Any, Iterator

#: The note under a plot whose axis has a marker set apart from its values.
MOVED_NOTE = (
    "Markers that would hide one another are set apart sideways on the page (by multiples of a "
    "marker's width); their values are the table's."
)
#: Centres closer than this (points) are set apart, by multiples of it.
GAP = 10.0
#: The direction each kind of marker moves in: a point of the plane, a cost-only marker (cost on
#: x), an accuracy-only one (accuracy on y).
DIRECTIONS = {"point": (1.0, 0.0), "xtick": (0.0, 1.0), "ytick": (1.0, 0.0)}
#: A strip's markers (size in points), their row's centre from the strip's outer edge (points: a
#: strip's free coordinate is in points), and the space between a strip and its axis (points).
MARKER = 8.0
BASE = 3.0 + MARKER / 2
PAD = 4.0
#: The least space between a marker's outline and its axes' edge (points).
EDGE = 3.0
#: A strip's side of the axis -> its label.
LABELS = {"bottom": "cost only", "left": "no cost\ngiven"}


@dataclass
class Mark:
    """One row's marker on an axis: its line first, then what moves with it (error bars), and the
    annotations placed at an offset in points from it."""

    row: str
    kind: str
    artists: list[Any]
    notes: list[Any] = field(default_factory=list)
    #: The artists' transforms and clipping and the notes' offsets as drawn, before any move.
    drawn: tuple[list[Any], list[bool], list[Any]] | None = None
    #: Set apart from where its values put it (:func:`separate`).
    moved: bool = False

    def restore(self) -> None:
        """Back to the place it was drawn at (before :func:`separate` moved it), remembering it."""
        self.moved = False
        if self.drawn is None:
            self.drawn = (
                [a.get_transform() for a in self.artists],
                [a.get_clip_on() for a in self.artists],
                [n.xyann for n in self.notes],
            )
            return
        for artist, transform, clip in zip(self.artists, self.drawn[0], self.drawn[1]):
            artist.set_transform(transform)
            artist.set_clip_on(clip)
        for note, xy in zip(self.notes, self.drawn[2]):
            note.xyann = xy


def _steps(kind: str) -> Iterator[int]:
    """Multiples of :data:`GAP` to try: alternating sides for a point, one way for an edge marker."""
    yield 0
    for n in count(1):
        yield n
        if kind == "point":
            yield -n


def offsets(marks: list[tuple[str, str, tuple[float, float]]]) -> list[tuple[float, float]]:
    """Each mark's offset in points, from its ``(row, kind, centre in points)``, by the rule above."""
    placed: list[tuple[str, float, float]] = []
    out = []
    for row, kind, (x, y) in marks:
        dx, dy = DIRECTIONS[kind]
        for n in _steps(kind):
            px, py = x + n * GAP * dx, y + n * GAP * dy
            if all(other == row or (px - ox) ** 2 + (py - oy) ** 2 >= GAP**2 for other, ox, oy in placed):
                break
        placed.append((row, px, py))
        out.append((px - x, py - y))
    return out


def _centre(mark: Mark) -> tuple[float, float]:
    line = mark.artists[0]
    x, y = line.get_transform().transform(line.get_xydata()[0])
    scale = 72.0 / line.figure.dpi
    return x * scale, y * scale


def _by_axes(marks: list[Mark]) -> dict[Any, list[Mark]]:
    groups: dict[Any, list[Mark]] = {}
    for mark in marks:
        groups.setdefault(mark.artists[0].axes, []).append(mark)
    return groups


def separate(marks: list[Mark]) -> None:
    """Move the marks of each axis or strip apart (:func:`offsets`), after the figure's layout is
    final; from where they were drawn, so it may be called again on a new layout."""
    from matplotlib.transforms import ScaledTranslation

    for mark in marks:
        mark.restore()
    for ax, group in _by_axes(marks).items():
        ax.get_xlim(), ax.get_ylim()  # applies any pending autoscaling: centres are read on final limits
        for mark, (dx, dy) in zip(group, offsets([(m.row, m.kind, _centre(m)) for m in group])):
            if not (dx or dy):
                continue
            mark.moved = True
            for artist in mark.artists:
                shift = ScaledTranslation(dx / 72.0, dy / 72.0, artist.figure.dpi_scale_trans)
                artist.set_transform(artist.get_transform() + shift)
                artist.set_clip_on(False)
            for note in mark.notes:
                note.xyann = (note.xyann[0] + dx, note.xyann[1] + dy)


class Strips:
    """The strips of one accuracy axis, by side ("bottom": cost only, "left": no cost given)."""

    def __init__(self, ax):
        self.ax, self.divider, self.axes, self.sizes = ax, None, {}, {}

    def get(self, side: str):
        """The strip on ``side``, made on first use: it takes over the axis's tick labels and label on
        its side, and has no scale of its own."""
        if side in self.axes:
            return self.axes[side]
        from mpl_toolkits.axes_grid1 import make_axes_locatable
        from mpl_toolkits.axes_grid1.axes_size import Fixed

        self.divider = self.divider or make_axes_locatable(self.ax)
        self.sizes[side] = Fixed((2 * BASE) / 72.0)
        bottom = side == "bottom"
        strip = self.axes[side] = self.divider.append_axes(
            side,
            size=self.sizes[side],
            pad=PAD / 72.0,
            facecolor="0.96",
            **{"sharex" if bottom else "sharey": self.ax},
        )
        strip.tick_params(labelsize=7)
        self._limit(side)
        if bottom:
            strip.set_yticks([])
            strip.set_ylabel(LABELS[side], rotation=0, ha="right", va="center", fontsize=7)
            strip.set_xlabel(self.ax.get_xlabel(), fontsize=8)
            self.ax.set_xlabel("")
            self.ax.tick_params(labelbottom=False)
        else:
            strip.set_xticks([])
            strip.set_xlabel(LABELS[side], fontsize=6)
            strip.xaxis.set_label_position("top")
            strip.set_ylabel(self.ax.get_ylabel(), fontsize=8)
            self.ax.set_ylabel("")
            self.ax.tick_params(labelleft=False)
        strip.grid(alpha=0.3, axis="x" if bottom else "y")
        return strip

    def _limit(self, side: str) -> None:
        """The strip's free coordinate in points from its outer edge (0 to its depth)."""
        depth = self.sizes[side].fixed_size * 72.0
        (self.axes[side].set_ylim if side == "bottom" else self.axes[side].set_xlim)(0.0, depth)

    def inches(self, side: str) -> float:
        """The figure's growth for the strip on ``side`` (0 without one)."""
        return self.sizes[side].fixed_size + PAD / 72.0 if side in self.sizes else 0.0

    def deepen(self, marks: list[Mark]) -> bool:
        """Make each strip as deep as its deepest stack of ``marks``; True when one grew."""
        grew = False
        for side, strip in self.axes.items():
            strip.get_xlim(), strip.get_ylim()  # applies pending autoscaling
            own = [(m.row, m.kind, _centre(m)) for m in marks if m.artists[0].axes is strip]
            reach = max((max(abs(dx), abs(dy)) for dx, dy in offsets(own)), default=0.0)
            if 2 * BASE + reach > self.sizes[side].fixed_size * 72.0 + 1e-6:
                self.sizes[side].fixed_size = (2 * BASE + reach) / 72.0
                self._limit(side)
                grew = True
        return grew


def fit(
    fig, strips: list[Strips], marks: list[Mark], rounds: int = 3, size: tuple[float, float] | None = None
) -> None:
    """Lay the figure out with its strips deep enough for their stacks, growing it (``size``, else
    its size now) by the strips (up to ``rounds`` times: a strip's depth moves the markers of the
    strips across it). Marks are read where they were drawn."""
    for mark in marks:
        mark.restore()
    width, height = size or fig.get_size_inches()
    for n in range(rounds + 1):
        fig.set_size_inches(
            width + sum(s.inches("left") for s in strips),
            height + max((s.inches("bottom") for s in strips), default=0.0),
        )
        fig.tight_layout()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:  # the strips' and their axes' places (otherwise applied at the next draw)
            if ax.get_axes_locator():
                ax.apply_aspect(ax.get_axes_locator()(ax, renderer))
        if n == rounds or not any([s.deepen(marks) for s in strips]):
            return


def extent(line):
    """A marker's outline (its path at its size, half its edge width round it) in display pixels,
    round its centre (offset included)."""
    from matplotlib.markers import MarkerStyle
    from matplotlib.transforms import Affine2D, Bbox

    style = MarkerStyle(line.get_marker())
    px = line.figure.dpi / 72.0
    box = (
        style.get_path()
        .transformed(style.get_transform() + Affine2D().scale(line.get_markersize() * px))
        .get_extents()
    )
    edge = line.get_markeredgewidth() * px / 2
    x, y = line.get_transform().transform(line.get_xydata()[0])
    return Bbox([[x + box.x0 - edge, y + box.y0 - edge], [x + box.x1 + edge, y + box.y1 + edge]])


#: The data coordinates of each kind of marker: a strip's other coordinate is its own (points).
DATA_DIMS = {"point": (0, 1), "xtick": (0,), "ytick": (1,)}


def pad(marks: list[Mark], rounds: int = 20) -> bool:
    """Widen each axis (in data units) until every marker on it, as now placed, lies :data:`EDGE`
    points inside its window, with the notes that move with it (†); True when a limit changed."""
    from matplotlib.transforms import Bbox

    need: dict[tuple[Any, int], list[tuple[float, float, float]]] = {}
    for mark in marks:
        line = mark.artists[0]
        ax, box = line.axes, Bbox.union([extent(line), *(note.get_window_extent() for note in mark.notes)])
        edge = EDGE * line.figure.dpi / 72.0
        value = line.get_xydata()[0]
        at = ax.transData.transform(value)  # the value's own place: the offset is part of the reach
        for dim in DATA_DIMS[mark.kind]:
            low, high = (box.x0, box.x1) if dim == 0 else (box.y0, box.y1)
            need.setdefault((ax, dim), []).append(
                (float(value[dim]), at[dim] - low + edge, high - at[dim] + edge)
            )
    changed = False
    for (ax, dim), reaches in need.items():
        get, put = (ax.get_xlim, ax.set_xlim) if dim == 0 else (ax.get_ylim, ax.set_ylim)
        lo, hi = get()
        size = ax.bbox.width if dim == 0 else ax.bbox.height
        new_lo, new_hi = lo, hi
        for _ in range(rounds):  # each widening shrinks the scale, so the reach in data units grows
            scale = (new_hi - new_lo) / size
            wider = (
                min(new_lo, *(v - below * scale for v, below, _ in reaches)),
                max(new_hi, *(v + above * scale for v, _, above in reaches)),
            )
            if wider == (new_lo, new_hi):
                break
            new_lo, new_hi = wider
        if (new_lo, new_hi) != (lo, hi):
            put(new_lo, new_hi)
            changed = True
    return changed


def place(fig, strips: list[Strips], marks: list[Mark], rounds: int = 4) -> None:
    """The figure's final layout (:func:`fit`), its markers set apart (:func:`separate`) and its
    axes widened until none is cut at an edge (:func:`pad`), redone up to ``rounds`` times."""
    size = tuple(fig.get_size_inches())
    for _ in range(rounds):
        fit(fig, strips, marks, size=size)
        separate(marks)
        if not pad(marks):
            return
    fit(fig, strips, marks, size=size)
    separate(marks)
