"""``WANDB_MODE`` from the environment: empty means unset, a value W&B refuses is a one-line config
error before anything starts (vitexp.runs.loggers.wandb_mode, called by vitexp.training.resolve.validate);
the
empty value is dropped from the environment only where W&B starts (build_logger)."""

from __future__ import annotations

import os

import pytest

from vitexp.errors import ConfigError
from vitexp.runs.loggers import WANDB_MODES, build_logger, wandb_mode
from vitexp.training import resolve


def test_an_empty_wandb_mode_is_unset_and_only_the_logger_clears_it(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "")
    assert wandb_mode("disabled") == "disabled"  # logger.mode decides, as with no WANDB_MODE
    assert os.environ["WANDB_MODE"] == ""  # a query leaves the environment as it is
    monkeypatch.setenv("WANDB_MODE", " ")
    logger = build_logger({"kind": "wandb", "mode": "disabled"}, "quiet", tmp_path)
    assert "WANDB_MODE" not in os.environ  # W&B's own settings would refuse the empty value
    assert logger is not False


def test_a_wandb_mode_w_and_b_refuses_names_the_valid_modes(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "ofline")
    with pytest.raises(ConfigError, match="WANDB_MODE='ofline': .*valid modes are online, offline"):
        wandb_mode(None)
    monkeypatch.setenv("WANDB_MODE", " offline ")  # W&B would refuse the padded value too
    with pytest.raises(ConfigError, match="WANDB_MODE=' offline '"):
        wandb_mode(None)
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    assert wandb_mode("online") == "offline"
    assert set(WANDB_MODES) >= {"online", "offline", "disabled"}


def test_the_config_check_refuses_a_bad_wandb_mode_before_the_run(make_cfg, monkeypatch):
    cfg = make_cfg(["logger=wandb"])
    monkeypatch.setenv("WANDB_MODE", "ofline")
    with pytest.raises(ConfigError, match="WANDB_MODE='ofline'"):
        resolve.validate(cfg, need_data=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    resolve.validate(cfg, need_data=False)
