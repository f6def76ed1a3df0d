"""Shared fixtures: every test writes its ledger and outputs under a temporary folder."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from omegaconf import open_dict

import vitexp.config as vconfig

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


def ledger_entries(results_dir: Path) -> list[dict]:
    runs = results_dir / "runs"
    return [json.loads(p.read_text()) for p in sorted(runs.glob("*.json"))] if runs.exists() else []


def cli_env(results_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["VITEXP_RESULTS"] = str(results_dir)
    env["WANDB_MODE"] = "offline"
    env["PYTHONUNBUFFERED"] = "1"
    return env
