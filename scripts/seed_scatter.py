"""How much a verdict table's paired differences scatter across seeds on the validation split against
the test split, cell by cell (default ``fmnist_bspf_protocols``), and whether the largest ratio is
more than chance among that many cells.

Why: on the 14 × 14 grid BSPF-ViT − EViT's seeds scatter about 4.5 times as much on validation as on
test. A seed's difference on a fixed split moves with the images its two models disagree on; if that
disagreement were independent from image to image, its variance across seeds would scale with one
over the split's images, so validation (5,000 images) would scatter √2 as much as test (10,000); a
part that moves every image alike (one model better overall) scatters equally on both, so the
expected ratio lies between 1 and √(n_test / n_val). What is reported, for every counted cell with
the same n ≥ 3 pairs on both splits (reference protocols left out, as in the verdicts):

- ``ratio``: sd_val / sd_test of the pairs (the table's ± of each split);
- ``p_high``: P(F ≥ ratio² / (n_test / n_val)) under F(n − 1, n − 1), the chance that two sample
  variances of n pairs differ this much or more when the true ratio is the top of the expected range
  (conservative for a ratio that is too large; it treats the two splits' pairs as independent);
- over the cells: the geometric mean ratio, and the chance that the smallest ``p_high`` of k cells is
  at most the observed one, 1 − (1 − p_min)^k (cells treated as independent: they share runs, so
  this is a rough guide).

And, for the tables ``--gaps`` names, each run's validation − test top-1 and how many runs of the
BSPF family (``--family``) and of the other rows score lower on validation, and the two groups' mean
gaps (:func:`run_gaps`): ``fmnist_bspf_grid14`` and ``fmnist_bspf_grid14_split1`` (a second validation
draw) by default, and for two tables the change of the family − others gap from one draw to the
other over the rows both have (:func:`draw_contrast`).

Writes ``results/analysis/<table>_seed_scatter.json`` (atomically) from the committed ledger;
seconds.

    python scripts/seed_scatter.py [--table fmnist_bspf_protocols] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from scipy import stats

from vitexp import PROJECT_ROOT
from vitexp.data.fashion_mnist import load_fashion_mnist
from vitexp.ledger import Ledger, atomic_write_json, default_results_dir
from vitexp.report import protocols
from vitexp.report.tables import fill, load_spec


def scatter(claims: list[dict[str, Any]], image_ratio: float) -> dict[str, Any]:
    """The module docstring's report from :func:`vitexp.report.protocols.evaluate`'s claims; ``image_ratio``:
    n_test / n_val."""
    cells = []
    for claim in claims:
        for cell in claim["cells"]:
            val = cell.get("val")
            if cell.get("reference") or cell["sign"] is None or not val:
                continue
            n = cell["n"]
            if n < 3 or val["n"] != n or not cell["std"] or not val["std"]:
                continue
            ratio = val["std"] / cell["std"]
            cells.append(
                {
                    "claim": claim["claim"],
                    "protocol": cell["protocol"],
                    "pairs": n,
                    "sd_test": cell["std"],
                    "sd_val": val["std"],
                    "ratio": ratio,
                    "p_high": float(stats.f.sf(ratio**2 / image_ratio, n - 1, n - 1)),
                }
            )
    if not cells:
        return {"cells": [], "expected_ratio": [1.0, math.sqrt(image_ratio)]}
    p_min = min(c["p_high"] for c in cells)
    largest = max(cells, key=lambda c: c["ratio"])
    return {
        "cells": cells,
        "expected_ratio": [1.0, math.sqrt(image_ratio)],
        "geometric_mean_ratio": math.exp(sum(math.log(c["ratio"]) for c in cells) / len(cells)),
        "cells_over_expected": sum(c["ratio"] > math.sqrt(image_ratio) for c in cells),
        "cells_under_1": sum(c["ratio"] < 1 for c in cells),
        "largest": {k: largest[k] for k in ("claim", "protocol", "ratio", "p_high")},
        "p_min": p_min,
        "p_min_of_k": 1.0 - (1.0 - p_min) ** len(cells),
    }


def run_gaps(rows: list[dict[str, Any]], family: str) -> dict[str, Any]:
    """Each seeded row's validation top-1 − test top-1 per seed (percentage points, the same deployed
    model), and how many runs of the rows whose experiment contains ``family`` and of the other rows
    score lower on validation than on test, with Fisher's exact test of the 2 × 2 table (two-sided); the
    two groups' mean gap, the family's minus the others' (the split dependence of a family − other
    paired difference), and the Mann–Whitney U test of the two groups' gaps (two-sided, exact for
    small groups without ties); ``splits``: each group's runs' test and validation top-1, so a gap can be
    told apart into its two splits. Every run scores the same fixed validation images, so a difference
    between the groups that every seed repeats can still be a property of those images (or of the
    start every seed shares) rather than of the method: a second draw, :func:`draw_contrast`."""
    out: dict[str, Any] = {"family": family, "rows": {}}
    counts = {True: [0, 0], False: [0, 0]}  # in family: [lower on validation, not lower]
    groups: dict[bool, list[float]] = {True: [], False: []}
    splits: dict[bool, dict[str, list[float]]] = {g: {"test": [], "val": []} for g in (True, False)}
    for row in rows:
        test, val = (((row.get("cells") or {}).get(k) or {}).get("seeds") or {} for k in ("top1", "val_top1"))
        seeds = sorted(set(test) & set(val))
        if not seeds:
            continue
        gaps = {str(seed): val[seed] - test[seed] for seed in seeds}
        out["rows"][row["experiment"]] = gaps
        for gap in gaps.values():
            counts[family in row["experiment"]][0 if gap < 0 else 1] += 1
            groups[family in row["experiment"]].append(gap)
        for seed in seeds:
            splits[family in row["experiment"]]["test"].append(test[seed])
            splits[family in row["experiment"]]["val"].append(val[seed])
    table = [counts[True], counts[False]]
    out["lower_on_val"] = {"family": table[0], "others": table[1], "order": ["lower", "not lower"]}
    out["fisher_p"] = float(stats.fisher_exact(table).pvalue) if all(sum(r) for r in table) else None
    both = groups[True] and groups[False]
    out["gaps"] = {"family": groups[True], "others": groups[False]}
    out["splits"] = {"family": splits[True], "others": splits[False]}
    out["mean_gap"] = {"family": _mean(groups[True]), "others": _mean(groups[False])}
    out["family_minus_others"] = out["mean_gap"]["family"] - out["mean_gap"]["others"] if both else None
    out["mannwhitney_p"] = (
        float(stats.mannwhitneyu(groups[True], groups[False], alternative="two-sided").pvalue)
        if both
        else None
    )
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _welch(family: list[float], others: list[float]) -> dict[str, float]:
    """mean(family) − mean(others), its Welch standard error and the parts ``s²/n`` that
    Welch–Satterthwaite's degrees of freedom are made of."""
    parts = [(stats.tvar(g) / len(g), len(g) - 1) for g in (family, others)]
    return {
        "difference": sum(family) / len(family) - sum(others) / len(others),
        "se": math.sqrt(sum(v for v, _ in parts)),
        "parts": parts,
    }


def _satterthwaite(parts: list[tuple[float, int]]) -> float:
    """Welch–Satterthwaite degrees of freedom of a sum of independent ``s²/n`` terms (each with its df)."""
    return sum(v for v, _ in parts) ** 2 / sum(v * v / df for v, df in parts)


def draw_contrast(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any] | None:
    """Whether two :func:`run_gaps` of the same rows on two validation draws show the same family −
    others gap: each draw's difference with its Welch standard error (from its runs' gaps), the change
    from the first draw to the second, ``t`` = change / √(se₁² + se₂²) with Welch–Satterthwaite degrees of
    freedom over the four groups and its two-sided p; ``by_split``: the same family − others
    difference of each draw on test alone and on validation alone (the test images are the same in both
    draws, the validation images are not), which says on which split the gap changed (no standard error:
    the groups' rows differ in level, so a spread over their runs would not be one). A second draw
    changes the start too (a start is pretrained without its validation images), so the change it
    measures is the first draw's images and start together against the method. ``None`` while either
    draw lacks two runs in each group."""
    if any(len(g) < 2 for gaps in (first, second) for g in gaps["gaps"].values()):
        return None
    welch = [_welch(gaps["gaps"]["family"], gaps["gaps"]["others"]) for gaps in (first, second)]
    draws = [
        {"family_minus_others": w["difference"], "se": w["se"], "df": _satterthwaite(w["parts"])}
        for w in welch
    ]
    change = draws[1]["family_minus_others"] - draws[0]["family_minus_others"]
    se = math.hypot(draws[0]["se"], draws[1]["se"])
    df = _satterthwaite(welch[0]["parts"] + welch[1]["parts"])
    by_split = {
        split: [
            {
                "difference": _welch(gaps["splits"]["family"][split], gaps["splits"]["others"][split])[
                    "difference"
                ]
            }
            for gaps in (first, second)
        ]
        for split in ("test", "val")
    }
    return {
        "draws": draws,
        "change": change,
        "se": se,
        "t": change / se,
        "df": df,
        "p": float(2 * stats.t.sf(abs(change / se), df)),
        "by_split": by_split,
    }


def main() -> None:
    data_cfg = OmegaConf.load(PROJECT_ROOT / "conf" / "data" / "fashion_mnist.yaml")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", default="fmnist_bspf_protocols", help="a verdict file of sweeps/verdicts/")
    parser.add_argument("--root", default=data_cfg.root)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--gaps",
        nargs="*",
        default=["fmnist_bspf_grid14", "fmnist_bspf_grid14_split1"],
        help="tables whose runs' validation - test gaps are listed (run_gaps)",
    )
    parser.add_argument(
        "--infix",
        default="_split1",
        help="what the second --gaps table adds to the names of the first's rows it repeats",
    )
    parser.add_argument(
        "--family", default="bspf", help="experiments containing this form run_gaps' first group"
    )
    args = parser.parse_args()
    ledger = Ledger.load(default_results_dir())
    cache: dict[str, list[dict[str, Any]]] = {}

    def fill_table(table: str) -> list[dict[str, Any]]:
        if table not in cache:
            cache[table] = fill(load_spec(table), ledger)
        return cache[table]

    claims = protocols.evaluate(protocols.load(args.table), fill_table)
    test_images = len(load_fashion_mnist(args.root, data_cfg.package)["test"][1])
    image_ratio = test_images / int(data_cfg.val_size)
    report = {
        "table": args.table,
        "images": {"val": int(data_cfg.val_size), "test": test_images},
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
        **scatter(claims, image_ratio),
        "run_gaps": {table: run_gaps(fill_table(table), args.family) for table in args.gaps},
    }
    if len(args.gaps) == 2:  # the first table's rows that the second repeats (its names without --infix)
        first, second = (fill_table(t) for t in args.gaps)
        repeated = {r["experiment"].replace(args.infix, "") for r in second if r.get("experiment")}
        same_rows = [r for r in first if r.get("experiment") in repeated]
        report["draw_contrast"] = {
            "tables": args.gaps,
            "rows": [r["experiment"] for r in same_rows],
            **(draw_contrast(run_gaps(same_rows, args.family), run_gaps(second, args.family)) or {}),
        }
    out = (
        Path(args.out)
        if args.out
        else PROJECT_ROOT / "results" / "analysis" / f"{args.table}_seed_scatter.json"
    )
    atomic_write_json(out, report)
    print(json.dumps({k: report.get(k) for k in ("geometric_mean_ratio", "largest", "p_min_of_k")}))


if __name__ == "__main__":
    main()
