"""The documentation: the MkDocs site in docs/ builds with ``--strict`` (every link and image
resolves, the generated tables included, scripts/mkdocs_hooks.py), and the README stays a few
screens whose test command is the one CI runs (.ci/run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(root / "mkdocs.yml"),
            "--site-dir",
            str(site),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[dev]' installs it")
    pytest.importorskip(
        "material", reason="mkdocs-material is not installed: pip install -e '.[dev]' installs it"
    )
    done = build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "results" / "index.html").is_file()
    assert not (ROOT / "site").exists(), "a build left site/ in the tree"


def test_the_readme_is_a_few_screens_and_names_ci_s_test_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 100
    ci = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    command = ci[-1]  # .ci/run ends with the README's test command
    two = readme.split("## The two commands", 1)[1].split("```")[1]
    (line,) = [line for line in two.splitlines() if "test suite" in line]
    assert line.split("#")[0].split("&&", 1)[1].strip() == command, (command, line)


def test_every_page_is_in_the_nav():
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def pages(item):
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for v in item.values():
                yield from pages(v)
        else:
            for v in item:
                yield from pages(v)

    assert set(pages(nav)) == {p.name for p in (ROOT / "docs").glob("*.md")}


def test_reading_saper_types_the_folds_paired_differences_and_intervals_of_the_committed_table():
    """docs/reading-saper.md's numbers for the fold (today's start − the folded one, k = 6): each mode's
    mean ± std is the committed fmnist_saper_table1's Δ of its folded row with the sign turned, the
    three pairs it lists have that mean and std, and the 95 % t interval it types is T975 · std / √n."""
    import math
    import re
    import statistics

    from vitexp import PROJECT_ROOT
    from vitexp.report.verdict_rule import T975

    table = (PROJECT_ROOT / "results" / "tables" / "fmnist_saper_table1.md").read_text()
    page = " ".join((PROJECT_ROOT / "docs" / "reading-saper.md").read_text().split())
    for mode, label in (("fine-tune", "SAPER fine-tune"), ("distill", "SAPER distill (k-NN)")):
        row = next(
            line for line in table.splitlines() if line.startswith(f"| {label}, k = 6, LapSum with the old")
        )
        mean, std, n = re.search(r"(-?\d+\.\d+) ± (\d+\.\d+) \((\d+)\)\s*\|\s*$", row).groups()
        mean, std, n = -float(mean), float(std), int(n)  # the table's Δ is folded − today's
        assert f"{mode} {mean:+.2f} ± {std:.2f}" in page, mode
        pairs = re.search(rf"{mode} ([−+]\d\.\d\d), ([−+]\d\.\d\d), ([−+]\d\.\d\d)\)?", page).groups()
        pairs = [float(p.replace("−", "-")) for p in pairs]
        assert len(pairs) == n and round(statistics.mean(pairs), 2) == round(mean, 2), (mode, pairs)
        assert abs(statistics.stdev(pairs) - std) < 0.01, (mode, pairs)
        half = T975[n - 2] * std / math.sqrt(n)
        assert f"± {half:.1f} ({mode})" in page, (mode, half)
