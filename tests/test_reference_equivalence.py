"""Each architecture against its reference code: the reference model's outputs on seeded,
perturbed weights and a fixed input were computed once with the reference repository at a pinned
commit (``tests/fixtures/reference/generate.py``; each fixture names its repository and commit)
and stored as numbers. Here the same weights go through vitexp's user path: a checkpoint file in
the reference's own layout, ``build_backbone`` with ``pretrained=<file>`` (the method applied where
the reference is a method), then float64 outputs within 1e-9 of the reference's (relative to their
largest magnitude), and float32 ones within 16 times the float32 rounding the fixture measured on
the reference itself. The models are small configurations of the reference constructors (one to
four blocks per stage, widths 16 to 96), so every norm, scale and key runs in a fraction of a
second. CaFormer and SHViT are timm's ports: the reference there is the original repository, whose
checkpoint layout timm's filter (and vitexp's SHViT renaming) must convert."""

from __future__ import annotations

import argparse
import copy
import re
from pathlib import Path

import pytest
import torch
from reference_weights import FIXTURES, load_fixture, max_rel, seeded_input, seeded_state_dict

import vitexp  # noqa: F401  (registers vitexp's architectures)
from vitexp.models import CheckpointMismatchError, build_backbone

FLOAT64_REL = 1e-9
FLOAT32_FLOOR_FACTOR = 16
ALL = (
    "t2t_vit_14",
    "t2t_vit_t_14",
    "lvvit_s",
    "dinov2_vits14",
    "dinov2_vits14_reg",
    "raptor",
    "tome",
    "evit",
    "caformer",
    "shvit",
)


#: Each reference evaluation's choice from a release holding two weight sets: (the set it loads,
#: the other set, the ``backbone.use_ema`` value that loads the other). Written here from the
#: reference code, not from vitexp's table (vitexp/models/weight_sets.py):
#: - T2T-ViT @ 0f63dc9: main.py:197 ``--model-ema`` store_true default=True, main.py:531
#:   ``load_checkpoint(model, args.eval_checkpoint, args.model_ema)``: ``state_dict_ema``.
#: - TokenLabeling @ 9dbfd59: validate.py:98 ``--use-ema`` store_true (default False), validate.py:150
#:   ``load_checkpoint(model, args.checkpoint, args.use_ema)``: ``state_dict``.
#: - SHViT @ 6a729cc: README.md:100 ``main.py --eval --resume``, main.py:369 ``checkpoint['model']``:
#: ``model``.
RELEASE_SETS = {
    "t2t_vit_14": ("state_dict_ema", "state_dict", False),
    "t2t_vit_t_14": ("state_dict_ema", "state_dict", False),
    "lvvit_s": ("state_dict", "state_dict_ema", True),
    "shvit": ("model", "model_ema", True),
}


def _checkpoint(fx: dict, path: Path, layout: str = "plain") -> Path:
    """The fixture's weights in a checkpoint layout the official training scripts write: ``plain``
    (a state dict; DINOv2's hub files, CaFormer's releases), ``state_dict`` (with a ``module.``
    prefix, ``args`` and ``epoch`` beside it), ``release`` (the reference's release layout with two
    weight sets, :data:`RELEASE_SETS`: the fixture's under the set the reference evaluation loads,
    other weights under the other set) or ``other`` (the reverse: the fixture's under the set the
    reference does not load)."""
    state = seeded_state_dict(fx["state_dict"], fx["weight_seed"])
    other = seeded_state_dict(fx["state_dict"], fx["weight_seed"] + 1)
    module = lambda sd: {f"module.{k}": v for k, v in sd.items()}  # noqa: E731
    args = argparse.Namespace(model=fx["architecture"], lr=1e-3, model_ema=True)
    if layout == "state_dict":
        state = {"state_dict": module(state), "args": args, "epoch": 309}
    elif layout in ("release", "other"):
        loaded, skipped, _ = RELEASE_SETS[fx["architecture"]]
        if layout == "other":
            loaded, skipped = skipped, loaded
        wrap = (
            module if loaded.startswith("state_dict") else dict
        )  # timm's CheckpointSaver under DDP; SHViT's main.py
        state = {loaded: wrap(state), skipped: wrap(other), "args": args, "epoch": 309}
    torch.save(state, path)
    return path


def _backbone(fx: dict, path: Path, img_size: int | None = None, use_ema: bool | None = None):
    """``build_backbone`` as ``backbone.pretrained=<path>`` builds it; ``use_ema`` None: the key
    absent, as in every backbone config file."""
    v = fx["vitexp"]
    cfg = {
        "timm_name": v["timm_name"],
        "img_size": img_size or v["img_size"],
        "pretrained": str(path),
        "kwargs": v["kwargs"],
        **({"img_size_kwarg": v["img_size_kwarg"]} if "img_size_kwarg" in v else {}),
        **({} if use_ema is None else {"use_ema": use_ema}),
    }
    return build_backbone(cfg, num_classes=v["num_classes"]).eval()


def _compare(
    model,
    fx: dict,
    forward=None,
    x_spec: dict | None = None,
    expected=None,
    floor: float | None = None,
    abs64: float | None = None,
):
    """float64 within FLOAT64_REL (and within ``abs64`` absolute, where given); float32 within
    FLOAT32_FLOOR_FACTOR x the fixture's floor."""
    forward = forward or (lambda m, inp: m(inp))
    x_spec = x_spec or fx["input"]
    x = seeded_input(x_spec["shape"], x_spec["seed"])
    ref = torch.tensor(expected if expected is not None else fx["output"], dtype=torch.float64)
    with torch.no_grad():
        out64 = forward(copy.deepcopy(model).double(), x)
        rel64 = max_rel(out64, ref)
        assert rel64 <= FLOAT64_REL, (
            f"{fx['architecture']}: float64 differs from {fx['repository']} by {rel64:.3g}"
        )
        if abs64 is not None:
            delta = float((out64 - ref).abs().max())
            assert delta <= abs64, (
                f"{fx['architecture']}: float64 max |delta| {delta:.3g} from {fx['repository']}"
            )
        if floor is not None:
            out32 = forward(copy.deepcopy(model).float(), x.float())
            rel32 = max_rel(out32, ref)
            assert rel32 <= FLOAT32_FLOOR_FACTOR * floor, (
                f"{fx['architecture']}: float32 differs by {rel32:.3g}, the reference's own float32 rounding"
                f" is {floor:.3g}"
            )


@pytest.mark.parametrize("name", ALL)
def test_fixture_names_its_reference(name):
    fx = load_fixture(name)
    assert fx["repository"].count("/") == 1 and re.fullmatch(r"[0-9a-f]{40}", fx["commit"])
    assert fx["dtype"] == "float64" and 0 < fx["float32_floor"]["max_rel"] < 1e-5


@pytest.mark.parametrize("layout", ["plain", "state_dict"])
@pytest.mark.parametrize("name", ["t2t_vit_14", "t2t_vit_t_14", "lvvit_s"])
def test_official_checkpoint_layouts_give_the_reference_logits(name, layout, tmp_path):
    """T2T-ViT(-t) and LV-ViT (eval logits: class head + 0.5 x max of the aux head), loaded from a
    plain state dict and from a training checkpoint holding one set (``module.`` prefix, ``args``)."""
    fx = load_fixture(name)
    model = _backbone(fx, _checkpoint(fx, tmp_path / f"{name}.pth.tar", layout))
    _compare(model, fx, floor=fx["float32_floor"]["max_rel"] if layout == "plain" else None)


@pytest.mark.parametrize("name", list(RELEASE_SETS))
def test_a_release_with_two_weight_sets_gives_the_reference_evaluations_logits(name, tmp_path):
    """A file in the reference's release layout holding two different weight sets, loaded with no
    override, gives the logits of the reference evaluation, which loads one of them
    (:data:`RELEASE_SETS`; T2T-ViT's ``main.py --eval_checkpoint`` loads ``state_dict_ema``): float64
    max |delta| <= 1e-12. ``backbone.use_ema`` flips the set: on the same file the logits are no
    longer the reference's, and on the file with the sets swapped they are again."""
    fx = load_fixture(name)
    loaded, skipped, flip = RELEASE_SETS[name]
    release = _checkpoint(fx, tmp_path / f"{name}_release.pth.tar", "release")
    model = _backbone(fx, release)
    assert model.pretrained_weights.weights == loaded
    _compare(model, fx, floor=fx["float32_floor"]["max_rel"], abs64=1e-12)

    flipped = _backbone(fx, release, use_ema=flip)
    assert flipped.pretrained_weights.weights == skipped
    x = seeded_input(fx["input"]["shape"], fx["input"]["seed"])
    with torch.no_grad():
        assert (
            max_rel(copy.deepcopy(flipped).double()(x), torch.tensor(fx["output"], dtype=torch.float64))
            > 1e-3
        )
    _compare(_backbone(fx, _checkpoint(fx, tmp_path / f"{name}_other.pth.tar", "other"), use_ema=flip), fx)


def test_timm_port_caformer_loads_the_original_checkpoint(tmp_path):
    """CaFormer is timm's port: the original release (a plain state dict) goes through timm's key
    filter into vitexp's micro configuration of it. (SHViT's original ``{"model", "model_ema"}``
    files: :func:`test_a_release_with_two_weight_sets_gives_the_reference_evaluations_logits`.)"""
    fx = load_fixture("caformer")
    model = _backbone(fx, _checkpoint(fx, tmp_path / "caformer.pth"))
    _compare(model, fx, floor=fx["float32_floor"]["max_rel"])


def test_a_deit_training_file_loads_model_not_model_ema(tmp_path):
    """DeiT's ``main.py --eval --resume`` loads ``checkpoint['model']`` (facebookresearch/deit @
    7e160fe, main.py:402) although its training also saves ``model_ema``: so does vitexp, and
    ``backbone.use_ema=true`` loads ``model_ema`` (DeiT layout of the ToMe fixture)."""
    fx = load_fixture("tome")
    state = seeded_state_dict(fx["state_dict"], fx["weight_seed"])
    other = seeded_state_dict(fx["state_dict"], fx["weight_seed"] + 1)
    path = tmp_path / "deit.pth"
    torch.save({"model": state, "model_ema": other, "epoch": 299}, path)
    for use_ema, expected in ((None, state), (True, other)):
        built = _backbone(fx, path, use_ema=use_ema).state_dict()
        assert all(torch.equal(built[k], v) for k, v in expected.items()), use_ema


@pytest.mark.parametrize("name", ["dinov2_vits14", "dinov2_vits14_reg"])
def test_dinov2_hub_checkpoint_gives_the_hub_model_features(name, tmp_path):
    """A hub checkpoint (518 px, 37x37 position table) in timm's DINOv2 at 224 px gives the hub
    model's 224 px features ([CLS ‖ mean patch token] after the final norm): timm's key filter,
    then the hub's interpolation of the position table. At 518 px no interpolation is involved."""
    fx = load_fixture(name)
    path = _checkpoint(fx, tmp_path / f"{name}_pretrain.pth")

    def features(m, x):
        f = m.forward_features(x)
        return torch.cat([f[:, 0], f[:, m.num_prefix_tokens :].mean(dim=1)], dim=-1)

    _compare(_backbone(fx, path), fx, features, floor=fx["float32_floor"]["max_rel"])
    native = fx["native"]
    _compare(
        _backbone(fx, path, img_size=native["img_size"]), fx, features, native["input"], native["output"]
    )


def _iterate(blocks, phases, x):
    for block, phase in zip(blocks, phases):
        for layer in phase:
            x = block(x, layer)
    return x


def test_raptor_reference_surrogate_file_gives_the_reference_outputs():
    """The reference's stage-2 file (``torch.save`` of a ``raptor.Raptor``) read without the
    reference code: its blocks under vitexp's names, its thresholds as phases."""
    from vitexp.methods.raptor.reference import phases_from_thresholds, read_surrogate
    from vitexp.methods.raptor.surrogate import RaptorBlock

    fx = load_fixture("raptor")
    ref = read_surrogate(FIXTURES / "raptor_surrogate.pt")
    args = fx["reference"]["args"]
    assert (ref.mlp, ref.heads, ref.thresholds, ref.dim) == ("swiglu", args["num_heads"], [2], args["dim"])
    phases = phases_from_thresholds(ref.thresholds, fx["vitexp"]["teacher_depth"])
    assert phases == fx["vitexp"]["phases"]
    blocks = torch.nn.ModuleList(RaptorBlock(ref.dim, ref.heads) for _ in ref.blocks)
    for block, state in zip(blocks, ref.blocks):
        block.load_state_dict(state, strict=True)
    _compare(blocks.eval(), fx, lambda m, x: _iterate(m, phases, x), floor=fx["float32_floor"]["max_rel"])

    one = read_surrogate(FIXTURES / "raptor_block.pt")  # a stage-1 file: one block, no thresholds
    assert one.thresholds is None and len(one.blocks) == 1
    block = RaptorBlock(one.dim, one.heads)
    block.load_state_dict(one.blocks[0], strict=True)
    _compare(block.eval(), fx, lambda m, x: m(x, 2), expected=fx["block_file_output_t3"])


def test_raptor_method_starts_from_the_reference_surrogate():
    """``method.surrogate=<reference file>``: the run's surrogate holds the reference's blocks over
    the phases of its thresholds (phases from data are not computed)."""
    import timm

    from vitexp.methods.raptor import Raptor

    fx = load_fixture("raptor")
    args = fx["reference"]["args"]
    teacher = timm.create_model(
        "vit_micro_patch14_dinov2",
        embed_dim=args["dim"],
        num_heads=args["num_heads"],
        depth=fx["vitexp"]["teacher_depth"],
        reg_tokens=4,
        num_classes=10,
    )
    method = Raptor(surrogate=str(FIXTURES / "raptor_surrogate.pt"), stage1_epochs=0, stage2_epochs=0)
    arch = {
        "depth": 4,
        "num_heads": args["num_heads"],
        "embed_dim": args["dim"],
        "patch_size": 14,
        "num_prefix_tokens": 5,
    }
    method.validate_budget({"kind": "blocks", "k": 2}, arch)
    method.prepare(teacher, datamodule=object())  # thresholds given: no distance matrix, no data touched
    model = method.apply(teacher, {"kind": "blocks", "k": 2})
    surrogate = model.surrogate.eval()
    assert surrogate.phases == fx["vitexp"]["phases"] and "thresholds [2]" in method.phases_source
    _compare(surrogate.blocks, fx, lambda m, x: _iterate(m, surrogate.phases, x))
    with pytest.raises(Exception, match="2 blocks, budget.k=3"):
        Raptor(surrogate=str(FIXTURES / "raptor_surrogate.pt"), min_phase_size=1).validate_budget(
            {"kind": "blocks", "k": 3}, arch
        )


def test_tome_matches_the_reference_patch(tmp_path):
    """vitexp's ToMe on a DeiT-layout timm ViT against ToMe's own ``apply_patch`` on the same
    timm model (r = 3 per block, proportional attention)."""
    from vitexp.methods.tome import ToMe

    fx = load_fixture("tome")
    model = ToMe(prop_attn=True).apply(
        _backbone(fx, _checkpoint(fx, tmp_path / "deit.pth")), fx["vitexp"]["budget"]
    )
    _compare(model.eval(), fx, floor=fx["float32_floor"]["max_rel"])


def test_evit_matches_the_reference_model(tmp_path):
    """vitexp's EViT (keep 0.7 after the attention of blocks 1, 2, 3, fused token) on a DeiT-layout
    timm ViT against EViT's own model, both loading the same DeiT-layout checkpoint."""
    from vitexp.methods.evit import EViT

    fx = load_fixture("evit")
    backbone = _backbone(fx, _checkpoint(fx, tmp_path / "deit.pth"))
    model = EViT(prune_layers=fx["vitexp"]["prune_layers"], fuse_token=True).apply(
        backbone, {"kind": "keep_ratio", "keep_ratio": fx["vitexp"]["keep_ratio"]}
    )
    _compare(model.eval(), fx, floor=fx["float32_floor"]["max_rel"])


@pytest.mark.parametrize("name", ["lvvit_s", "dinov2_vits14"])
def test_unknown_checkpoint_layout_names_the_file_and_the_expected_keys(name, tmp_path):
    """A file that is not the model's (here: its keys under another prefix) is refused, also when
    the class count differs and timm would load it without strictness."""
    fx = load_fixture(name)
    state = seeded_state_dict(fx["state_dict"], fx["weight_seed"])
    path = tmp_path / "other.pth"
    torch.save({f"encoder.{k}": v for k, v in state.items()}, path)
    with pytest.raises(CheckpointMismatchError, match=re.escape(str(path))) as err:
        _backbone(fx, path)
    assert "blocks.0.norm1.weight" in err.value.missing


@pytest.mark.parametrize(
    "source, target, key",
    [
        ("dinov2_vits14_reg", "dinov2_vits14", "register_tokens"),
        ("dinov2_vits14", "dinov2_vits14_reg", "reg_token"),
    ],
)
def test_dinov2_hub_file_with_other_registers_names_the_file_and_the_keys(source, target, key, tmp_path):
    """A hub file with registers in a model without them, or the reverse: timm's filter fails on a
    reshape of the position table (a RuntimeError), which is the file's mismatch, named."""
    fx = load_fixture(source)
    path = _checkpoint(fx, tmp_path / f"{source}_pretrain.pth")
    with pytest.raises(CheckpointMismatchError, match=re.escape(str(path))) as err:
        _backbone(load_fixture(target), path)
    assert key in err.value.missing + err.value.unexpected


def test_unknown_raptor_file_names_the_keys_it_expected(tmp_path):
    from vitexp.methods.raptor.reference import read_surrogate

    path = tmp_path / "not_raptor.pt"
    torch.save({"weight": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match=r"not_raptor\.pt.*attn\.in_proj_weight"):
        read_surrogate(path)
