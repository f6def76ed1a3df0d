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
