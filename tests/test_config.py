"""Composition of every experiment config, and bad input failing at composition/validation."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException

import vitexp.config.composition as vconfig
from vitexp import CONF_DIR
from vitexp.config.composition import ConfigError, run_name
from vitexp.training.resolve import validate

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
BACKBONES = sorted(p.stem for p in (CONF_DIR / "backbone").glob("*.yaml"))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates(experiment):
    cfg = vconfig.compose([f"experiment={experiment}"])
    assert cfg.name == experiment, "an experiment file must set name to its own file name"
    if str(cfg.backbone.pretrained).startswith(
        "run:"
    ):  # weights of an earlier run (test_raptor checks the error)
        cfg = vconfig.compose([f"experiment={experiment}", "backbone.pretrained=null"])
    validate(cfg, need_data=False)
    for group in ("backbone", "method", "budget", "data", "recipe", "trainer", "logger"):
        assert group in cfg


def test_default_config_is_the_demo():
    cfg = vconfig.compose([])
    assert cfg.name == "demo"
    assert (cfg.backbone.name, cfg.data.name, cfg.recipe.name, cfg.method.name) == (
        "vit_micro",
        "digits",
        "demo",
        "baseline",
    )
    validate(cfg)


def test_unknown_group_option_names_the_valid_choices():
    with pytest.raises(MissingConfigException) as err:
        vconfig.compose(["backbone=nope"])
    for choice in BACKBONES:
        assert choice in str(err.value)


def test_unknown_key_fails_at_composition():
    with pytest.raises(ConfigCompositionException, match="recipe.lrr"):
        vconfig.compose(["recipe.lrr=0.1"])


@pytest.mark.parametrize(
    "override, key",
    [
        ("recipe.epochs=0", "recipe.epochs"),
        ("recipe.lr=-1", "recipe.lr"),
        ("recipe.warmup_epochs=40", "recipe.warmup_epochs"),
        ("data.split=[0.5,0.5,0.5]", "data.split"),
        ("recipe.sched=linear", "recipe.sched"),
        ("recipe.label_smoothing=1.5", "recipe.label_smoothing"),
        ("bench.device=tpu", "bench.device"),
    ],
)
def test_out_of_range_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(vconfig.compose([override]))


@pytest.mark.parametrize("accelerator", ["cpu", "auto"])
def test_a_precision_the_cpu_does_not_run_is_refused_at_start(accelerator, monkeypatch):
    """Reproduction 9 of issue 47: trainer.precision=16-mixed on the CPU ran as bf16-mixed (Lightning's
    warning) while the ledger recorded 16-mixed. Refused before anything runs, naming what does run;
    on a GPU (accelerator auto with CUDA) it is left to run."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = vconfig.compose([f"trainer.accelerator={accelerator}", "trainer.precision=16-mixed"])
    with pytest.raises(
        ConfigError, match=r"trainer.precision=16-mixed: .*does not run on the CPU.*bf16-mixed"
    ):
        validate(cfg)
    validate(vconfig.compose([f"trainer.accelerator={accelerator}", "trainer.precision=bf16-mixed"]))
    if accelerator == "auto":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        validate(cfg)


def test_missing_dataset_root_and_checkpoint_are_named(tmp_path):
    with pytest.raises(ConfigError, match="data.root: required"):
        validate(vconfig.compose(["data=imagenet"]))
    missing = tmp_path / "no_such_imagenet"
    with pytest.raises(ConfigError, match=str(missing)):
        validate(vconfig.compose(["data=imagenet", f"data.root={missing}"]))
    ckpt = tmp_path / "deit_small.pth"
    with pytest.raises(ConfigError, match=str(ckpt)):
        validate(vconfig.compose(["backbone=deit_small", f"backbone.pretrained={ckpt}"]))


def test_use_ema_is_a_typed_backbone_key_added_with_plus_plus(tmp_path):
    """``++backbone.use_ema=true|false`` (no backbone file writes the key) is accepted, typed and
    reaches the loader. Absent, a T2T-ViT file holding both sets gives its ``state_dict_ema``, as
    T2T-ViT's ``main.py --eval_checkpoint`` loads it (``--model-ema`` defaults to true); ``false``
    gives its ``state_dict``, ``true`` the EMA weights. A non-boolean value is refused naming the key."""
    import argparse

    import timm
    import torch

    from vitexp.config.composition import check_overrides
    from vitexp.training.build import build_configured_backbone

    torch.manual_seed(0)
    plain, ema = (timm.create_model("t2t_vit_micro", num_classes=10).state_dict() for _ in range(2))
    path = tmp_path / "t2t_vit_micro.pth.tar"
    torch.save({"state_dict": plain, "state_dict_ema": ema, "args": argparse.Namespace(model_ema=True)}, path)
    base = ["backbone=t2t_vit_micro", f"backbone.pretrained={path}", "data.num_classes=10"]
    for overrides, expected in (
        (base, ema),
        ([*base, "++backbone.use_ema=false"], plain),
        ([*base, "++backbone.use_ema=true"], ema),
    ):
        cfg = vconfig.compose(overrides)
        check_overrides(cfg, overrides)
        validate(cfg, need_data=False)
        built = build_configured_backbone(cfg).state_dict()
        assert all(torch.equal(built[k], v) for k, v in expected.items()), overrides
    assert vconfig.compose(base).backbone.get("use_ema") is None  # not in the file: fingerprints unchanged
    with pytest.raises(ConfigError, match="backbone.use_ema"):
        vconfig.compose([*base, "++backbone.use_ema=maybe"])


def test_budget_kind_is_checked_against_the_method():
    cfg = vconfig.compose([])
    cfg.budget.kind = "heads"
    with pytest.raises(ConfigError, match="accepts budget kinds"):
        validate(cfg)


def built_arch(model) -> dict[str, int]:
    """depth, heads, width, patch size (stride), prefix tokens and image size read off a built model:
    a timm ViT; a MetaFormer (CaFormer) or SHViT by its first attention stage (one head for SHViT)."""
    for i, stage in enumerate(getattr(model, "stages", []) if not hasattr(model, "blocks") else []):
        block, size = stage.blocks[0], int(model.pretrained_cfg["input_size"][-1])
        shsa = getattr(getattr(block, "mixer", None), "m", None)
        if hasattr(shsa, "pdim"):  # SHViT's single-head attention
            return dict(
                depth=len(stage.blocks),
                num_heads=1,
                embed_dim=int(shsa.dim),
                patch_size=16 * 2**i,
                num_prefix_tokens=0,
                img_size=size,
            )
        mixer = getattr(block, "token_mixer", None)
        if hasattr(mixer, "num_heads"):
            return dict(
                depth=len(stage.blocks),
                num_heads=int(mixer.num_heads),
                embed_dim=int(mixer.num_heads * mixer.head_dim),
                patch_size=4 * 2**i,
                num_prefix_tokens=0,
                img_size=size,
            )
    return dict(
        depth=len(model.blocks),
        num_heads=int(model.blocks[0].attn.num_heads),
        embed_dim=int(model.embed_dim),
        patch_size=int(model.patch_embed.patch_size[0]),
        num_prefix_tokens=int(model.num_prefix_tokens),
        img_size=int(model.patch_embed.img_size[0]),
    )


@pytest.mark.parametrize("backbone", BACKBONES)
def test_backbone_arch_facts_match_the_built_model(backbone):
    import vitexp  # noqa: F401  (registers vitexp models)
    from vitexp.models import build_backbone

    cfg = vconfig.compose([f"backbone={backbone}"])
    built = built_arch(build_backbone(cfg.backbone, num_classes=10))
    expected = {
        k: int(cfg.backbone.arch[k])
        for k in ("depth", "num_heads", "embed_dim", "patch_size", "num_prefix_tokens")
    }
    assert built == {**expected, "img_size": int(cfg.backbone.img_size)}


def test_run_name_marks_command_line_changes_of_an_experiment():
    cfg = vconfig.compose(["experiment=demo", "backbone=deit_tiny"])
    choices = {
        "experiment": "demo",
        "backbone": "deit_tiny",
        "data": "digits",
        "method": "baseline",
        "budget": "none",
        "recipe": "demo",
        "trainer": "cpu",
        "logger": "none",
    }
    assert run_name(cfg, choices, ["backbone=deit_tiny", "logger=none"]) == "demo+backbone=deit_tiny"
    same = dict(choices, backbone="vit_micro")
    assert run_name(cfg, same, ["logger=none", "trainer=gpu", "data.root=/x"]) == "demo"
    assert run_name(cfg, same, ["recipe.lr=0.1"]) == "demo+recipe.lr=0.1"
    # a change the old names missed: anything but logging, paths and the like
    # (vitexp.ledger.fingerprint.EXCLUDED)
    assert (
        run_name(
            cfg,
            same,
            ["trainer.limit_train_batches=1", "trainer.enable_progress_bar=false", "logger.group=t"],
        )
        == "demo+trainer.limit_train_batches=1"
    )
    assert (
        run_name(cfg, dict(same, trainer="gpu"), ["trainer=gpu"]) == "demo+trainer=gpu"
    )  # another precision
    assert run_name(cfg, same, ["backbone.pretrained=/x.pth"]) == "demo+backbone.pretrained=/x.pth"
    # choices of the experiment's own file are not changes
    exp = {
        "experiment": "deit_small_baseline",
        "backbone": "deit_small",
        "data": "imagenet",
        "recipe": "deit_finetune",
        "method": "baseline",
        "budget": "none",
        "trainer": "gpu",
    }
    cfg2 = vconfig.compose(["experiment=deit_small_baseline"])
    assert run_name(cfg2, exp, ["experiment=deit_small_baseline", "trainer=gpu"]) == "deit_small_baseline"
    # DDP over several devices is another configuration (the global batch): vitexp-tables is given it as the
    # sweep was
    assert (
        run_name(cfg2, dict(exp, trainer="ddp"), ["experiment=deit_small_baseline", "trainer=ddp"])
        == "deit_small_baseline+trainer=ddp"
    )


def test_slurm_launcher_config_composes_with_the_trainer():
    cfg = vconfig.compose(
        [
            "hydra/launcher=slurm",
            "experiment=deit_small_baseline",
            "trainer=ddp",
            "trainer.num_nodes=2",
            "hydra.launcher.partition=gpu",
        ],
        return_hydra_config=True,
    )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert launcher.nodes == 2 and launcher.partition == "gpu" and launcher.max_num_timeout >= 1
    assert cfg.trainer.strategy == "ddp"


def test_plus_plus_overrides_may_override_but_not_add_a_schema_key():
    """``++recipe.lr=...`` overrides (accepted); ``++recipe.lrr=...`` would add a misspelt key
    (refused, naming the recipe's keys); ``+backbone.arch.x`` names arch's own keys; the sweep's
    ``++logger.group`` is one of the keys ``++`` may add."""
    cfg = vconfig.compose(["++recipe.lr=0.5", "++logger.group=t", "logger=csv"])
    vconfig.check_overrides(cfg, ["++recipe.lr=0.5", "++logger.group=t", "logger=csv"])
    given = ["data=imagenet", "++data.root=/x"]  # an existing key whose value is ??? is overridden, not added
    vconfig.check_overrides(vconfig.compose(given), given)
    with pytest.raises(vconfig.ConfigError, match=r"recipe.lrr: not a key of recipe .*'lr'"):
        vconfig.check_overrides(vconfig.compose(["++recipe.lrr=1"]), ["++recipe.lrr=1"])
    with pytest.raises(vconfig.ConfigError, match=r"backbone.arch.x: not a key of backbone.arch .*'depth'"):
        vconfig.check_overrides(vconfig.compose(["+backbone.arch.x=1"]), ["+backbone.arch.x=1"])


SCHEMA_GROUPS = {
    "backbone": "Backbone",
    "data": "Data",
    "recipe": "Recipe",
    "budget": "Budget",
    "logger": "Logger",
    "bspf_spec": "BspfSpec",
    "detector": "objectives",
}  # an objective's group: its plug-in's schema


@pytest.mark.parametrize("group", sorted(SCHEMA_GROUPS))
def test_every_key_of_every_option_has_a_type(group):
    """The schemas stay complete: a key added to conf/<group>/*.yaml without a type fails here."""
    import dataclasses
    import typing

    import yaml

    from vitexp.config import schema

    def untyped(values: dict, cls, prefix: str) -> list[str]:
        hints = typing.get_type_hints(cls)
        out = [f"{prefix}{k}" for k in values if k not in hints and k != "defaults"]
        for k, v in values.items():
            if k in hints and dataclasses.is_dataclass(hints[k]) and isinstance(v, dict):
                out += untyped(v, hints[k], f"{prefix}{k}.")
        return out

    from vitexp.config.objective_schemas import OBJECTIVE_SCHEMAS

    cls = (
        OBJECTIVE_SCHEMAS[group]
        if SCHEMA_GROUPS[group] == "objectives"
        else getattr(schema, SCHEMA_GROUPS[group])
    )
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        assert untyped(yaml.safe_load(path.read_text()) or {}, cls, f"{group}.") == [], path.name
    root = yaml.safe_load((CONF_DIR / "train.yaml").read_text())
    assert untyped({k: v for k, v in root.items() if k != "hydra"}, schema.Config, "") == []


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["recipe.lr=abc"], "recipe.lr: 'abc' is not a float"),
        (["recipe.epochs=2.5"], "recipe.epochs: 2.5 is not an integer"),
        (["data.split=[a,b,c]"], "data.split: ['a', 'b', 'c'] is not a list of floats"),
        (["backbone.arch.depth=deep"], "backbone.arch.depth: 'deep' is not an integer"),
        (["eval.flops=maybe"], "eval.flops: 'maybe' is not true or false"),
        (["budget=merge", "budget.r=x"], "budget.r: 'x' is not an integer or a list of integers"),
        (
            ["trainer.precision=bf17"],
            "trainer.precision: 'bf17' is not one of [64, 32, 16, 'transformer-engine'",
        ),
        (["+trainer.max_epochs=3"], "trainer.max_epochs: set by vitexp (set recipe.epochs)"),
        (["+trainer.foo=3"], "trainer.foo: not an argument of lightning.Trainer"),
        (
            ["method=bspf", "method.keep_warmup_epochs=soon"],
            "method.keep_warmup_epochs: 'soon' is not a float",
        ),
        (["method=raptor", "method.tau_fraction=[1]"], "method.tau_fraction: [1] is not a float"),
    ],
)
def test_a_wrong_type_is_refused_at_composition(overrides, message):
    """Key, value and the type expected; the method's keys typed by its class's constructor."""
    with pytest.raises(ConfigError) as err:
        vconfig.compose(overrides)
    assert str(err.value).startswith(message)


def test_method_keys_follow_the_constructor(monkeypatch):
    """A method's keys are its ``_target_``'s constructor arguments, typed by their annotations:
    an int where the constructor says float is accepted, null where it says ``int | None``; a key
    the constructor lacks is refused before the run, not inside it."""
    from vitexp.config import schema

    cfg = vconfig.compose(["method=bspf", "method.keep_warmup_epochs=2", "bspf_spec.chunk_size=null"])
    assert cfg.method.keep_warmup_epochs == 2 and cfg.method.chunk_size is None
    schema._constructor_hints.cache_clear()
    monkeypatch.setattr("vitexp.methods.bspf.BSPF.__init__", lambda self, name, chunk_size: None)
    try:
        with pytest.raises(
            ConfigError, match=r"method.chunk_layout: not an argument of vitexp.methods.bspf.BSPF"
        ):
            vconfig.compose(["method=bspf"])
    finally:
        schema._constructor_hints.cache_clear()


def test_interpolations_are_checked_resolved_and_missing_values_left_to_validate():
    cfg = vconfig.compose(["recipe.batch_size=32"])  # data.batch_size: ${recipe.batch_size}
    assert cfg.data.batch_size == 32
    vconfig.compose(["data=imagenet"])  # data.root: ??? is validate's to name
    with pytest.raises(ConfigError, match="data.batch_size: 'x' is not an integer"):
        vconfig.compose(["recipe.batch_size=x"])
