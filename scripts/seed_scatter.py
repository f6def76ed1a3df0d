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
gaps (:func:`run_gaps`): the 14 × 14 grid's tables by default; then the family − others gap per
pretrained start and across the starts, degrees of freedom starts − 1 (:func:`start_gaps`). ``run_gaps``
is taken per table and start (:func:`rows_by_start`): a test never pools the runs of two starts.

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
            (sd_test, df), (sd_val, _) = (_seed_spread(c) for c in (cell, val))
            if n < 3 or val["n"] != n or not sd_test or not sd_val:
                continue
            ratio = sd_val / sd_test
            cells.append(
                {
                    "claim": claim["claim"],
                    "protocol": cell["protocol"],
                    "pairs": n,
                    "sd_test": sd_test,
                    "sd_val": sd_val,
                    "ratio": ratio,
                    "p_high": float(stats.f.sf(ratio**2 / image_ratio, df, df)),
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


def _seed_spread(split: dict[str, Any]) -> tuple[float | None, int]:
    """A split's spread of seeds and its degrees of freedom: the pooled std within starts (pairs − starts)
    where a cell has several shared starts, else the std of its pairs (pairs − 1)."""
    if split.get("starts", 1) > 1 and not split.get("own_starts"):
        return split["stats"]["within"], split["n"] - split["starts"]
    return split["std"], split["n"] - 1


def rows_by_start(rows: list[dict[str, Any]], start_of: Any) -> dict[str, list[dict[str, Any]]]:
    """A table's rows split by the start their runs loaded (one table may hold several starts): {start:
    the rows with only that start's seeds in their top1 and val_top1 cells}, in the order found; runs
    trained from nothing are grouped under ``none``. The runs of two starts never share a test."""
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        cells = row.get("cells") or {}
        top1 = cells.get("top1") or {}
        ids = dict(zip(sorted(top1.get("seeds") or {}), top1.get("run_ids") or []))
        seeds_of: dict[str, set] = {}
        for seed, rid in ids.items():
            seeds_of.setdefault(str(start_of(rid) or "none"), set()).add(seed)
        for start, seeds in seeds_of.items():
            kept = {
                key: {**cell, "seeds": {s: v for s, v in (cell.get("seeds") or {}).items() if s in seeds}}
                for key, cell in cells.items()
                if key in ("top1", "val_top1")
            }
            out.setdefault(start, []).append({**row, "cells": kept})
    return out


def run_gaps(rows: list[dict[str, Any]], family: str) -> dict[str, Any]:
    """Each seeded row's validation top-1 − test top-1 per seed (percentage points, the same deployed
    model), and how many runs of the rows whose experiment contains ``family`` and of the other rows
    score lower on validation than on test, with Fisher's exact test of the 2 × 2 table (two-sided); the
    two groups' mean gap, the family's minus the others' (the split dependence of a family − other
    paired difference), and the Mann–Whitney U test of the two groups' gaps (two-sided, exact for
    small groups without ties); ``splits``: each group's runs' test and validation top-1, so a gap can be
    told apart into its two splits. Every run scores the same fixed validation images, so a difference
    between the groups that every seed repeats can still be a property of those images (or of the
    start every seed shares) rather than of the method: :func:`start_gaps` compares starts."""
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


def start_gaps(
    tables: list[list[dict[str, Any]]], family: str, ledger: Ledger, skip: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The family − others gap per pretrained start (docs/verdicts.md: the start is the unit): for each
    start whose seeds the rows of ``tables`` fine-tuned, the mean validation − test gap of its runs of
    the family rows minus that of its runs of the other rows, with the start's validation draw
    (``data.split_seed``) and run counts; then across the starts, ``mean``, ``std`` (degrees of freedom:
    starts − 1) and the 95 % t interval's half-width, ``half95`` (``None`` below two starts). Starts on
    the same draw tell the start from the draw: their spread is the start's part alone. Rows whose name
    holds a string of ``skip`` are left out (rows some starts lack)."""
    start_of = protocols.start_of_run(ledger)
    per: dict[str, dict[str, Any]] = {}
    for rows in tables:
        for row in rows:
            if not row.get("experiment") or any(part in row["experiment"] for part in skip):
                continue
            cells = row.get("cells") or {}
            test, val = ((cells.get(k) or {}).get("seeds") or {} for k in ("top1", "val_top1"))
            ids = dict(zip(sorted(test), (cells.get("top1") or {}).get("run_ids") or []))
            for seed in sorted(set(test) & set(val) & set(ids)):
                start = start_of(ids[seed])
                if start is None:
                    continue
                run = ledger.get(ids[seed]) or {}
                entry = per.setdefault(
                    str(start),
                    {
                        "draw": ((run.get("config") or {}).get("data") or {}).get("split_seed"),
                        "family": [],
                        "others": [],
                    },
                )
                entry["family" if family in row["experiment"] else "others"].append(val[seed] - test[seed])
    starts = {}
    for start, entry in sorted(per.items()):
        if entry["family"] and entry["others"]:
            starts[start] = {
                "draw": entry["draw"],
                "runs": {"family": len(entry["family"]), "others": len(entry["others"])},
                "family_minus_others": _mean(entry["family"]) - _mean(entry["others"]),
            }
    values = [s["family_minus_others"] for s in starts.values()]
    k = len(values)
    sd = stats.tstd(values) if k > 1 else None
    return {
        "starts": starts,
        "n_starts": k,
        "mean": _mean(values),
        "std": sd,
        "df": k - 1,
        "half95": float(stats.t.ppf(0.975, k - 1) * sd / math.sqrt(k)) if sd is not None else None,
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
        default=["fmnist_bspf_grid14", "fmnist_bspf_grid14_split1", "fmnist_bspf_grid14_starts"],
        help="tables whose runs' validation - test gaps are listed (run_gaps)",
    )
    parser.add_argument(
        "--skip",
        nargs="*",
        default=["_tome", "_chunk"],
        help="rows left out of start_gaps (those only the first start has)",
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

    claims = protocols.evaluate(protocols.load(args.table), fill_table, protocols.start_of_run(ledger))
    test_images = len(load_fashion_mnist(args.root, data_cfg.package)["test"][1])
    image_ratio = test_images / int(data_cfg.val_size)
    report = {
        "table": args.table,
        "images": {"val": int(data_cfg.val_size), "test": test_images},
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
        **scatter(claims, image_ratio),
        "run_gaps": {
            f"{table} from {start}": run_gaps(rows, args.family)
            for table in args.gaps
            for start, rows in rows_by_start(fill_table(table), protocols.start_of_run(ledger)).items()
        },
    }
    report["start_gaps"] = {
        "tables": args.gaps,
        "left_out": args.skip,
        **start_gaps([fill_table(t) for t in args.gaps], args.family, ledger, tuple(args.skip)),
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
