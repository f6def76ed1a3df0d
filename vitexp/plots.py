"""A table's plot (``results/tables/<table>.png``): its ``plot: {x, y}`` metrics (cost against
accuracy) for every row that :func:`vitexp.tables.fill` filled, drawn so that methods compare.

Encoding (decisions):
- **Colour: the method family** (:data:`METHOD_FAMILIES` of the experiment's ``method`` choice,
  a head-selection rule other than LapSum as its own family), or the spec row's ``family:`` (cited
  rows, which have no experiment).
- **Marker: the backbone** (the experiment's ``backbone`` choice, or the row's ``backbone:``).
- **Filled: vitexp's measured value; hollow: the paper's.** A paper value derived by arithmetic
  is marked † (:data:`vitexp.provenance.DERIVED_MARK`; the footnote under the plot gives its formula).
- **Error bars:** ±1 sample std over a seeded row's seeds (:mod:`vitexp.aggregate`).
- **Sweep lines:** rows of one ``series:`` (the spec's), and otherwise rows whose experiment files
  differ only in their ``budget`` (keep ratio, r, k, blocks) and ``name``: a method's sweep. Solid
  through vitexp's points, dashed through the paper's, sorted by cost.
- **Cost without accuracy** (a ``vitexp-flops`` row, or a paper that prints only GMACs): a
  triangle on the cost axis at that cost, filled or hollow as above; an axis with nothing else
  names its rows beside the ticks. Likewise an accuracy without its cost: a triangle on the
  accuracy axis. No axis is left empty: one with no value says so.
- **One dataset per axis:** the rows' datasets (the experiment's ``data`` choice, or the row's
  ``dataset:``; a row with neither joins the table's most common dataset) each get their own
  axis, side by side.
The legend lists families, backbones and the value kinds (outside the axes, one entry each).
"""
from __future__ import annotations

import json
import textwrap
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from vitexp import CONF_DIR
from vitexp.config import experiment_choices
from vitexp.provenance import DERIVED_MARK
from vitexp.rows import row_overrides

#: Method choice -> family (colour). Probes and k-NN of the unpruned backbone are its baseline.
METHOD_FAMILIES = {"baseline": "baseline", "probe": "baseline", "knn": "baseline", "bspf": "BSPF-ViT",
                   "chunk": "chunk attention", "evit": "EViT", "tome": "ToMe", "saper_ft": "SAPER",
                   "saper_kd": "SAPER", "raptor": "RAPTOR"}
FAMILY_COLOURS = {"baseline": "0.15", "BSPF-ViT": "tab:blue", "chunk attention": "tab:cyan", "EViT": "tab:orange",
                  "ToMe": "tab:green", "SAPER": "tab:red", "RAPTOR": "tab:purple"}
#: Colours of the other families (cited methods, head-selection rules), in order of appearance.
SPARE_COLOURS = ("tab:brown", "tab:pink", "tab:olive", "tab:gray", "gold", "navy", "teal", "maroon", "lime")
#: Backbone markers; "^" and ">" are left to the ticks of a cost or an accuracy alone.
MARKERS = ("o", "s", "D", "P", "X", "*", "h", "p", "d", "H", "8", "v")
BACKBONE_NAMES = {"vit_micro": "ViT micro", "deit_tiny": "DeiT-T", "deit_small": "DeiT-S",
                  "dinov2_vits14": "DINOv2 ViT-S/14", "dinov2_vitb14": "DINOv2 ViT-B/14",
                  "dinov2_vits14_reg": "DINOv2 ViT-S/14 + registers", "dinov2_vitb14_reg": "DINOv2 ViT-B/14 + registers",
                  "dinov2_micro": "DINOv2 micro", "dinov2_micro_reg": "DINOv2 micro + registers",
                  "t2t_vit_14": "T2T-ViT-14", "t2t_vit_t_14": "T2T-ViT_t-14", "lvvit_s": "LV-ViT-S",
                  "caformer_s18": "CAFormer-S18", "t2t_vit_micro": "T2T-ViT micro", "lvvit_micro": "LV-ViT micro",
                  "caformer_micro": "CAFormer micro", "shvit_micro": "SHViT micro"}
DATASET_NAMES = {"imagenet": "ImageNet-1K", "cifar100": "CIFAR-100", "digits": "digits (scikit-learn)",
                 "fashion_mnist": "Fashion-MNIST", "synthetic": "synthetic", "coco": "COCO", "micro_coco": "micro COCO",
                 "imagefolder": "image folder"}
UNKNOWN = "unspecified"
#: An axis of cost ticks alone names its rows beside the ticks, up to this many.
MAX_TICK_LABELS = 10


@lru_cache(maxsize=None)
def _experiment_file(experiment: str) -> dict[str, Any]:
    path = CONF_DIR / "experiment" / f"{experiment}.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def sweep_key(experiment: str) -> str | None:
    """The experiment file without its ``name`` and ``budget`` (and the budget choice): experiments
    with equal keys differ only in their budget. ``None`` for a missing file."""
    cfg = dict(_experiment_file(experiment))
    if not cfg:
        return None
    cfg.pop("name", None)
    cfg.pop("budget", None)
    cfg["defaults"] = [d for d in cfg.get("defaults") or [] if not (isinstance(d, dict) and "override /budget" in d)]
    return json.dumps(cfg, sort_keys=True, default=str)


def row_identity(spec_row: dict[str, Any]) -> dict[str, str]:
    """A spec row's family, backbone and dataset: the row's own keys, else its experiment's choices."""
    experiment = spec_row.get("experiment")
    choices = dict(experiment_choices(experiment)) if experiment and _experiment_file(experiment) else {}
    selection = ((_experiment_file(experiment) if experiment else {}).get("method") or {}).get("selection")
    for override in row_overrides(spec_row):  # a row's overrides change its experiment's choices
        key, _, value = override.lstrip("+~").partition("=")
        if "." not in key:
            choices[key] = value
        elif key == "method.selection":
            selection = value
    family = METHOD_FAMILIES.get(choices.get("method", ""), choices.get("method"))
    if selection and selection != "lapsum":
        family = f"heads: {selection}"
    return {"family": spec_row.get("family") or family or spec_row.get("label", UNKNOWN),
            "backbone": spec_row.get("backbone") or choices.get("backbone") or UNKNOWN,
            "dataset": spec_row.get("dataset") or choices.get("data")}


def sweeps(spec_rows: list[dict[str, Any]]) -> list[str | None]:
    """Each row's sweep: its ``series``, else the shared :func:`sweep_key` of two or more rows
    whose budgets differ; ``None`` for a row in no sweep."""
    keys = [None if r.get("series") or r.get("cited") or not r.get("experiment") else sweep_key(r["experiment"])
            for r in spec_rows]
    budgets: dict[str, set[str]] = {}
    for r, k in zip(spec_rows, keys):
        if k is not None:
            budgets.setdefault(k, set()).add(json.dumps(_experiment_file(r["experiment"]).get("budget"), sort_keys=True))
    auto = {k: f"sweep {i + 1}" for i, k in enumerate(k for k, b in budgets.items() if len(b) > 1)}
    return [r.get("series") or auto.get(k) for r, k in zip(spec_rows, keys)]


def series_curves(rows: list[dict[str, Any]], xk: str, yk: str) -> dict[str, dict[str, list[tuple[float, float]]]]:
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
    return {name: {src: sorted(pts) for src, pts in by.items() if len(pts) >= 2} for name, by in curves.items()}


def plot_rows(spec: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The filled rows with their family, backbone, dataset, sweep (as ``series``) and ``panel``."""
    identities = [row_identity(r) for r in spec["rows"]]
    common = Counter(i["dataset"] for i in identities if i["dataset"]).most_common(1)
    fallback = common[0][0] if common else UNKNOWN
    return [{**row, **ident, "dataset": ident["dataset"] or fallback, "series": series, "panel": spec_row.get("panel")}
            for row, spec_row, ident, series in zip(rows, spec["rows"], identities, sweeps(spec["rows"]))]


def axis_panels(rows: list[dict[str, Any]]) -> dict[tuple[str, str | None], list[dict[str, Any]]]:
    """The plot's axes, in the order rows first name them: one per dataset, split further by the
    rows' ``panel`` (rows whose accuracies are not comparable, such as SAPER's linear-probe and
    k-NN rows, go on separate axes). A row without a ``panel`` is drawn on every panel of its
    dataset (a shared reference point), or on its dataset's own axis when no row there has one."""
    keys = list(dict.fromkeys((r["dataset"], r.get("panel")) for r in rows)) or [(UNKNOWN, None)]
    named = [k for k in keys if k[1] is not None]
    keys = [k for k in keys if k[1] is not None or not any(n[0] == k[0] for n in named)]
    return {(dataset, panel): [r for r in rows if r["dataset"] == dataset and r.get("panel") in (panel, None)]
            for dataset, panel in keys}


def _axis_label(col: dict[str, Any]) -> str:
    """Short units beside the label; long ones are spelled out in the table files."""
    unit = col.get("unit", "")
    return col["label"] if not unit or len(unit) > 12 or unit == col["label"] else f"{col['label']} ({unit})"


def _draw_axis(ax, rows: list[dict[str, Any]], xk: str, yk: str, style: dict[str, dict[str, str]],
               used: set[str]) -> None:
    """One dataset's points, sweeps and cost ticks; ``used`` collects the value kinds drawn."""
    from matplotlib.ticker import MaxNLocator

    ticks, accuracy_ticks, used_here = [], [], set()
    for row in rows:
        colour, marker = style["family"][row["family"]], style["backbone"][row["backbone"]]
        x, y = row["cells"][xk], row["cells"][yk]
        if x["value"] is not None and y["value"] is not None:
            bars = ax.errorbar(x["value"], y["value"], xerr=x.get("std") or None, yerr=y.get("std") or None, fmt=marker, color=colour,
                               mfc=colour, mec=colour, ms=6, capsize=2.5, elinewidth=1, zorder=3)
            bars.lines[0].set_gid(f"vitexp:{row['label']}")
            used_here |= {"vitexp", "std"} if y.get("std") or x.get("std") else {"vitexp"}
        elif x["value"] is not None:
            ticks.append(("vitexp", x["value"], row))
        elif y["value"] is not None:
            accuracy_ticks.append(("vitexp", y["value"], row))
        if x["paper"] is not None and y["paper"] is not None:
            ax.plot([x["paper"]], [y["paper"]], marker=marker, ls="none", mfc="none", mec=colour, mew=1.3, ms=7,
                    zorder=3, gid=f"paper:{row['label']}")
            used_here.add("paper")
            if x.get("formula") or y.get("formula"):
                ax.annotate(DERIVED_MARK, (x["paper"], y["paper"]), xytext=(4, 2), textcoords="offset points", fontsize=7,
                            color=colour)
        elif x["paper"] is not None:
            ticks.append(("paper", x["paper"], row))
        elif y["paper"] is not None:
            accuracy_ticks.append(("paper", y["paper"], row))
            if y.get("formula"):
                ax.annotate(DERIVED_MARK, (0.0, y["paper"]), xycoords=ax.get_yaxis_transform(), xytext=(6, 2),
                            textcoords="offset points", fontsize=7, color=style["family"][row["family"]])
    for name, by_source in series_curves(rows, xk, yk).items():
        colour = style["family"][next(r["family"] for r in rows if r["series"] == name)]
        for source, points in by_source.items():
            ax.plot(*zip(*points), color=colour, lw=1.1, ls="-" if source == "vitexp" else "--", zorder=2,
                    gid=f"sweep-{source}:{name}")
            used_here.add("sweep")
    for source, value, row in accuracy_ticks:  # an accuracy without its cost: on the accuracy axis
        colour = style["family"][row["family"]]
        ax.plot([0.0], [value], transform=ax.get_yaxis_transform(), marker=">", ls="none", ms=8, clip_on=False,
                mfc=colour if source == "vitexp" else "none", mec=colour, mew=1.2, zorder=4,
                gid=f"ytick-{source}:{row['label']}")
        used_here.add(f"ytick_{source}")
    has_points = bool(used_here & {"vitexp", "paper", "ytick_vitexp", "ytick_paper"})
    only_ticks = bool(ticks) and not has_points
    for source, value, row in ticks:
        colour = style["family"][row["family"]]
        ax.plot([value], [0.0], transform=ax.get_xaxis_transform(), marker="^", ls="none", ms=8, clip_on=False,
                mfc=colour if source == "vitexp" else "none", mec=colour, mew=1.2, zorder=4,
                gid=f"tick-{source}:{row['label']}")
        used_here.add(f"tick_{source}")
        if only_ticks and len(ticks) <= MAX_TICK_LABELS:
            ax.annotate(row["label"], (value, 0.0), xycoords=ax.get_xaxis_transform(), xytext=(0, 8),
                        textcoords="offset points", rotation=90, fontsize=6, ha="center", va="bottom", color=colour)
    if only_ticks:
        ax.set_yticks([])
        ax.set_ylim(0, 1)
        ax.set_ylabel(f"{ax.get_ylabel()}: not measured yet", fontsize=8)
    if not ticks and not has_points:
        ax.text(0.5, 0.5, "no row has a value yet (not run)", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
    else:
        ax.xaxis.set_major_locator(MaxNLocator(5))
    used |= used_here


def _styles(rows: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    families = list(dict.fromkeys(r["family"] for r in rows))
    spare = iter(SPARE_COLOURS * (1 + len(families) // len(SPARE_COLOURS)))
    backbones = list(dict.fromkeys(r["backbone"] for r in rows))
    return {"family": {f: FAMILY_COLOURS.get(f) or next(spare) for f in families},
            "backbone": {b: MARKERS[i % len(MARKERS)] for i, b in enumerate(backbones)}}


#: Legend entries of the value kinds: (key in ``used``, label, marker, filled, line style).
KINDS = (("vitexp", "vitexp (measured)", "o", True, "none"), ("paper", "paper", "o", False, "none"), ("sweep", "sweep (solid: vitexp, dashed: paper)", "", False, "-"),
         ("tick_vitexp", "cost only, vitexp (no accuracy yet)", "^", True, "none"),
         ("tick_paper", "cost only, paper", "^", False, "none"),
         ("ytick_vitexp", "accuracy only, vitexp", ">", True, "none"),
         ("ytick_paper", "accuracy only, paper (no cost given)", ">", False, "none"))


def _legend_handles(rows: list[dict[str, Any]], xk: str, yk: str, style: dict[str, dict[str, str]], used: set[str]):
    """Families and backbones of the rows on the plot, then the value kinds drawn."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    drawn = [r for r in rows if any(r["cells"][k][v] is not None for k in (xk, yk) for v in ("value", "paper"))]
    handles = [Patch(color=style["family"][f], label=f) for f in dict.fromkeys(r["family"] for r in drawn)]
    backbones = list(dict.fromkeys(r["backbone"] for r in drawn))
    handles += [Line2D([], [], marker=style["backbone"][b], ls="none", color="0.35", label=BACKBONE_NAMES.get(b, b))
                for b in backbones]
    std = " ± 1 std over seeds" if "std" in used else ""
    handles += [Line2D([], [], marker=m or None, ls=ls, color="0.35", mfc="0.35" if filled else "none",
                       label=label + (std if key == "vitexp" else "")) for key, label, m, filled, ls in KINDS if key in used]
    return handles


def draw(spec: dict[str, Any], rows: list[dict[str, Any]], notes: list[str] = ()):
    """The figure: one axis per dataset and panel (:func:`axis_panels`), the legend right of them,
    the notes under them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xk, yk = spec["plot"]["x"], spec["plot"]["y"]
    cols = {c["key"]: c for c in spec["columns"]}
    rows = plot_rows(spec, rows)
    panels = axis_panels(rows)
    style = _styles(rows)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), dpi=120, squeeze=False)
    used: set[str] = set()
    for ax, ((dataset, panel), members) in zip(axes[0], panels.items()):
        name = DATASET_NAMES.get(dataset, dataset)
        ax.set_title(f"{name}: {panel}" if panel else name, fontsize=8)
        ax.set_xlabel(_axis_label(cols[xk]), fontsize=8)
        ax.set_ylabel(_axis_label(cols[yk]), fontsize=8)
        _draw_axis(ax, members, xk, yk, style, used)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle("\n".join(textwrap.wrap(spec["title"], 90)), fontsize=9)
    fig.tight_layout()  # before the legend, which lies outside the axes; savefig's tight box takes it in
    handles = _legend_handles(rows, xk, yk, style, used)
    if handles:
        axes[0][-1].legend(handles=handles, fontsize=6.5, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                           borderaxespad=0.0, frameon=False)
    if notes:  # under the axes, wrapped to the figure's width; savefig's tight box takes them in
        width = int(fig.get_size_inches()[0] * 22 + 30)
        fig.text(0.01, -0.01, "\n".join(textwrap.fill(n, width) for n in notes), fontsize=7, ha="left", va="top")
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
