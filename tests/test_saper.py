"""SAPER's head gating, physical head removal and FLOPs protocol (vitexp/methods/saper.py)."""
from __future__ import annotations

import pytest
import timm
import torch

import vitexp  # noqa: F401
from vitexp.flops import count_macs
from vitexp.methods.saper import HeadPrunedModel, HeadSelector, ProbeModel, SaperHeads, head_count


def micro(num_classes: int = 10):
    torch.manual_seed(0)
    return timm.create_model("vit_micro_patch14_dinov2", num_classes=num_classes)


@pytest.mark.parametrize("k", [1, 3, 6, 15])
def test_deployed_model_has_k_heads_and_equals_the_hard_gated_model(k):
    model = SaperHeads().apply(micro(), {"kind": "heads", "k": k})
    with torch.no_grad():
        model.selector.scores.copy_(torch.randn(16))
    x = torch.randn(3, 3, 56, 56)
    model.eval()
    model.hard = True
    expected = model(x)
    deployed = model.deploy()
    assert head_count(deployed) == k
    torch.testing.assert_close(deployed.eval()(x), expected, rtol=1e-5, atol=1e-5)
    assert count_macs(deployed, 56).gmacs < count_macs(ProbeModel(micro(), 10), 56).gmacs


def test_a_layer_without_heads_keeps_only_the_projection_bias():
    model = SaperHeads().apply(micro(), {"kind": "heads", "k": 4})
    with torch.no_grad():
        model.selector.scores.copy_(torch.tensor([9.0] * 4 + [-9.0] * 12))  # all of layer 0, nothing else
    deployed = model.deploy()
    assert [getattr(b.attn, "num_heads", 0) for b in deployed.backbone.blocks] == [4, 0, 0, 0]


def test_gates_anneal_from_all_heads_to_k_and_get_gradients():
    sel = HeadSelector(4, 4, k=3, alpha_start=1.0, alpha_end=0.01, anneal_fraction=0.5)
    start = sel.gates()
    assert float(start.sum()) == pytest.approx(15.5, abs=1e-4) and float(start.min()) > 0.9
    sel.progress.fill_(0.25)
    k_mid, _ = sel.schedule()
    assert 3 < k_mid < 16 and float(sel.gates().sum()) == pytest.approx(k_mid, abs=1e-4)
    sel.progress.fill_(1.0)
    g = sel.gates()
    assert float(g.sum()) == pytest.approx(3.0, abs=1e-4)
    (g * torch.arange(16.0).view(4, 4)).sum().backward()
    assert sel.scores.grad is not None and sel.scores.grad.abs().sum() > 0


def test_backbone_is_frozen_by_default_and_scores_train():
    model = SaperHeads().apply(micro(), {"kind": "heads", "k": 5})
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"selector.scores", "head.weight", "head.bias"}


@pytest.mark.parametrize("name, k, gflops", [
    ("vit_base_patch14_dinov2", None, 46.33),
    ("vit_small_patch14_dinov2", None, 12.25),
    ("vit_base_patch14_dinov2", 24, 32.17),
    ("vit_base_patch14_dinov2", 6, 30.05),
])
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
    """ClassifyModule tells the model its progress; after training the gates sum to k."""
    import lightning as L

    from vitexp.data import SyntheticDataModule
    from vitexp.module import ClassifyModule
    import vitexp.config as vconfig

    model = SaperHeads(anneal_fraction=0.5).apply(micro(), {"kind": "heads", "k": 5})
    recipe = dict(vconfig.compose(["recipe.epochs=2", "recipe.warmup_epochs=0", "recipe.lr=0.01"]).recipe)
    dm = SyntheticDataModule(num_train=64, num_val=16, num_test=16, batch_size=16,
                             data_config={"input_size": (3, 56, 56)})
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    before = model.selector.scores.detach().clone()
    trainer.fit(ClassifyModule(model, 10, recipe), datamodule=dm)
    assert float(model.selector.progress) > 0.5
    assert float(model.selector.gates().sum()) == pytest.approx(5.0, abs=1e-3)
    assert not torch.equal(before, model.selector.scores.detach())
    assert head_count(model.deploy()) == 5


def test_weighted_knn_votes():
    from vitexp.module import weighted_knn_votes

    bank = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    labels = torch.tensor([0, 0, 1])
    votes = weighted_knn_votes(torch.tensor([[1.0, 0.05], [0.05, 1.0]]), bank, labels, 2, k=2, temperature=0.07)
    assert votes.argmax(-1).tolist() == [0, 1]
    sims = torch.nn.functional.normalize(torch.tensor([[1.0, 0.05]]), dim=-1) @ torch.nn.functional.normalize(bank, dim=-1).T
    top = sims[0].topk(2).values
    torch.testing.assert_close(votes[0, 0], (top / 0.07).exp().sum())


@pytest.mark.parametrize("method", ["saper_ft", "saper_kd"])
def test_micro_dinov2_trains_in_both_modes_on_digits_and_ends_with_k_heads(method, make_cfg, results_dir, tmp_path):
    from vitexp.train import train

    from conftest import QUIET, ledger_entries

    cfg = make_cfg(QUIET + ["backbone=dinov2_micro", f"method={method}", "budget=heads", "budget.k=5",
                            "recipe.epochs=3", "recipe.warmup_epochs=0", "recipe.lr=0.01",
                            "eval.throughput_iters=1", "eval.throughput_batch=8"], tmp_path / method)
    metrics = train(cfg)["metrics"]
    assert metrics["heads"] == 5
    assert metrics["top1"] > 20  # 10 classes: chance is 10 %
    (entry,) = ledger_entries(results_dir)
    assert entry["status"] == "completed" and entry["metrics"]["gmacs"] > 0
