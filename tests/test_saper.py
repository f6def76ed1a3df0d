"""SAPER's head gating, physical head removal, FLOPs protocol and reported accuracy
(vitexp/methods/saper/, vitexp/training/modules.py DistillModule, vitexp/training/fit.py)."""

from __future__ import annotations

import math

import pytest
import timm
import torch
import torch.nn as nn
from timm.models.vision_transformer import Attention

import vitexp  # noqa: F401
from vitexp.ledger.paths import local_path
from vitexp.measure.flops import count_heads as head_count
from vitexp.measure.flops import count_macs
from vitexp.methods.probe import ProbeModel
from vitexp.methods.saper import ConstantBranch, HeadSelector, SaperDistill, SaperHeads
from vitexp.models._common import ScaledAttention


def micro(num_classes: int = 10, **kwargs):
    torch.manual_seed(0)
    return timm.create_model("vit_micro_patch14_dinov2", num_classes=num_classes, **kwargs)


def attention_matters_model(k: int, fold_gates: bool = False):
    """SAPER on the micro DINOv2 with LayerScale 1 (not 1e-5), in float64, so attention moves the
    output; the scores are random."""
    model = (
        SaperHeads(fold_gates=fold_gates).apply(micro(init_values=1.0), {"kind": "heads", "k": k}).double()
    )
    with torch.no_grad():
        model.selector.scores.copy_(torch.randn(16, generator=torch.Generator().manual_seed(k)))
    return model


def hard_gated_output(model, x: torch.Tensor, folded: bool = False) -> torch.Tensor:
    """The gated model's output with the top-k heads by score at 1 (``folded``: at their final
    gates, the soft top-k at k and alpha_end), the others 0, the mask computed here (not by the code
    under test)."""
    from vitexp.methods.lapsum import soft_topk

    sel = model.selector
    scores = sel.scores.detach()
    mask = torch.zeros_like(scores)
    mask[scores.topk(sel.k).indices] = 1.0
    gates = soft_topk(scores, float(sel.k), sel.alpha_end) * mask if folded else mask
    for block, g in zip(model.backbone.blocks, gates.view(sel.depth, sel.heads)):
        block.attn.gate_values = g
    return ProbeModel.forward(model, x)  # the probe's forward with the gates set above


def assert_deploys_the_top_k_heads(model, x: torch.Tensor) -> None:
    model.eval()
    expected = hard_gated_output(model, x, folded=model.selector.fold_gates)
    deployed = model.deploy().eval()
    assert head_count(deployed) == model.selector.k
    torch.testing.assert_close(deployed(x), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("k", [1, 3, 6, 15])
def test_deployed_model_has_k_heads_and_equals_the_hard_gated_model(k):
    model = attention_matters_model(k)
    x = torch.randn(3, 3, 56, 56, dtype=torch.float64)
    assert_deploys_the_top_k_heads(model, x)
    assert count_macs(model.deploy().float(), 56).gmacs < count_macs(ProbeModel(micro(), 10), 56).gmacs


@pytest.mark.parametrize("fold_gates", [False, True])
def test_kept_heads_deploy_at_one_unless_the_gates_are_folded(fold_gates):
    """Scores close together leave the final gates well short of 1. By default the deployed model
    equals the gated model with the kept heads at 1 (dropped heads at 0), whatever the final gates;
    with ``fold_gates`` it equals the gated model at those final gates instead, and the two differ."""
    model = attention_matters_model(6, fold_gates)
    with torch.no_grad():
        model.selector.scores.mul_(0.01)
    summary = model.selector.gate_summary()
    assert summary["kept_gate_min"] < 0.9 and summary["dropped_gate_mass"] > 0.1
    x = torch.randn(3, 3, 56, 56, dtype=torch.float64)
    assert_deploys_the_top_k_heads(model, x)
    other = hard_gated_output(model.eval(), x, folded=not fold_gates)
    assert (model.deploy().eval()(x) - other).abs().max() > 1e-4


def test_deploying_the_lowest_scoring_heads_fails_the_check(monkeypatch):
    """The check above catches a deployment that keeps the wrong heads: here the k lowest-scoring."""
    model = attention_matters_model(6)

    def lowest_k(self):
        mask = torch.zeros(self.total)
        mask[(-self.scores.detach()).topk(self.k).indices] = 1.0
        return mask.view(self.depth, self.heads)

    monkeypatch.setattr(HeadSelector, "hard_mask", lowest_k)
    with pytest.raises(AssertionError):
        assert_deploys_the_top_k_heads(model, torch.randn(3, 3, 56, 56, dtype=torch.float64))


def test_a_layer_without_heads_keeps_only_the_projection_bias():
    model = SaperHeads().apply(micro(), {"kind": "heads", "k": 4})
    with torch.no_grad():
        model.selector.scores.copy_(torch.tensor([9.0] * 4 + [-9.0] * 12))  # all of layer 0, nothing else
    deployed = model.deploy()
    assert [getattr(b.attn, "num_heads", 0) for b in deployed.backbone.blocks] == [4, 0, 0, 0]
    assert model.kept_heads() == [[0, 1, 2, 3], [], [], []]


def test_deployed_attention_is_timms_own_and_the_weights_hold_no_gates():
    model = SaperHeads().apply(micro(), {"kind": "heads", "k": 6})
    deployed = model.deploy()
    assert all(type(b.attn) in (Attention, ConstantBranch) for b in deployed.backbone.blocks)
    assert not any("selector" in key for key in deployed.state_dict())


def test_gated_attention_equals_timm_attention_with_the_heads_outputs_scaled():
    """Gates g on timm's Attention = timm's Attention whose projection columns of head h are
    multiplied by g_h (g = 1: timm's Attention itself)."""
    torch.manual_seed(0)
    attn = Attention(64, num_heads=4, qkv_bias=True).double().eval()
    x = torch.randn(2, 17, 64, dtype=torch.float64)
    g = torch.tensor([1.0, 0.0, 0.3, 0.7], dtype=torch.float64)
    reference = Attention(64, num_heads=4, qkv_bias=True).double().eval()
    reference.load_state_dict(attn.state_dict())
    with torch.no_grad():
        reference.proj.weight.mul_(g.repeat_interleave(16))
    expected_ones = attn(x)
    gated = attn
    gated.__class__ = ScaledAttention
    gated.gate_values = torch.ones(4, dtype=torch.float64)
    torch.testing.assert_close(gated(x), expected_ones, rtol=1e-12, atol=1e-12)
    gated.gate_values = g
    torch.testing.assert_close(gated(x), reference(x), rtol=1e-12, atol=1e-12)


def test_schedule_anneals_k_by_a_cosine_and_alpha_geometrically():
    sel = HeadSelector(4, 4, k=3, alpha_start=1.0, alpha_end=0.01, anneal_fraction=0.5)
    assert sel.schedule() == pytest.approx((15.5, 1.0))
    sel.progress.fill_(0.25)  # half-way through the anneal
    assert sel.schedule() == pytest.approx(((15.5 + 3) / 2, 0.1))
    sel.progress.fill_(0.125)
    assert sel.schedule()[0] == pytest.approx(3 + 12.5 * 0.5 * (1 + math.cos(math.pi / 4)))
    sel.progress.fill_(0.9)  # after the anneal: the budget and the final temperature
    assert sel.schedule() == pytest.approx((3.0, 0.01))


def test_gates_follow_the_scores_and_reach_the_hard_mask_at_the_end():
    sel = HeadSelector(4, 4, k=3, alpha_start=1.0, alpha_end=0.01, anneal_fraction=0.5).double()
    with torch.no_grad():
        sel.scores.copy_(torch.randperm(16, generator=torch.Generator().manual_seed(0)).double() * 0.2)
    order = sel.scores.detach().argsort()
    sel.progress.fill_(0.1)
    early = sel.gates().detach().flatten()[order]
    assert torch.all(early.diff() > 0), "a higher score must give a higher gate"
    assert float(early[0]) > 0.3 and float(early[-1]) < 0.9999  # soft early in the anneal
    sel.progress.fill_(1.0)
    end = sel.gates()
    assert float((end.detach() - sel.hard_mask()).abs().max()) < 1e-4
    (end * torch.arange(16.0).view(4, 4)).sum().backward()
    assert sel.scores.grad is not None and sel.scores.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "trainable, extra",
    [
        ("scores", set()),
        (
            "mlp",
            {
                f"backbone.blocks.{i}.mlp.{fc}.{p}"
                for i in range(4)
                for fc in ("fc1", "fc2")
                for p in ("weight", "bias")
            },
        ),
    ],
)
def test_what_trains(trainable, extra):
    model = SaperHeads(trainable=trainable).apply(micro(), {"kind": "heads", "k": 5})
    trainable_names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable_names == {"selector.scores", "head.weight", "head.bias"} | extra


def test_trainable_all_trains_attention_but_never_the_teacher():
    pair = SaperDistill(trainable="all").apply(micro(), {"kind": "heads", "k": 5})
    names = {n for n, p in pair.named_parameters() if p.requires_grad}
    assert "student.backbone.blocks.0.attn.qkv.weight" in names and "student.selector.scores" in names
    assert not any(n.startswith("teacher.") for n in names)


def test_trainable_rejects_an_unknown_choice():
    from vitexp.config.composition import ConfigError

    with pytest.raises(ConfigError, match="scores.*mlp.*all"):
        SaperHeads(trainable="attention")
    with pytest.raises(ConfigError, match="cls_mean"):
        SaperDistill(knn_features="mean")


def test_knn_features_default_to_the_cls_token():
    """DINO's k-NN uses the CLS token: saper_kd and knn default to it; cls_mean is [CLS ‖ mean patch]."""
    import vitexp.config.composition as vconfig
    from vitexp.methods import method_from_config

    x = torch.randn(2, 3, 56, 56)
    for name in ("saper_kd", "knn"):
        budget = {"kind": "heads", "k": 15} if name == "saper_kd" else {"kind": "none"}
        method = method_from_config(vconfig.compose([f"method={name}"]).method)
        assert method.knn_features == "cls"
        model = method.apply(micro(), budget).eval()
        if name == "saper_kd":
            model = method.deploy(model)
        tokens = model.backbone.forward_features(x)
        torch.testing.assert_close(model(x), tokens[:, 0])
    both = (
        SaperDistill(knn_features="cls_mean")
        .deploy(SaperDistill(knn_features="cls_mean").apply(micro(), {"kind": "heads", "k": 15}))
        .eval()
    )
    tokens = both.backbone.forward_features(x)
    torch.testing.assert_close(both(x), torch.cat([tokens[:, 0], tokens[:, 1:].mean(1)], -1))


@pytest.mark.parametrize(
    "name, k, gflops",
    [
        ("vit_base_patch14_dinov2", None, 46.33),
        ("vit_small_patch14_dinov2", None, 12.25),
        ("vit_base_patch14_dinov2", 24, 32.17),
        ("vit_base_patch14_dinov2", 6, 30.05),
    ],
)
def test_saper_flops_protocol(name, k, gflops):
    """224 px, no registers (257 tokens), GFLOPs = 2 x MACs, attention counted, the linear head on
    [CLS ‖ mean of patches] included; for any choice of surviving heads."""
    backbone = timm.create_model(name, img_size=224, num_classes=1000)
    if k is None:
        model = ProbeModel(backbone, 1000)
    else:
        pruned = SaperHeads().apply(backbone, {"kind": "heads", "k": k})
        with torch.no_grad():
            pruned.selector.scores.copy_(torch.randn(144, generator=torch.Generator().manual_seed(k)))
        model = pruned.deploy()
        assert head_count(model) == k
    assert count_macs(model, 224).gflops == pytest.approx(gflops, abs=0.02)


def test_training_anneals_the_head_budget_through_the_module(tmp_path):
    """ClassifyModule tells the model its progress: by the end the budget is k and the scores moved."""
    import lightning as L

    import vitexp.config.composition as vconfig
    from vitexp.data.datamodules import SyntheticDataModule
    from vitexp.training.modules import ClassifyModule

    model = SaperHeads(anneal_fraction=0.5).apply(micro(), {"kind": "heads", "k": 5})
    recipe = dict(vconfig.compose(["recipe.epochs=2", "recipe.warmup_epochs=0", "recipe.lr=0.01"]).recipe)
    dm = SyntheticDataModule(
        num_train=64, num_val=16, num_test=16, batch_size=16, data_config={"input_size": (3, 56, 56)}
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    before = model.selector.scores.detach().clone()
    trainer.fit(ClassifyModule(model, 10, recipe), datamodule=dm)
    assert float(model.selector.progress) > 0.5 and model.selector.schedule()[0] == pytest.approx(5.0)
    assert not torch.equal(before, model.selector.scores.detach())
    assert head_count(model.deploy()) == 5


def test_weighted_knn_votes():
    from vitexp.training.modules import weighted_knn_votes

    bank = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    labels = torch.tensor([0, 0, 1])
    votes = weighted_knn_votes(
        torch.tensor([[1.0, 0.05], [0.05, 1.0]]), bank, labels, 2, k=2, temperature=0.07
    )
    assert votes.argmax(-1).tolist() == [0, 1]
    sims = (
        torch.nn.functional.normalize(torch.tensor([[1.0, 0.05]]), dim=-1)
        @ torch.nn.functional.normalize(bank, dim=-1).T
    )
    top = sims[0].topk(2).values
    torch.testing.assert_close(votes[0, 0], (top / 0.07).exp().sum())


def test_train_eval_loader_shards_hold_each_image_once():
    """The k-NN memory bank's shards under DDP: every training image in exactly one rank, in order."""
    from vitexp.data.datamodules import SyntheticDataModule

    dm = SyntheticDataModule(
        num_train=101, num_val=4, num_test=4, batch_size=16, data_config={"input_size": (3, 8, 8)}
    )
    dm.setup()
    whole = torch.cat([x for x, _ in dm.train_eval_dataloader()])
    for world in (2, 3):
        shards = [torch.cat([x for x, _ in dm.train_eval_dataloader(r, world)]) for r in range(world)]
        assert sum(len(s) for s in shards) == 101
        torch.testing.assert_close(torch.cat(shards), whole)


# -- the reported accuracy is the deployed model's -----------------------------------------------

#: A small run where attention matters (LayerScale 1) and the gates stay soft (α = 1 throughout),
#: so the soft-gated model and the deployed one differ.
SOFT_RUN = [
    "backbone=dinov2_micro",
    "+backbone.kwargs.init_values=1.0",
    "budget=heads",
    "budget.k=5",
    "method.alpha_end=1.0",
    "data=synthetic",
    "data.num_train=128",
    "data.num_val=32",
    "data.num_test=64",
    "data.noise=2.0",
    "recipe.batch_size=32",
    "recipe.epochs=2",
    "recipe.warmup_epochs=0",
    "recipe.lr=0.01",
    "eval.throughput_iters=1",
    "eval.throughput_batch=8",
    "trainer.num_sanity_val_steps=0",
    "trainer.limit_val_batches=0",
]


def independent_accuracy(model: nn.Module, cfg, objective: str) -> float:
    """Top-1 (%) of ``model`` on the run's test split, computed here: argmax of the logits, or the
    weighted k-NN over the training split's features."""
    from vitexp.training.build import build_datamodule, data_config_for
    from vitexp.training.modules import weighted_knn_votes

    dm = build_datamodule(cfg, data_config_for(cfg, model.backbone))
    dm.setup("test")
    model.eval()
    with torch.no_grad():
        x, y = map(torch.cat, zip(*dm.test_dataloader()))
        out = model(x)
        if objective == "distill":
            bx, by = map(torch.cat, zip(*dm.train_eval_dataloader()))
            out = weighted_knn_votes(out, model(bx), by, int(cfg.data.num_classes), 20, 0.07)
    return 100.0 * float((out.argmax(-1) == y).float().mean())


@pytest.mark.parametrize("method", ["saper_ft", "saper_kd"])
def test_run_reports_and_saves_the_deployed_model(method, make_cfg, results_dir, tmp_path):
    """top1 is the physically pruned model's accuracy; artifacts.weights is that model, rebuilt
    from the ledger (kept_heads) without the training code's gates; soft_top1 is the gated model's."""
    from conftest import QUIET, ledger_entries

    from vitexp.commands.train import train
    from vitexp.methods import method_from_config
    from vitexp.training.build import build_configured_backbone

    cfg = make_cfg(QUIET + SOFT_RUN + [f"method={method}"], tmp_path / method)
    metrics = train(cfg)["metrics"]
    (entry,) = ledger_entries(results_dir)
    assert entry["status"] == "completed" and metrics["heads"] == 5
    assert sum(len(h) for h in entry["kept_heads"]) == 5 and "soft_top1" in entry["metrics"]

    torch.manual_seed(123)  # the rebuilt backbone's own initial weights are all overwritten
    rebuilt = method_from_config(cfg.method).rebuild_deployed(build_configured_backbone(cfg), entry)
    rebuilt.load_state_dict(torch.load(local_path(entry["artifacts"]["weights"], results_dir)), strict=True)
    assert head_count(rebuilt) == 5
    assert all(type(b.attn) in (Attention, ConstantBranch) for b in rebuilt.backbone.blocks)
    objective = "distill" if method == "saper_kd" else "classify"
    assert entry["metrics"]["top1"] == pytest.approx(independent_accuracy(rebuilt, cfg, objective), abs=1e-4)
