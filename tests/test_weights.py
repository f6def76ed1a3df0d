"""Starting weights by tag (vitexp.config.weights): a spec row's ``weights`` key, resolved through
conf/weights.yaml from $VITEXP_WEIGHTS or timm's hub cache, never downloaded unless asked."""

from __future__ import annotations

import json

import pytest
from conftest import QUIET

from vitexp.config import weights as weights_module
from vitexp.config.rows import job_arguments

MICRO = {
    "vit_micro_start": {"file": "vit_micro_start.pth", "hub": None, "source": "a test's own file"},
    "deit_small_patch16_224.fb_in1k": weights_module.weights_map()["deit_small_patch16_224.fb_in1k"],
}


@pytest.fixture
def tags(monkeypatch):
    monkeypatch.setattr(weights_module, "weights_map", lambda: MICRO)
    return MICRO


def test_a_missing_tag_names_the_file_and_every_place_looked_in(tags, monkeypatch, tmp_path):
    monkeypatch.setenv("VITEXP_WEIGHTS", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("VITEXP_WEIGHTS_HUB", raising=False)
    with pytest.raises(FileNotFoundError) as err:
        weights_module.resolve("weights:deit_small_patch16_224.fb_in1k")
    text = str(err.value)
    assert (
        "deit_small_patch16_224-cd65a155.pth" in text
        and str(tmp_path / "deit_small_patch16_224-cd65a155.pth") in text
    )
    assert "timm/deit_small_patch16_224.fb_in1k" in text and "VITEXP_WEIGHTS_HUB=1" in text
    with pytest.raises(FileNotFoundError, match="not a tag of conf/weights.yaml"):
        weights_module.resolve("weights:no_such_tag")


def test_a_tag_resolves_in_the_weights_folder_then_in_the_hub_cache_without_a_download(
    tags, monkeypatch, tmp_path
):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("VITEXP_WEIGHTS", raising=False)
    # timm's hub cache layout (huggingface_hub): models--<org>--<name>/snapshots/<revision>/<file>
    repo = tmp_path / "hub" / "models--timm--deit_small_patch16_224.fb_in1k"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    cached = repo / "snapshots" / "abc123" / "model.safetensors"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"x")
    assert weights_module.resolve("weights:deit_small_patch16_224.fb_in1k") == str(cached)
    folder = tmp_path / "w"
    folder.mkdir()
    (folder / "deit_small_patch16_224-cd65a155.pth").write_bytes(b"x")
    monkeypatch.setenv("VITEXP_WEIGHTS", str(folder))
    assert weights_module.resolve("weights:deit_small_patch16_224.fb_in1k") == str(
        folder / "deit_small_patch16_224-cd65a155.pth"
    )


def test_a_row_trains_from_its_tag_and_is_counted_without_it(tags):
    row = {"label": "r", "experiment": "demo", "weights": "vit_micro_start"}
    assert job_arguments(row, seeded=False) == [
        "experiment=demo",
        "backbone.pretrained=weights:vit_micro_start",
        "name='demo'",
    ]
    assert job_arguments(row, seeded=False, weights=False) == ["experiment=demo"]
    assert job_arguments({**row, "weights": "run:pre"}, seeded=True)[1] == "backbone.pretrained=run:pre"
    with pytest.raises(ValueError, match="neither run:<row name> nor a tag"):
        job_arguments({**row, "weights": "deit_small"}, seeded=False)


def test_one_command_trains_a_row_from_its_tag_and_its_flops_row_ignores_the_weights(
    tags, make_cfg, results_dir, tmp_path, monkeypatch
):
    """A run loads the tag's file (the recorded config keeps the tag, so a row's fingerprint does not
    depend on the machine), fills the row's top-1, and a FLOPs count of the same row, made without
    the weights, fills its GMACs."""
    import torch

    from vitexp.commands.inspect import run_flops
    from vitexp.commands.train import train
    from vitexp.ledger import Ledger
    from vitexp.models import build_backbone
    from vitexp.report import tables

    folder = tmp_path / "weights"
    folder.mkdir()
    cfg = make_cfg(["experiment=demo", *QUIET], tmp_path / "probe")
    start = build_backbone({**cfg.backbone, "pretrained": None}, num_classes=10)
    torch.save(start.state_dict(), folder / "vit_micro_start.pth")
    monkeypatch.setenv("VITEXP_WEIGHTS", str(folder))
    row = {
        "label": "demo",
        "experiment": "demo",
        "weights": "vit_micro_start",
        "name": "demo_from_tag",
        "overrides": ["recipe.epochs=2", "recipe.warmup_epochs=0", "eval.flops=false"],
    }
    over = [a.replace("'", "") for a in job_arguments(row, seeded=False)] + QUIET
    result = train(make_cfg(over, tmp_path / "run"))
    (entry,) = [json.loads(p.read_text()) for p in (results_dir / "runs").glob("*.json")]
    assert (
        entry["config"]["backbone"]["pretrained"] == "weights:vit_micro_start"
        and "gmacs" not in entry["metrics"]
    )
    assert entry["artifacts"]["pretrained"]["weights"] == "plain"  # the file is the state dict itself
    flops_args = [a.replace("'", "") for a in job_arguments(row, seeded=False, weights=False)]
    assert not any(a.startswith("backbone.pretrained") for a in flops_args)
    run_flops(make_cfg([*flops_args, "logger=none"]))
    spec = {
        "name": "demo",
        "title": "t",
        "columns": [
            {"key": "top1", "label": "Top-1", "digits": 2},
            {"key": "gmacs", "label": "GMACs", "digits": 4},
        ],
        "rows": [row],
    }
    (filled,) = tables.fill(spec, Ledger.load(results_dir))
    assert filled["cells"]["top1"]["value"] == result["metrics"]["top1"]
    assert filled["cells"]["gmacs"]["value"] is not None  # the count made without the weights
    from vitexp.commands.evaluate import eval_config

    cfg, _ = eval_config(entry["run_id"])  # vitexp-eval keeps the tag (not a path to make local)
    assert cfg.backbone.pretrained == "weights:vit_micro_start"
    monkeypatch.setenv("VITEXP_WEIGHTS", str(tmp_path / "elsewhere"))
    from vitexp.errors import ConfigError

    with pytest.raises(ConfigError, match="vit_micro_start.pth"):
        train(make_cfg(over, tmp_path / "run2"))


def test_a_run_records_which_weight_set_of_its_pretrained_file_it_loaded(make_cfg, results_dir, tmp_path):
    """A T2T-ViT training checkpoint holding ``state_dict`` and other ``state_dict_ema`` weights,
    given as ``backbone.pretrained`` with no other override: the run starts from the EMA set (T2T-ViT's
    ``main.py --eval_checkpoint`` loads it), and its ledger entry names that set, the file's sha256 and
    the reference line that chose it; ``++backbone.use_ema=false`` starts from and names ``state_dict``."""
    import argparse
    import hashlib

    import timm
    import torch

    from vitexp.commands.train import train

    torch.manual_seed(0)
    last, ema = (timm.create_model("t2t_vit_micro", num_classes=10).state_dict() for _ in range(2))
    path = tmp_path / "t2t_vit_micro.pth.tar"
    torch.save(
        {
            "state_dict": {f"module.{k}": v for k, v in last.items()},
            "state_dict_ema": ema,
            "args": argparse.Namespace(model_ema=True),
            "epoch": 309,
        },
        path,
    )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    tiny = [
        *QUIET,
        "backbone=t2t_vit_micro",
        f"backbone.pretrained={path}",
        "data=synthetic",
        "data.num_train=16",
        "data.num_val=8",
        "data.num_test=8",
        "recipe.batch_size=8",
        "recipe.epochs=1",
        "recipe.warmup_epochs=0",
        "eval.throughput=false",
        "eval.flops=false",
        "trainer.limit_train_batches=0",
    ]
    for extra, expected in (([], "state_dict_ema"), (["++backbone.use_ema=false"], "state_dict")):
        result = train(make_cfg([*tiny, *extra], tmp_path / expected))
        entry = json.loads((results_dir / result["ledger"]).read_text())
        pretrained = entry["artifacts"]["pretrained"]
        assert (pretrained["weights"], pretrained["sha256"]) == (expected, digest), pretrained
        assert ("main.py:531" in pretrained["chosen_by"]) == (not extra), pretrained["chosen_by"]
        assert not pretrained["file"].startswith("/")
