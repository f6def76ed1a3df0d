"""Shared fixtures: every test writes its ledger and outputs under a temporary folder."""
from __future__ import annotations

import json
import os
from pathlib import Path

# Before torch is imported (vitexp imports it): the micro models' small matrices run faster on one
# thread than on two that wait on each other; the subprocesses the tests start inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
from omegaconf import open_dict  # noqa: E402

import vitexp.config as vconfig  # noqa: E402

#: Overrides that keep a test run small and quiet (no logger, no progress bar).
QUIET = ["logger=none", "trainer.enable_progress_bar=false"]


@pytest.fixture(autouse=True)
def _isolated_results(tmp_path, monkeypatch):
    monkeypatch.setenv("VITEXP_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    yield


@pytest.fixture
def results_dir(tmp_path) -> Path:
    return tmp_path / "results"


@pytest.fixture
def make_cfg(tmp_path):
    """Compose the real config tree with overrides; output_dir is a temporary folder."""

    def _make(overrides=(), output_dir: str | Path | None = None):
        cfg = vconfig.compose(list(overrides))
        with open_dict(cfg):
            cfg.output_dir = str(output_dir or tmp_path / "run")
        return cfg

    return _make


def recorded(spec: dict | None, runs: list[dict], start: str = "2026-01-01T00:00:00+00:00") -> list[dict]:
    """Stub records as vitexp records a run (the ledger matches a row's runs by their config and
    orders them by ``started``): each gets a ``started``, one second apart in the given order, unless
    it has one; one named like a row of ``spec`` that composes (the row's name, or
    ``<name>+seed=<s>``) gets that row's composed config for its seed, its own config keys on top."""
    import copy
    import datetime as dt
    import re

    from vitexp import rows as vrows

    queries = {}
    if spec is not None:
        for row in vrows.expand_rows(spec["rows"]):
            if row.get("experiment") and not row.get("cited"):
                queries.setdefault(vrows.row_name(row), vrows.row_query(spec, row))
    first = dt.datetime.fromisoformat(start)
    out = []
    for i, run in enumerate(runs):
        run = copy.deepcopy(run)
        run.setdefault("started", (first + dt.timedelta(seconds=i)).isoformat())
        name = run["experiment"]
        match = re.fullmatch(r"(.*)\+seed=(\d+)", name)
        query = queries.get(name) or (queries.get(match.group(1)) if match else None)
        if query is not None:
            seed = (run.get("config") or {}).get("seed", int(match.group(2)) if match else None)
            with vrows.composing():
                config = query.composed(seed if query.seeds is not None else None)
            if config is not None:
                run["config"] = _merged(copy.deepcopy(dict(config)), run.get("config") or {})
        out.append(run)
    return out


def config_of(name: str, seed: int | None = None, top: dict | None = None) -> dict:
    """The config a run of ``name`` records: its experiment (the name before ``+``) composed with
    ``seed`` (``None``: the experiment's own), ``top`` on top; for a name with no experiment file,
    ``{"seed": seed}`` and ``top`` (a stub, matched by name)."""
    import copy

    from vitexp import CONF_DIR
    from vitexp.rows import composed_config, composing

    base = name.split("+", 1)[0]
    config: dict = {"seed": seed}
    if (CONF_DIR / "experiment" / f"{base}.yaml").is_file():
        with composing():
            config = copy.deepcopy(composed_config((f"experiment={base}",), seed))
    return _merged(config, top or {})


def _merged(base: dict, top: dict) -> dict:
    for k, v in top.items():
        base[k] = _merged(base.get(k) if isinstance(base.get(k), dict) else {}, v) if isinstance(v, dict) else v
    return base


def ledger_entries(results_dir: Path) -> list[dict]:
    runs = results_dir / "runs"
    return [json.loads(p.read_text()) for p in sorted(runs.glob("*.json"))] if runs.exists() else []


def cli_env(results_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["VITEXP_RESULTS"] = str(results_dir)
    env["WANDB_MODE"] = "offline"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def vit_analytic_macs(
    *,
    img_size: int,
    patch_size: int,
    embed_dim: int,
    depth: int,
    mlp_ratio: float,
    num_classes: int,
    in_chans: int = 3,
    num_prefix_tokens: int = 1,
) -> int:
    """Closed-form MACs of a DeiT-layout ViT under vitexp's protocol (the reference the counter is
    checked against).

    Patch embedding P·(c·p²)·D; per block, with N = P + prefix tokens: qkv 3·N·D², attention
    Q·Kᵀ and A·V 2·N²·D, output projection N·D², MLP 2·N·D·(r·D); classifier D·C."""
    patches = (img_size // patch_size) ** 2
    n, d = patches + num_prefix_tokens, embed_dim
    hidden = int(mlp_ratio * d)
    per_block = 3 * n * d * d + 2 * n * n * d + n * d * d + 2 * n * d * hidden
    return patches * in_chans * patch_size**2 * d + depth * per_block + d * num_classes
