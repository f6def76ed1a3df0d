"""Per-backbone BSPF-ViT defaults live in the optional ``bspf_spec`` group keyed by the backbone
(``conf/train.yaml``: ``optional bspf_spec: ${backbone}``), not in the backbone configs. Every
experiment and every backbone composes to the method settings it had when the defaults were keys
of the backbone configs (``fixtures/bspf_method_settings.json``, captured from that code)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

import vitexp.config.composition as vconfig
from vitexp.training import resolve

CONF = Path(__file__).parents[1] / "conf"
BEFORE = json.loads((Path(__file__).parent / "fixtures" / "bspf_method_settings.json").read_text())


@functools.lru_cache(maxsize=None)
def _row_job(name: str) -> list[str] | None:
    """The job of the spec row recorded as ``name`` (the grid rows that replaced experiment files)."""
    from vitexp.config import rows
    from vitexp.report import tables

    row = tables.row_by_name(name)
    return None if row is None else rows.job_arguments(row, seeded=False, weights=False)


def _overrides(key: str) -> list[str]:
    """``experiment=x`` (an experiment file, else the job of the spec row recorded as ``x``) or
    ``backbone=b method=m`` (with the budget that method takes)."""
    if key.startswith("experiment="):
        name = key.split("=", 1)[1]
        return [key] if (CONF / "experiment" / f"{name}.yaml").is_file() else _row_job(name)
    backbone, method = key.split()
    return [backbone, method, "budget=keep_ratio" if method == "method=bspf" else "budget=none"]


def test_the_snapshot_covers_every_backbone_and_the_experiments_of_its_time():
    """Every non-SHViT backbone × {bspf, chunk} is in the snapshot, and so is every BSPF experiment
    that existed when it was captured (experiments added since are not in it and need not be), as an
    experiment file or as the spec row that replaced it."""
    experiments = {key.split("=", 1)[1] for key in BEFORE if key.startswith("experiment=")}
    assert len(experiments) >= 40
    assert all((CONF / "experiment" / f"{name}.yaml").is_file() or _row_job(name) for name in experiments)
    backbones = {p.stem for p in (CONF / "backbone").glob("*.yaml") if not p.stem.startswith("shvit")}
    assert {f"backbone={b} method={m}" for b in backbones for m in ("bspf", "chunk")} <= set(BEFORE)


@pytest.mark.slow  # a migration guard of the bspf_spec move (about 30 s on 2 loaded cores)
def test_every_experiment_composes_to_the_same_method_settings_as_before():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    changed = {}
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):  # one Hydra for all compositions
        for key, before in BEFORE.items():
            if key.endswith("method=chunk"):  # its one spec key is method=bspf's chunk_size, checked there
                continue
            after = OmegaConf.to_container(compose("train", overrides=_overrides(key)).method, resolve=True)
            if after != before:
                changed[key] = (before, after)
    assert not changed


def test_backbone_configs_describe_only_the_backbone():
    for path in sorted((CONF / "backbone").glob("*.yaml")):
        assert "bspf" not in yaml.safe_load(path.read_text()), path.name
        assert (CONF / "bspf_spec" / path.name).is_file(), f"no BSPF defaults for {path.stem}"


def test_shvit_defaults_are_read_from_its_spec():
    cfg = vconfig.compose(["backbone=shvit_s4", "method=bspf", "budget=keep_ratio"])
    assert (cfg.method.chunk_size, list(cfg.method.prune_layers)) == (16, [2, 3, 5])


def test_a_backbone_without_bspf_defaults_is_a_config_error_naming_the_file():
    cfg = vconfig.compose(
        ["backbone=vit_micro", "method=bspf", "budget=keep_ratio", "~bspf_spec", "data=synthetic"]
    )
    with pytest.raises(vconfig.ConfigError, match="conf/bspf_spec/vit_micro.yaml"):
        resolve.validate(cfg, need_data=False)
    cfg = vconfig.compose(
        [
            "backbone=vit_micro",
            "method=bspf",
            "budget=keep_ratio",
            "~bspf_spec",
            "data=synthetic",
            "method.chunk_size=16",
            "method.prune_layers=[1]",
        ]
    )
    resolve.validate(cfg, need_data=False)  # set by hand: fine


def test_choosing_other_bspf_defaults_renames_the_run():
    """``bspf_spec=<other backbone>`` (or one of its keys) changes the method: not the experiment's run."""
    cfg = vconfig.compose(["experiment=bspf_demo"])
    choices = {"experiment": "bspf_demo", "backbone": "vit_micro", "method": "bspf", "bspf_spec": "vit_micro"}
    assert vconfig.run_name(cfg, choices, ["experiment=bspf_demo"]) == "bspf_demo"
    assert (
        vconfig.run_name(
            cfg, dict(choices, bspf_spec="deit_small"), ["experiment=bspf_demo", "bspf_spec=deit_small"]
        )
        == "bspf_demo+bspf_spec=deit_small"
    )
    assert (
        vconfig.run_name(cfg, choices, ["bspf_spec.prune_layers=[2]"])
        == "bspf_demo+bspf_spec.prune_layers=[2]"
    )
