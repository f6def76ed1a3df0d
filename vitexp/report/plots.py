"""A table's plot (``results/tables/<table>.png``): its ``plot: {x, y}`` metrics (cost against accuracy)
for every row that :func:`vitexp.report.tables.fill` filled, drawn so that methods compare.

Its reasoning: docs/tables.md, "vitexp/report/plots.py".
"""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

from vitexp.config.composition import experiment_choices
from vitexp.config.rows import row_overrides
from vitexp.report.dodge import BASE, LABELS, MARKER, MOVED_NOTE, Mark, Strips, place

# FAMILY_COLOURS: the families' hues, the plots' API too
from vitexp.report.plot_styles import FAMILY_COLOURS, row_styles  # noqa: F401
from vitexp.report.provenance import DERIVED_MARK

#: Method choice -> family (colour). Probes and k-NN of the unpruned backbone are its baseline.
METHOD_FAMILIES = {
    "baseline": "baseline",
    "probe": "baseline",
    "knn": "baseline",
    "bspf": "BSPF-ViT",
    "chunk": "chunk attention",
    "evit": "EViT",
    "tome": "ToMe",
    "saper_ft": "SAPER",
    "saper_kd": "SAPER",
    "raptor": "RAPTOR",
}
DATASET_NAMES = {
    "imagenet": "ImageNet-1K",
    "cifar100": "CIFAR-100",
    "digits": "digits (scikit-learn)",
    "fashion_mnist": "Fashion-MNIST",
    "synthetic": "synthetic",
    "coco": "COCO",
    "micro_coco": "micro COCO",
    "imagefolder": "image folder",
}
UNKNOWN = "unspecified"
#: An axis of cost ticks alone names its rows beside the ticks, up to this many.
MAX_TICK_LABELS = 10


def sweep_key(spec_row: dict[str, Any]) -> tuple[str, str]:
    """A row's experiment with its overrides but the budget ones (``budget=``, ``budget.*``), and
    those budget overrides: rows with equal keys are grid rows of one base that differ only in their
    budget (keep ratio, r, k, blocks). Experiment files that differed only in budget are such rows
    (tests/test_spec_rows.py), so no file is read."""
    others, budget = [], {}
    for override in row_overrides(spec_row):
        key, _, value = override.lstrip("+~").partition("=")
        if key == "budget" or key.startswith("budget."):
            budget[key] = value
        else:
            others.append(override)
    return json.dumps([spec_row["experiment"], sorted(others)]), json.dumps(budget, sort_keys=True)


def row_identity(spec_row: dict[str, Any]) -> dict[str, str]:
    """A spec row's family, backbone and dataset: the row's own keys, else its experiment's choices."""
    experiment = spec_row.get("experiment")
    choices = dict(experiment_choices(experiment)) if experiment else {}
    selection = None  # set by a row's override (no experiment file sets method.selection)
    for override in row_overrides(spec_row):  # a row's overrides change its experiment's choices
        key, _, value = override.lstrip("+~").partition("=")
        if "." not in key:
            choices[key] = value
        elif key == "method.selection":
            selection = value
    family = METHOD_FAMILIES.get(choices.get("method", ""), choices.get("method"))
    if selection and selection != "lapsum":
        family = f"heads: {selection}"
    return {
        "family": spec_row.get("family") or family or spec_row.get("label", UNKNOWN),
        "backbone": spec_row.get("backbone") or choices.get("backbone") or UNKNOWN,
        "dataset": spec_row.get("dataset") or choices.get("data"),
    }


def sweeps(spec_rows: list[dict[str, Any]]) -> list[str | None]:
    """Each row's sweep: its ``series``, else the shared :func:`sweep_key` of two or more rows
    whose budgets differ; ``None`` for a row in no sweep."""
    pairs = [
        None if r.get("series") or r.get("cited") or not r.get("experiment") else sweep_key(r)
        for r in spec_rows
    ]
    budgets: dict[str, set[str]] = {}
    for pair in pairs:
        if pair is not None:
            budgets.setdefault(pair[0], set()).add(pair[1])
    auto = {k: f"sweep {i + 1}" for i, k in enumerate(k for k, b in budgets.items() if len(b) > 1)}
    return [r.get("series") or (auto.get(p[0]) if p else None) for r, p in zip(spec_rows, pairs)]


def series_curves(
    rows: list[dict[str, Any]], xk: str, yk: str
) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Rows that share a ``series``: their vitexp and paper points, by x, one curve each where
    there are at least two points."""
    curves: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for row in rows:
        if not row.get("series"):
            continue
        x, y = row["cells"][xk], row["cells"][yk]
        for source, key in (("vitexp", "value"), ("paper", "paper")):
            if x[key] is not None and y[key] is not None:
                curves.setdefault(row["series"], {}).setdefault(source, []).append((x[key], y[key]))
    return {
        name: {src: sorted(pts) for src, pts in by.items() if len(pts) >= 2} for name, by in curves.items()
    }


def plot_rows(spec: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The filled rows with their family, backbone, dataset, sweep (as ``series``), ``panel`` and
    ``control``."""
    identities = [row_identity(r) for r in spec["rows"]]
    common = Counter(i["dataset"] for i in identities if i["dataset"]).most_common(1)
    fallback = common[0][0] if common else UNKNOWN
    return [
        {
            **row,
            **ident,
            "dataset": ident["dataset"] or fallback,
            "series": series,
            "panel": spec_row.get("panel"),
            "control": bool(spec_row.get("control")),
        }
        for row, spec_row, ident, series in zip(rows, spec["rows"], identities, sweeps(spec["rows"]))
    ]


def axis_panels(rows: list[dict[str, Any]]) -> dict[tuple[str, str | None], list[dict[str, Any]]]:
    """The plot's axes, in the order rows first name them: one per dataset, split further by the
    rows' ``panel`` (rows whose accuracies are not comparable, such as SAPER's linear-probe and
    k-NN rows, go on separate axes). A row without a ``panel`` is drawn on every panel of its
    dataset (a shared reference point), or on its dataset's own axis when no row there has one."""
    keys = list(dict.fromkeys((r["dataset"], r.get("panel")) for r in rows)) or [(UNKNOWN, None)]
    named = [k for k in keys if k[1] is not None]
    keys = [k for k in keys if k[1] is not None or not any(n[0] == k[0] for n in named)]
    return {
        (dataset, panel): [r for r in rows if r["dataset"] == dataset and r.get("panel") in (panel, None)]
        for dataset, panel in keys
    }


def _axis_label(col: dict[str, Any]) -> str:
    """The label with the unit's short form ("Top-1 (%)"; "GMACs (32 px)" on a GMACs column is
    "GMACs"); the unit in full is in the table files."""
    unit = str(col.get("unit", "")).split(" (")[0].split(";")[0].strip()
    if len(unit) > 12:
        unit = unit.split()[0]
    return col["label"] if not unit or unit == col["label"] else f"{col['label']} ({unit})"


def _draw_axis(
    ax,
    rows: list[dict[str, Any]],
    xk: str,
    yk: str,
    style: dict[str, tuple[Any, str]],
    used: set[str],
    strips: Strips,
) -> list[Mark]:
    """One dataset's points, sweeps, and rows with one value in ``strips``; ``used`` collects the
    value kinds drawn. The rows' markers, in drawing order, for :func:`vitexp.report.dodge.separate`."""
    from matplotlib.ticker import MaxNLocator
    from matplotlib.transforms import ScaledTranslation

    ticks, accuracy_ticks, used_here, marks = [], [], set(), []
    for row in rows:
        colour, marker = style[row["label"]]
        x, y = row["cells"][xk], row["cells"][yk]
        if x["value"] is not None and y["value"] is not None:
            bars = ax.errorbar(
                x["value"],
                y["value"],
                xerr=x.get("std") or None,
                yerr=y.get("std") or None,
                fmt=marker,
                color=colour,
                mfc="none" if row.get("control") else colour,
                mec=colour,
                mew=1.5,
                ms=6,
                capsize=2.5,
                elinewidth=1,
                zorder=3,
            )
            bars.lines[0].set_gid(f"vitexp:{row['label']}")
            marks.append(Mark(row["label"], "point", [bars.lines[0], *bars.lines[1], *bars.lines[2]]))
            used_here |= {"vitexp", "std"} if y.get("std") or x.get("std") else {"vitexp"}
        elif x["value"] is not None:
            ticks.append(("vitexp", x["value"], row))
        elif y["value"] is not None:
            accuracy_ticks.append(("vitexp", y["value"], row))
        if x["paper"] is not None and y["paper"] is not None:
            marks.append(
                Mark(
                    row["label"],
                    "point",
                    ax.plot(
                        [x["paper"]],
                        [y["paper"]],
                        marker=marker,
                        ls="none",
                        mfc="none",
                        mec=colour,
                        mew=1.3,
                        ms=7,
                        zorder=3,
                        gid=f"paper:{row['label']}",
                    ),
                )
            )
            used_here.add("paper")
            if x.get("formula") or y.get("formula"):
                marks[-1].notes.append(
                    ax.annotate(
                        DERIVED_MARK,
                        (x["paper"], y["paper"]),
                        xytext=(4, 2),
                        textcoords="offset points",
                        fontsize=7,
                        color=colour,
                    )
                )
        elif x["paper"] is not None:
            ticks.append(("paper", x["paper"], row))
        elif y["paper"] is not None:
            accuracy_ticks.append(("paper", y["paper"], row))
    for name, by_source in series_curves(rows, xk, yk).items():
        colour = style[next(r["label"] for r in rows if r["series"] == name)][0]
        for source, points in by_source.items():
            ax.plot(
                *zip(*points),
                color=colour,
                lw=1.1,
                ls="-" if source == "vitexp" else "--",
                zorder=2,
                gid=f"sweep-{source}:{name}",
            )
            used_here.add("sweep")
    for source, value, row in accuracy_ticks:  # an accuracy without its cost: in the no-cost strip
        colour, marker = style[row["label"]]
        strip = strips.get("left")
        marks.append(
            Mark(
                row["label"],
                "ytick",
                strip.plot(
                    [BASE],
                    [value],
                    marker=marker,
                    ls="none",
                    ms=MARKER,
                    clip_on=False,
                    mfc=colour if source == "vitexp" else "none",
                    mec=colour,
                    mew=1.2,
                    zorder=4,
                    gid=f"ytick-{source}:{row['label']}",
                ),
            )
        )
        used_here.add(f"ytick_{source}")
        if source == "paper" and row["cells"][yk].get("formula"):
            marks[-1].notes.append(
                strip.annotate(
                    DERIVED_MARK,
                    (BASE, value),
                    xytext=(6, 2),
                    textcoords="offset points",
                    fontsize=7,
                    color=colour,
                )
            )
    has_points = bool(used_here & {"vitexp", "paper", "ytick_vitexp", "ytick_paper"})
    only_ticks = bool(ticks) and not has_points
    up = ScaledTranslation(0, BASE / 72.0, ax.figure.dpi_scale_trans)
    for source, value, row in ticks:  # a cost without its accuracy: in the cost-only strip
        colour, marker = style[row["label"]]
        on, y, where = (
            (ax, 0.0, {"transform": ax.get_xaxis_transform()})
            if only_ticks  # costs alone: on the axis
            else (strips.get("bottom"), BASE, {})
        )
        marks.append(
            Mark(
                row["label"],
                "xtick",
                on.plot(
                    [value],
                    [y],
                    **where,
                    marker=marker,
                    ls="none",
                    ms=MARKER,
                    clip_on=False,
                    mfc=colour if source == "vitexp" else "none",
                    mec=colour,
                    mew=1.2,
                    zorder=4,
                    gid=f"tick-{source}:{row['label']}",
                ),
            )
        )
        if (
            only_ticks
        ):  # BASE points above the axis's foot (its cost counted in the limits first), whole inside it
            marks[-1].artists[0].set_transform(marks[-1].artists[0].get_transform() + up)
        used_here.add(f"tick_{source}")
        if source == "paper" and row["cells"][xk].get("formula"):  # a cost obtained by arithmetic
            marks[-1].notes.append(
                on.annotate(
                    DERIVED_MARK,
                    (value, y),
                    xycoords=where.get("transform", "data"),
                    xytext=(4, 2 + (BASE if only_ticks else 0)),
                    textcoords="offset points",
                    fontsize=7,
                    color=colour,
                )
            )
        if only_ticks and len(ticks) <= MAX_TICK_LABELS:
            marks[-1].notes.append(
                ax.annotate(
                    row["label"],
                    (value, 0.0),
                    xycoords=ax.get_xaxis_transform(),
                    xytext=(0, BASE + 8),
                    textcoords="offset points",
                    rotation=90,
                    fontsize=6,
                    ha="center",
                    va="bottom",
                    color=colour,
                )
            )
    if only_ticks:
        ax.set_yticks([])
        ax.set_ylim(0, 1)
        ax.set_ylabel(f"{LABELS['bottom']}: {ax.get_ylabel()} not measured yet", fontsize=8)
    if not ticks and not has_points:
        ax.text(
            0.5, 0.5, "no row has a value yet (not run)", ha="center", va="center", transform=ax.transAxes
        )
        ax.set_xticks([])
        ax.set_yticks([])
    else:
        ax.xaxis.set_major_locator(MaxNLocator(5))
    used |= used_here
    return marks


#: Legend entries of the value kinds: (key in ``used``, label, marker, filled, line style).
KINDS = (
    ("vitexp", "vitexp (measured)", "o", True, "none"),
    ("paper", "paper", "o", False, "none"),
    ("sweep", "sweep (solid: vitexp, dashed: paper)", "", False, "-"),
    ("tick_vitexp", "in the 'cost only' strip: vitexp's cost (no accuracy yet)", "o", True, "none"),
    ("tick_paper", "in the 'cost only' strip: the paper's cost (no accuracy given)", "o", False, "none"),
    ("ytick_vitexp", "in the 'no cost given' strip: vitexp's accuracy", "o", True, "none"),
    ("ytick_paper", "in the 'no cost given' strip: the paper's accuracy", "o", False, "none"),
)


def _legend_handles(
    rows: list[dict[str, Any]], xk: str, yk: str, style: dict[str, tuple[Any, str]], used: set[str]
):
    """Every row on the plot by its label (in its colour and marker; hollow for a control or a row
    with paper values only; its seeds when fewer than asked, :func:`seeds_note`), then the value
    kinds drawn."""
    from matplotlib.lines import Line2D

    drawn = list(
        {
            r["label"]: r
            for r in rows
            if any(r["cells"][k][v] is not None for k in (xk, yk) for v in ("value", "paper"))
        }.values()
    )
    handles = []
    for r in drawn:
        colour, marker = style[r["label"]]
        measured = any(r["cells"][k]["value"] is not None for k in (xk, yk))
        label = (
            "control: " if r.get("control") and not r["label"].lower().startswith("control") else ""
        ) + r["label"]
        label += seeds_note(r, xk, yk)
        handles.append(
            Line2D(
                [],
                [],
                marker=marker,
                ls="none",
                color=colour,
                mec=colour,
                mew=1.3,
                mfc=colour if measured and not r.get("control") else "none",
                label="\n".join(textwrap.wrap(label, LEGEND_WIDTH, break_on_hyphens=False)),
            )
        )
    std = " ± 1 std over seeds" if "std" in used else ""
    handles += [
        Line2D(
            [],
            [],
            marker=m or None,
            ls=ls,
            color="0.35",
            mfc="0.35" if filled else "none",
            label=label + (std if key == "vitexp" else ""),
        )
        for key, label, m, filled, ls in KINDS
        if key in used
    ]
    return handles


def seeds_note(row: dict[str, Any], xk: str, yk: str) -> str:
    """The legend's ' (1 of 3 seeds)' after a seeded row whose plotted values are over fewer seeds
    than it asks for (the fewest of its two cells); '' otherwise."""
    cells = [
        row["cells"][k]
        for k in (xk, yk)
        if row["cells"][k]["value"] is not None and row["cells"][k].get("expected")
    ]
    n = min((c.get("n") or 0 for c in cells), default=None)
    expected = max((c["expected"] for c in cells), default=None)
    return f" ({n} of {expected} seeds)" if cells and n < expected else ""


#: Characters per line of a row's name in the legend.
LEGEND_WIDTH = 48


def _measured(members: list[dict[str, Any]], xk: str, yk: str) -> bool:
    return any(r["cells"][xk]["value"] is not None and r["cells"][yk]["value"] is not None for r in members)


def _anything(members: list[dict[str, Any]], xk: str, yk: str) -> bool:
    """A measured point or a paper value (cost ticks alone do not count)."""
    return _measured(members, xk, yk) or any(
        r["cells"][k]["paper"] is not None for r in members for k in (xk, yk)
    )


def draw(spec: dict[str, Any], rows: list[dict[str, Any]], notes: list[str] = ()):
    """The figure: one axis per dataset and panel (:func:`axis_panels`) with its strips, the legend
    right of them, the notes under them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xk, yk = spec["plot"]["x"], spec["plot"]["y"]
    cols = {c["key"]: c for c in spec["columns"]}
    rows = plot_rows(spec, rows)
    panels = axis_panels(rows)
    style = row_styles(
        rows, [[r["label"] for r in members] for members in panels.values()]
    )  # before panels drop
    if len(panels) > 1 and any(_anything(m, xk, yk) for m in panels.values()):
        panels = {k: m for k, m in panels.items() if _anything(m, xk, yk)}
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), dpi=120, squeeze=False)
    used: set[str] = set()
    marks: list[Mark] = []
    strips: list[Strips] = []
    for ax, ((dataset, panel), members) in zip(axes[0], panels.items()):
        name = DATASET_NAMES.get(dataset, dataset)
        title = f"{name}: {panel}" if panel else name
        if not _measured(members, xk, yk):
            title += f"\n(not run: no measured {cols[yk]['label'].lower()} yet)"
        ax.set_title(title, fontsize=8)
        ax.set_xlabel(_axis_label(cols[xk]), fontsize=8)
        ax.set_ylabel(_axis_label(cols[yk]), fontsize=8)
        strips.append(Strips(ax))
        marks += _draw_axis(ax, members, xk, yk, style, used, strips[-1])
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle("\n".join(textwrap.wrap(spec["title"], 90)), fontsize=9)
    place(fig, strips, marks)  # before the legend (outside the axes; savefig's tight box takes it in): the
    # final layout, markers that would hide each other set apart, axes widened until none is cut
    if any(m.moved and m.kind == "point" for m in marks):
        notes = [*notes, MOVED_NOTE]
    handles = _legend_handles([r for m in panels.values() for r in m], xk, yk, style, used)
    below = -0.01
    if handles:
        legend = axes[0][-1].legend(
            handles=handles,
            fontsize=6.5,
            loc="upper left",
            bbox_to_anchor=(1.02, 1.0),
            borderaxespad=0.0,
            frameon=False,
            ncol=2 if len(handles) > 16 else 1,
        )
        fig.canvas.draw()  # the legend's extent: notes go under it when it reaches below the axes
        below = min(below, legend.get_window_extent().transformed(fig.transFigure.inverted()).y0 - 0.02)
    if (
        notes
    ):  # under the axes and the legend, wrapped to the figure's width; savefig's tight box takes them in
        width = int(fig.get_size_inches()[0] * 22 + 30)
        fig.text(
            0.01, below, "\n".join(textwrap.fill(n, width) for n in notes), fontsize=7, ha="left", va="top"
        )
    return fig


def render_plot(spec: dict[str, Any], rows: list[dict[str, Any]], path: Path, notes: list[str] = ()) -> bool:
    """Write the plot of a spec with ``plot: {x, y}`` to ``path``; False (nothing written) without one."""
    if not spec.get("plot"):
        return False
    fig = draw(spec, rows, notes)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    fig.savefig(path, bbox_inches="tight", pad_inches=0.08, format="png")
    plt.close(fig)
    return True
