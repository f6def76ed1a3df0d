"""SAPER's head-selection baselines (``method.selection``: random, magnitude, importance) at the
same budget k as LapSum (vitexp/methods/saper/selection.py, method.py)."""

from __future__ import annotations

import json

import pytest
import timm
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

import vitexp  # noqa: F401
from vitexp.measure.flops import count_heads
from vitexp.methods.saper import SELECTIONS, SaperDistill, SaperHeads, head_importance, magnitude_scores
from vitexp.models._common import ScaledAttention

BUDGET = {"kind": "heads", "k": 5}


def micro(**kwargs):
    torch.manual_seed(0)
    return timm.create_model("vit_micro_patch14_dinov2", num_classes=10, **kwargs)


def synthetic(batch_size: int = 16):
    from vitexp.data.datamodules import SyntheticDataModule

    return SyntheticDataModule(
        num_train=64, num_val=16, num_test=16, batch_size=batch_size, data_config={"input_size": (3, 56, 56)}
    )


def selected(method, backbone, budget=BUDGET, datamodule=None):
    """(model to train, deployed model) of ``method`` on ``backbone``."""
    method.prepare(backbone, datamodule)
    model = method.apply(backbone, budget)
    return model, method.deploy(model)


@pytest.mark.parametrize("selection", SELECTIONS)
@pytest.mark.parametrize("mode", [SaperHeads, SaperDistill])
def test_every_rule_deploys_exactly_k_physical_heads(mode, selection):
    method = mode(selection=selection, importance_batches=2)
    _, deployed = selected(method, micro(), datamodule=synthetic())
    attns = [b.attn for b in deployed.backbone.blocks]
    heads = [getattr(a, "num_heads", 0) for a in attns]
    assert sum(heads) == 5 and count_heads(deployed) == 5
    assert heads == [len(h) for h in method.kept_heads]
    for attn, h in zip(attns, heads):  # the weights of the removed heads are gone, not masked
        if h:
            assert (
                attn.qkv.out_features == 3 * h * attn.head_dim and attn.proj.in_features == h * attn.head_dim
            )
            assert type(attn) is not ScaledAttention  # timm's own attention, no gates


def kept_with_seed(seed: int) -> list[list[int]]:
    import vitexp.config.composition as vconfig
    from vitexp.methods import method_from_config

    method = method_from_config(
        vconfig.compose(["method=saper_ft", "method.selection=random", f"seed={seed}"]).method
    )
    torch.manual_seed(1000 + seed)  # the draw must not depend on the global RNG
    selected(method, micro())
    return method.kept_heads


def test_random_is_seeded_by_the_runs_seed():
    assert kept_with_seed(3) == kept_with_seed(3)
    assert kept_with_seed(3) != kept_with_seed(4)


def test_magnitude_keeps_the_heads_whose_projection_columns_were_scaled_up():
    backbone = micro()
    planted = {(0, 1), (1, 3), (2, 2), (3, 0), (3, 2)}
    with torch.no_grad():
        for layer, head in planted:
            attn = backbone.blocks[layer].attn
            attn.proj.weight[:, head * attn.head_dim : (head + 1) * attn.head_dim] *= 10
    method = SaperHeads(selection="magnitude")
    selected(method, backbone)
    assert {(l, h) for l, heads in enumerate(method.kept_heads) for h in heads} == planted


def attention_matters_backbone():
    """The micro DINOv2 in float64 with LayerScale 1, so attention moves the output."""
    return micro(init_values=1.0).double().eval()


def test_head_importance_is_the_mean_of_each_examples_absolute_gradient():
    """Eq. 2 of Michel et al.: E_x |∂L(x)/∂ξ_h|, here checked one example at a time through
    SAPER's own gates (ScaledAttention's ``gate_values``), a code path the hooks do not share."""
    backbone = attention_matters_backbone()
    probe = torch.randn(10, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def loss(tokens, y):
        return F.cross_entropy(tokens[:, 0] @ probe.T, y, reduction="none")

    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(3, 3, 56, 56, generator=g), torch.randint(0, 10, (3,), generator=g)) for _ in range(2)
    ]
    got = head_importance(backbone, batches, loss)

    for block in backbone.blocks:
        block.attn.__class__ = ScaledAttention
    expected = torch.zeros(4, 4, dtype=torch.float64)
    for x, y in batches:
        for i in range(len(x)):
            gates = [torch.ones(4, dtype=torch.float64, requires_grad=True) for _ in backbone.blocks]
            for block, gate in zip(backbone.blocks, gates):
                block.attn.gate_values = gate
            grads = torch.autograd.grad(
                loss(backbone.forward_features(x[i : i + 1].double()), y[i : i + 1]).sum(), gates
            )
            expected += torch.stack(grads).abs()
    torch.testing.assert_close(got, expected / 6, rtol=1e-9, atol=1e-12)


def test_the_distillation_loss_gives_no_importance_at_gates_one():
    """Why ``importance`` uses a probe's loss in distillation mode too: with every gate at 1 the
    student is its teacher, the distillation loss is at its minimum, and every gradient is 0."""
    backbone = attention_matters_backbone()
    x = torch.randn(4, 3, 56, 56, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        teacher_tokens = backbone.forward_features(x)
    scores = head_importance(
        backbone, [(x, teacher_tokens)], lambda t, target: (t - target).square().mean(dim=(1, 2))
    )
    assert torch.count_nonzero(scores) == 0


def test_importance_ranks_the_one_head_that_reaches_the_output_first():
    """Only head 1 of layer 2 has non-zero values (every other head outputs 0), while the others
    have the largest projection columns (magnitude prefers them): importance keeps head (2, 1)."""
    import copy

    backbone = attention_matters_backbone()
    planted = (2, 1)
    with torch.no_grad():
        for l, block in enumerate(backbone.blocks):
            attn, d = block.attn, block.attn.head_dim
            for h in range(attn.num_heads):
                if (l, h) != planted:
                    v_rows = slice((2 * attn.num_heads + h) * d, (2 * attn.num_heads + h + 1) * d)
                    attn.qkv.weight[v_rows] = 0
                    attn.qkv.bias[v_rows] = 0
                    attn.proj.weight[:, h * d : (h + 1) * d] *= 10
    assert magnitude_scores(backbone).flatten().argmax() != planted[0] * 4 + planted[1]
    for mode in (SaperHeads, SaperDistill):
        method = mode(selection="importance", importance_batches=2)
        selected(method, copy.deepcopy(backbone), {"kind": "heads", "k": 1}, synthetic(8))
        assert method.kept_heads == [[], [], [1], []]
        norms = method.importance.norm(dim=1)  # normalised per layer (l2), Michel et al.'s pruning
        torch.testing.assert_close(norms, torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=norms.dtype))


def test_the_calibration_images_are_drawn_with_the_selection_seed():
    from vitexp.methods.saper.selection import calibration_loader

    def labels(seed: int, global_seed: int) -> torch.Tensor:
        torch.manual_seed(global_seed)  # the draw must not depend on the global RNG
        return torch.cat([y for _, y in calibration_loader(synthetic(8), 2, seed)])

    assert len(labels(0, 1)) == 16
    assert torch.equal(labels(0, 1), labels(0, 2)) and not torch.equal(labels(0, 1), labels(1, 1))


def test_an_unknown_selection_names_the_valid_ones():
    from vitexp.errors import ConfigError

    with pytest.raises(ConfigError, match="lapsum.*random.*magnitude.*importance"):
        SaperHeads(selection="taylor")


@pytest.mark.parametrize("selection", ["random", "magnitude"])
def test_fixed_heads_train_what_trainable_leaves(selection):
    """``mlp``: only the MLPs train (the pruned attention's new projections stay frozen);
    ``scores`` in distillation mode: nothing trains, and the run is zero epochs."""
    pair, _ = selected(SaperDistill(selection=selection, trainable="mlp"), micro())
    names = {n for n, p in pair.named_parameters() if p.requires_grad}
    assert names == {
        f"student.backbone.blocks.{i}.mlp.{fc}.{p}"
        for i in range(4)
        for fc in ("fc1", "fc2")
        for p in ("weight", "bias")
    }
    method = SaperDistill(selection=selection)
    pair, _ = selected(method, micro())
    assert not any(p.requires_grad for p in pair.parameters())
    assert [dict(s.recipe) for s in method.stages(pair)] == [{"epochs": 0}]
    ft, _ = selected(SaperHeads(selection=selection), micro())
    assert {n for n, p in ft.named_parameters() if p.requires_grad} == {"head.weight", "head.bias"}


RUN = [
    "logger=none",
    "trainer.enable_progress_bar=false",
    "backbone=dinov2_micro",
    "+backbone.kwargs.init_values=1.0",
    "budget=heads",
    "budget.k=5",
    "method.selection=importance",
    "method.importance_batches=2",
    "data=synthetic",
    "data.num_train=64",
    "data.num_val=16",
    "data.num_test=32",
    "recipe.batch_size=16",
    "recipe.epochs=1",
    "recipe.warmup_epochs=0",
    "recipe.lr=0.01",
    "eval.throughput=false",
    "trainer.num_sanity_val_steps=0",
    "trainer.limit_val_batches=0",
]


class DeployedModel(Callback):
    """Keeps the model of the run's last test: the deployed one."""

    model = None

    def on_test_start(self, trainer, pl_module):
        self.model = pl_module.model


@pytest.mark.parametrize("method, trainable", [("saper_ft", "scores"), ("saper_kd", "mlp")])
def test_an_importance_run_deploys_k_heads_that_the_ledger_rebuilds(
    method, trainable, make_cfg, tmp_path, capsys, results_dir
):
    import lightning as L

    from vitexp.commands.train import train
    from vitexp.methods import method_from_config
    from vitexp.training.build import build_configured_backbone, build_datamodule, data_config_for

    cfg = make_cfg(RUN + [f"method={method}", f"method.trainable={trainable}"], tmp_path / method)
    keep = DeployedModel()
    result = train(cfg, callbacks=[keep])
    from vitexp.ledger.paths import local_path

    entry = json.loads(local_path(result["ledger"], results_dir).read_text())
    assert (
        entry["status"] == "completed" and result["metrics"]["heads"] == 5 and result["metrics"]["steps"] > 0
    )
    assert sum(len(h) for h in entry["kept_heads"]) == 5 and count_heads(keep.model) == 5
    assert entry["selection_source"].startswith("importance over 2 calibration batches")
    # no soft gates: the model trained is the deployed one, tested once, with no soft_top1
    assert "soft_top1" not in result["metrics"] and "top1" in result["metrics"]

    # the same seed chooses the same heads again (what a resumed run relies on)
    L.seed_everything(int(cfg.seed), verbose=False)
    backbone = build_configured_backbone(cfg)
    again = method_from_config(cfg.method)
    again.prepare(backbone, build_datamodule(cfg, data_config_for(cfg, backbone)))
    again.apply(backbone, cfg.budget)
    assert again.kept_heads == entry["kept_heads"]

    # the ledger's head indices are the deployed ones: the run's initial backbone cut to them holds
    # the deployed attention weights (attention is frozen under trainable=scores and mlp)
    L.seed_everything(int(cfg.seed), verbose=False)
    initial = method_from_config(cfg.method).rebuild_deployed(build_configured_backbone(cfg), entry)
    for ours, theirs in zip(initial.backbone.blocks, keep.model.backbone.blocks):
        torch.testing.assert_close(ours.attn.state_dict(), theirs.attn.state_dict(), rtol=0, atol=0)

    from vitexp.commands.cli import eval_main

    capsys.readouterr()
    eval_main([result["run_id"], "logger=none", "trainer.enable_progress_bar=false"])
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert evaluated["status"] == "completed" and evaluated["metrics"]["top1"] == pytest.approx(
        result["metrics"]["top1"], abs=1e-9
    )

    torch.manual_seed(123)  # the rebuilt backbone's own weights are all overwritten
    rebuilt = method_from_config(cfg.method).rebuild_deployed(build_configured_backbone(cfg), entry)
    rebuilt.load_state_dict(torch.load(local_path(entry["artifacts"]["weights"], results_dir)), strict=True)
    x = torch.randn(4, 3, 56, 56)
    torch.testing.assert_close(rebuilt.eval()(x), keep.model.eval()(x), rtol=0, atol=0)
