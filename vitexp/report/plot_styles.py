"""The table plots' row styles (:mod:`vitexp.report.plots`): a colour and a marker per row, and the colour
distance that decides which pairs can be told apart.

Its reasoning: docs/tables.md, "vitexp/report/plot_styles.py".
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

#: ΔE00 (CIEDE2000) below which two colours of one marker shape read as one.
MIN_DELTA_E = 20.0
#: A shade's least ΔE00 from white (the background: paler markers fade into it) and from black
#: (darker ones read as black, the baseline's near-black hue, whatever their hue: ΔE00 overrates
#: chroma differences of very dark small marks). tab:blue keeps its 45 % mix with white (L* 71);
#: its darker mixes fall below one of the two thresholds.
MIN_FROM_WHITE = MIN_FROM_BLACK = 22.0

#: Family -> hue (families a table names often; the others take :data:`SPARE_COLOURS`).
FAMILY_COLOURS = {
    "baseline": "0.15",
    "BSPF-ViT": "tab:blue",
    "chunk attention": "tab:cyan",
    "EViT": "tab:orange",
    "ToMe": "tab:green",
    "SAPER": "tab:red",
    "RAPTOR": "tab:purple",
}
#: Hues of the other families (cited methods, head-selection rules), tried in this order; no grey:
#: grey is the controls'.
SPARE_COLOURS = (
    "tab:brown",
    "tab:pink",
    "tab:olive",
    "gold",
    "teal",
    "maroon",
    "lime",
    "darkkhaki",
    "magenta",
)
#: Markers of a family's rows, in order.
MARKERS = ("o", "s", "D", "P", "X", "*", "^", "v", "h", "p", "<", ">", "d", "H")
#: Markers that differ too little at 6 points to tell rows apart on one axis (a hexagon turned by
#: 30 degrees): one outline for :func:`row_styles`, though two styles in the legend.
OUTLINES = {"H": "h"}
#: Mixing fractions a shade is chosen from: with white (> 0) or black (< 0), nearest the hue first.
FRACTIONS = tuple(round(f * 0.05, 2) for f in range(1, 17))
CONTROL_COLOUR = "0.55"
CONTROL_MARKERS = ("X", "D", "s", "P")
#: A family's shades at most.
MAX_SHADES = 4

_D65 = (0.95047, 1.0, 1.08883)


@lru_cache(maxsize=4096)
def lab(colour: Any) -> tuple[float, float, float]:
    """CIE L*a*b* (D65) of a Matplotlib colour (sRGB)."""
    from matplotlib.colors import to_rgb

    def linear(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(c) for c in to_rgb(colour))
    xyz = (
        0.4124564 * r + 0.3575761 * g + 0.1804375 * b,
        0.2126729 * r + 0.7151522 * g + 0.0721750 * b,
        0.0193339 * r + 0.1191920 * g + 0.9503041 * b,
    )

    def f(t: float) -> float:
        return t ** (1 / 3) if t > (6 / 29) ** 3 else t / (3 * (6 / 29) ** 2) + 4 / 29

    fx, fy, fz = (f(v / w) for v, w in zip(xyz, _D65))
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def ciede2000(lab1: tuple[float, float, float], lab2: tuple[float, float, float]) -> float:
    """ΔE00 between two L*a*b* colours (kL = kC = kH = 1)."""
    (l1, a1, b1), (l2, a2, b2) = lab1, lab2
    c_bar = (math.hypot(a1, b1) + math.hypot(a2, b2)) / 2
    g = 0.5 * (1 - math.sqrt(c_bar**7 / (c_bar**7 + 25**7)))
    a1p, a2p = (1 + g) * a1, (1 + g) * a2
    c1p, c2p = math.hypot(a1p, b1), math.hypot(a2p, b2)
    h1p = math.degrees(math.atan2(b1, a1p)) % 360 if c1p else 0.0
    h2p = math.degrees(math.atan2(b2, a2p)) % 360 if c2p else 0.0
    dlp, dcp = l2 - l1, c2p - c1p
    dhp = 0.0
    if c1p * c2p:
        dhp = h2p - h1p
        dhp = dhp - 360 if dhp > 180 else dhp + 360 if dhp < -180 else dhp
    dH = 2 * math.sqrt(c1p * c2p) * math.sin(math.radians(dhp / 2))
    lp, cp = (l1 + l2) / 2, (c1p + c2p) / 2
    hp = h1p + h2p
    if c1p * c2p:
        hp = hp / 2 if abs(h1p - h2p) <= 180 else (hp + 360) / 2 if hp < 360 else (hp - 360) / 2
    t = (
        1
        - 0.17 * math.cos(math.radians(hp - 30))
        + 0.24 * math.cos(math.radians(2 * hp))
        + 0.32 * math.cos(math.radians(3 * hp + 6))
        - 0.20 * math.cos(math.radians(4 * hp - 63))
    )
    sl = 1 + 0.015 * (lp - 50) ** 2 / math.sqrt(20 + (lp - 50) ** 2)
    sc, sh = 1 + 0.045 * cp, 1 + 0.015 * cp * t
    rt = (
        -2
        * math.sqrt(cp**7 / (cp**7 + 25**7))
        * math.sin(math.radians(60 * math.exp(-(((hp - 275) / 25) ** 2))))
    )
    return math.sqrt((dlp / sl) ** 2 + (dcp / sc) ** 2 + (dH / sh) ** 2 + rt * (dcp / sc) * (dH / sh))


@lru_cache(maxsize=65536)
def delta_e(colour1: Any, colour2: Any) -> float:
    """ΔE00 between two Matplotlib colours (names or tuples: hashable)."""
    return ciede2000(lab(colour1), lab(colour2))


def shade(colour: Any, fraction: float) -> tuple[float, float, float, float]:
    """``colour`` mixed with white (fraction > 0) or black (< 0)."""
    from matplotlib.colors import to_rgba

    r, g, b, a = to_rgba(colour)
    target = 1.0 if fraction > 0 else 0.0
    return tuple(c + abs(fraction) * (target - c) for c in (r, g, b)) + (a,)


def palette(hue: Any) -> list[tuple[float, float, float, float]]:
    """The hue and up to :data:`MAX_SHADES` - 1 shades of it, alternately darker and lighter, each
    the least mix at least :data:`MIN_DELTA_E` from the shades before it, :data:`MIN_FROM_WHITE`
    from white and :data:`MIN_FROM_BLACK` from black."""
    shades = [shade(hue, 0.0)]
    sides = [-1, 1]
    while len(shades) < MAX_SHADES and sides:
        side = sides.pop(0)
        for f in FRACTIONS:
            candidate = shade(hue, side * f)
            if (
                delta_e(candidate, "white") >= MIN_FROM_WHITE
                and delta_e(candidate, "black") >= MIN_FROM_BLACK
                and all(delta_e(candidate, s) >= MIN_DELTA_E for s in shades)
            ):
                shades.append(candidate)
                sides.append(side)
                break
    return shades


def family_hues(families: list[str]) -> dict[str, Any]:
    """Each family's hue: its own (:data:`FAMILY_COLOURS`), else the next spare one at least
    :data:`MIN_DELTA_E` from every hue taken and the controls' grey (the next spare one at all when
    none is)."""
    hue = {f: FAMILY_COLOURS[f] for f in families if f in FAMILY_COLOURS}
    spare = list(SPARE_COLOURS)
    for family in families:
        if family in hue:
            continue
        taken = [*hue.values(), CONTROL_COLOUR]
        far = [c for c in spare if all(delta_e(c, t) >= MIN_DELTA_E for t in taken)]
        hue[family] = (far or spare or list(SPARE_COLOURS))[0]
        if hue[family] in spare:
            spare.remove(hue[family])
    return hue


def _apart(style: tuple[Any, str], other: tuple[Any, str]) -> bool:
    """Told apart: other outlines (:data:`OUTLINES`), or colours :data:`MIN_DELTA_E` apart."""
    return (
        OUTLINES.get(style[1], style[1]) != OUTLINES.get(other[1], other[1])
        or delta_e(style[0], other[0]) >= MIN_DELTA_E
    )


def row_styles(
    rows: list[dict[str, Any]], axes: list[list[str]] | None = None
) -> dict[str, tuple[tuple[float, ...], str]]:
    """{row label: (colour, marker)}: the family's next distinguishable pair (the module's rules);
    ``axes``: the labels on each axis of the plot (one axis of every row when not given)."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    axes = axes if axes is not None else [labels]
    neighbours = {label: set() for label in labels}
    for members in axes:
        for label in members:
            neighbours.setdefault(label, set()).update(m for m in members if m != label)
    families = list(dict.fromkeys(r["family"] for r in rows if not r.get("control")))
    hues = family_hues(families)
    pairs: dict[str, list[tuple[Any, str]]] = {}  # family -> its (colour, marker) pairs, in order
    for family in ["control", *families]:
        shades, markers = (
            palette(CONTROL_COLOUR if family == "control" else hues[family]),
            (CONTROL_MARKERS if family == "control" else MARKERS),
        )
        pairs[family] = [
            (shades[(t % len(markers) + t // len(markers)) % len(shades)], markers[t % len(markers)])
            for t in range(len(markers) * len(shades))
        ]
    start: dict[str, int] = {}
    styles: dict[str, tuple[tuple[float, ...], str]] = {}
    for row in rows:
        label = row["label"]
        if label in styles:
            continue
        family = "control" if row.get("control") else row["family"]
        own, first = pairs[family], start.get(family, 0)
        order = [(first + k) % len(own) for k in range(len(own))]
        near = [styles[n] for n in neighbours.get(label, ()) if n in styles]
        tiers = (
            lambda s: all(_apart(s, o) for o in styles.values()),
            lambda s, near=near: all(_apart(s, o) for o in near) and s not in styles.values(),
            lambda s, near=near: all(_apart(s, o) for o in near),
        )
        t = next((t for ok in tiers for t in order if ok(own[t])), first % len(own))
        styles[label], start[family] = own[t], t + 1
    return styles
