"""SAPER's two stages (vitexp/methods/saper/method.py): ``select`` then ``recover`` of the deployed
model, the same recovery for every selection rule, the three accuracies of one run, and resume in
the middle of ``recover``."""

from __future__ import annotations

import pytest
import torch
from conftest import QUIET, ledger_entries
from lightning.pytorch.callbacks import Callback

#: A small run where attention matters (LayerScale 1), two epochs of each stage at an lr that moves
#: the MLPs visibly.
RUN = QUIET + [
    "backbone=dinov2_micro",
    "method=saper_ft",
    "+backbone.kwargs.init_values=1.0",
    "budget=heads",
    "budget.k=5",
    "data=synthetic",
    "data.num_train=96",
    "data.num_val=32",
    "data.num_test=64",
    "data.noise=2.0",
    "recipe.batch_size=32",
    "recipe.epochs=2",
    "recipe.warmup_epochs=0",
    "recipe.lr=0.01",
    "method.recover_epochs=2",
    "method.recover_lr=0.01",
    "eval.throughput=false",
    "trainer.num_sanity_val_steps=0",
]


class StageSteps(Callback):
    """Counts the training batches each kind of model saw in this process (``HeadPrunedModel``:
    LapSum's select; ``ProbeModel`` / ``DistillPair``: a fixed rule's select or the recovery)."""

    def __init__(self, crash_in_recover_epoch: int | None = None):
        self.steps: dict[str, int] = {}
        self.crash_epoch = crash_in_recover_epoch
        self.stage = None

    def on_train_start(self, trainer, pl_module):
        self.stage = trainer.default_root_dir

    def on_train_epoch_start(self, trainer, pl_module):
        if (
            self.crash_epoch is not None
            and type(pl_module.model).__name__ == "ProbeModel"
            and trainer.current_epoch == self.crash_epoch
        ):
            raise RuntimeError("preempted")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        name = type(pl_module.model).__name__
        self.steps[name] = self.steps.get(name, 0) + 1


def select_checkpoint_model(cfg, output_dir):
    """The deployed model at the end of ``select``, rebuilt here from the select stage's checkpoint."""
    from vitexp.methods import method_from_config
    from vitexp.training.build import build_configured_backbone

    method = method_from_config(cfg.method)
    torch.manual_seed(0)
    model = method.apply(build_configured_backbone(cfg), cfg.budget)
    state = torch.load(
        output_dir / "checkpoints" / "select" / "last.ckpt", map_location="cpu", weights_only=True
    )
    model.load_state_dict({k[len("model.") :]: v for k, v in state["state_dict"].items()})
    return method.deploy(model)


def deployed_weights(entry, results_dir):
    from vitexp.ledger.paths import local_path

    return torch.load(
        local_path(entry["artifacts"]["weights"], results_dir), map_location="cpu", weights_only=True
    )


@pytest.mark.parametrize("selection", ["lapsum", "random"])
def test_recover_trains_the_mlps_and_the_probe_of_the_deployed_model_and_leaves_attention(
    selection, make_cfg, results_dir, tmp_path
):
    """After ``recover`` the deployed weights (what ``top1``, FLOPs and the artifact are) differ from
    the deployed model at the end of ``select`` in every MLP and in the probe, and equal it in every
    attention weight; ``selected_top1`` is that earlier model's accuracy and ``top1`` the final one's."""
    from test_saper import independent_accuracy

    from vitexp.commands.train import train

    cfg = make_cfg(RUN + [f"method.selection={selection}"], tmp_path / "run")
    metrics = train(cfg)["metrics"]
    (entry,) = ledger_entries(results_dir)
    selected = select_checkpoint_model(cfg, tmp_path / "run")
    before, after = selected.state_dict(), deployed_weights(entry, results_dir)
    assert before.keys() == after.keys()
    attention = [k for k in after if ".attn." in k]
    mlps = [k for k in after if ".mlp." in k]
    assert attention and mlps
    for key in attention:
        assert torch.equal(before[key], after[key]), f"recover changed {key}"
    for key in mlps + ["head.weight", "head.bias"]:
        assert not torch.equal(before[key], after[key]), f"recover left {key} as selected"
    assert metrics["selected_top1"] == pytest.approx(
        independent_accuracy(selected, cfg, "classify"), abs=1e-4
    )
    selected.load_state_dict(after)
    assert metrics["top1"] == pytest.approx(independent_accuracy(selected, cfg, "classify"), abs=1e-4)
    assert metrics["top1"] != metrics["selected_top1"]
    if (
        selection == "lapsum"
    ):  # straight-through after the anneal: the model select ends on is the deployed one
        assert metrics["soft_top1"] == pytest.approx(metrics["selected_top1"])
        assert set(entry["gate_summary"]) == {
            "kept_gate_min",
            "kept_gate_mean",
            "dropped_gate_max",
            "dropped_gate_mass",
        }


def test_lapsums_probe_is_fitted_on_the_deployed_model():
    """The recovery stage trains the probe under the physically pruned backbone (no gates)."""
    import timm

    from vitexp.methods.saper import SaperHeads
    from vitexp.methods.saper.selector import HeadPrunedModel

    method = SaperHeads(recover_epochs=1)
    torch.manual_seed(0)
    model = method.apply(
        timm.create_model("vit_micro_patch14_dinov2", num_classes=10), {"kind": "heads", "k": 5}
    )
    select, recover = method.stages(model)
    assert isinstance(select.model(), HeadPrunedModel)
    recovered = recover.model()
    assert not isinstance(recovered, HeadPrunedModel) and not hasattr(recovered, "selector")
    assert sum(b.attn.num_heads for b in recovered.backbone.blocks if hasattr(b.attn, "num_heads")) == 5
    assert recovered.head.weight.requires_grad
    torch.testing.assert_close(recovered.head.weight, model.head.weight)  # continued from select's probe
    x = torch.randn(2, 3, 56, 56)
    recovered(x).sum().backward()
    assert recovered.head.weight.grad is not None


def _recovery(mode: str, selection: str):
    """The recovery stage of one spec row (fmnist_saper_table1, k = 6): its composed method config,
    the stage, and the names of the parameters it trains."""
    import vitexp.config.composition as vconfig
    from vitexp.config import rows
    from vitexp.methods import method_from_config
    from vitexp.training.build import build_configured_backbone

    row = {
        "experiment": "fmnist_saper_dinov2_micro",
        "overrides": [f"method=saper_{mode}", "budget.k=6", f"method.selection={selection}"],
    }
    cfg = vconfig.compose(
        [o for o in rows.job_arguments(row, seeded=False) if not o.startswith("name=")]
        + ["backbone.pretrained=null"]
    )
    method = method_from_config(cfg.method)
    torch.manual_seed(0)
    model = method.apply(build_configured_backbone(cfg), cfg.budget)
    stage = method.stages(model)[-1]
    from vitexp.methods.saper.surgery import ConstantBranch

    recovered = stage.model()
    # a layer left without heads freezes its norm1, which feeds nothing
    # (vitexp.methods.saper.method.set_trainable):
    # which layers those are is the selection's; counted as trained, the rules' lists compare as before
    empty = {n.removesuffix(".attn") for n, m in recovered.named_modules() if isinstance(m, ConstantBranch)}
    trained = sorted(
        n for n, p in recovered.named_parameters() if p.requires_grad or n.rsplit(".norm1.", 1)[0] in empty
    )
    return cfg, stage, trained


@pytest.mark.parametrize("mode", ["ft", "kd"])
def test_every_selection_rule_gets_the_identical_recovery(mode):
    """LapSum and a fixed rule differ in the heads only: the same composed config but for
    ``method.selection``, the same recovery stage (objective, recipe, module settings) and the same
    trained parameters (named without the layer-wise head counts, which the selection sets)."""
    from omegaconf import OmegaConf

    lap_cfg, lap, lap_trained = _recovery(mode, "lapsum")
    for rule in ("random", "magnitude"):
        cfg, stage, trained = _recovery(mode, rule)
        a, b = OmegaConf.to_container(lap_cfg), OmegaConf.to_container(cfg)
        assert a["method"].pop("selection") == "lapsum" and b["method"].pop("selection") == rule
        assert a == b
        assert stage.name == lap.name == "recover" and stage.objective == lap.objective
        assert dict(stage.recipe) == dict(lap.recipe) == {"epochs": 2, "lr": 5e-4}
        assert dict(stage.module_kwargs) == dict(lap.module_kwargs)
        assert trained == lap_trained
    assert not any(".attn." in n for n in lap_trained) and any(".mlp." in n for n in lap_trained)
    assert any("norm" in n for n in lap_trained)


def test_resume_in_the_middle_of_recover_does_not_select_again(make_cfg, results_dir, tmp_path):
    """A run preempted in recover's second epoch, resumed: select restores its checkpoint and trains
    no batch; recover trains only its second epoch; the metrics equal an uninterrupted run's."""
    from vitexp.commands.train import train

    over = RUN + ["resume=auto"]
    whole = train(make_cfg(over, tmp_path / "whole"))["metrics"]
    first = StageSteps(crash_in_recover_epoch=1)
    with pytest.raises(RuntimeError, match="preempted"):
        train(make_cfg(over, tmp_path / "split"), callbacks=[first])
    assert first.steps == {"HeadPrunedModel": 6, "ProbeModel": 3}
    again = StageSteps()
    resumed = train(make_cfg(over, tmp_path / "split"), callbacks=[again])["metrics"]
    assert again.steps == {"ProbeModel": 3}
    for key in ("top1", "selected_top1", "soft_top1", "steps"):
        assert resumed[key] == pytest.approx(whole[key]), key
    assert resumed["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-5)


def _recovery_start(mode: str, selection: str, overrides: tuple[str, ...] = ()):
    """The model one fmnist_saper_table1 row (k = 6) enters ``recover`` with, built from the composed
    config on the same backbone weights (seed 0), and its method; LapSum's ``select`` is taken as
    over (progress 1) with the scores it is handed afterwards (:func:`_lapsum_keeping`)."""
    import vitexp.config.composition as vconfig
    from vitexp.config import rows
    from vitexp.methods import method_from_config
    from vitexp.training.build import build_configured_backbone

    row = {
        "experiment": "fmnist_saper_dinov2_micro",
        "overrides": [f"method=saper_{mode}", "budget.k=6", f"method.selection={selection}", *overrides],
    }
    cfg = vconfig.compose(
        [o for o in rows.job_arguments(row, seeded=False) if not o.startswith("name=")]
        + ["backbone.pretrained=null", "+backbone.kwargs.init_values=1.0"]
    )
    method = method_from_config(cfg.method)
    torch.manual_seed(0)
    backbone = build_configured_backbone(cfg)
    return method, method.apply(backbone, cfg.budget)


def _lapsum_keeping(model, kept: list[list[int]]) -> None:
    """LapSum's scores after a selection that keeps ``kept``: those heads 0.02 above the others,
    close enough that their final gates stay well below 1 (what the Fashion-MNIST runs ended with)."""
    selector = (model.student if hasattr(model, "student") else model).selector
    with torch.no_grad():
        selector.scores.zero_()
        for layer, heads in enumerate(kept):
            for h in heads:
                selector.scores[layer * selector.heads + h] = 0.02
        selector.progress.fill_(1.0)
    assert float(selector.final_gates().max()) < 0.9  # a fold would scale every kept head


@pytest.mark.parametrize("mode", ["ft", "kd"])
def test_lapsum_and_a_fixed_rule_keeping_the_same_heads_start_recover_from_the_same_tensors(mode):
    """Two rules at the same k that keep the same heads enter ``recover`` with the same model, tensor
    by tensor: the backbone less the other heads, each kept head's q, k, v rows and output-projection
    columns as the backbone has them (LapSum's final gates, well below 1 here, are not folded in).
    Only the probe, which ``select`` fits, may differ. Fails with the gates folded (fold_gates=true)."""
    from vitexp.methods.saper.selection import magnitude_scores, top_k_heads

    magnitude, fixed = _recovery_start(mode, "magnitude")
    lapsum, learned = _recovery_start(mode, "lapsum")
    kept = top_k_heads(magnitude_scores(learned.student.backbone if mode == "kd" else learned.backbone), 6)
    assert kept == magnitude.kept_heads and sum(map(len, kept)) == 6
    _lapsum_keeping(learned, kept)
    a = magnitude.recovery_model(fixed).state_dict()
    b = lapsum.recovery_model(learned).state_dict()
    assert lapsum.kept_heads == kept
    probe = {k for k in a if k.startswith("head.")} if mode == "ft" else set()
    assert a.keys() == b.keys() and len(a) > len(probe) + 40
    differ = [k for k in a if k not in probe and not torch.equal(a[k], b[k])]
    assert not differ, f"the recovery starts differ in {differ}"
    projection = [k for k in a if k.endswith("attn.proj.weight")]
    assert projection and all(a[k].shape[1] > 0 for k in projection if k in b)


class KillAfterLastEpoch(Callback):
    """Ends the run at the end of ``stage``'s fit, once the checkpoint of its last epoch is written."""

    def __init__(self, stage: str):
        self.stage = stage

    def on_train_end(self, trainer, pl_module):
        if trainer.checkpoint_callback.dirpath.endswith(f"checkpoints/{self.stage}"):
            raise RuntimeError("preempted")


@pytest.mark.parametrize(
    "selection, stage", [("lapsum", "select"), ("lapsum", "recover"), ("random", "select")]
)
def test_a_run_killed_after_the_last_epoch_of_a_stage_resumes_with_every_metric(
    selection, stage, make_cfg, results_dir, tmp_path
):
    """Killed once a stage's last epoch is checkpointed, the resumed run restores that stage without
    validating it again: its last validation metrics (LapSum's soft_val_*, a fixed rule's
    selected_val_*, recover's val_*) come back from the checkpoint, every metric but the times equals
    an uninterrupted run's, and wall_time_s sums the attempts, as fit_time_s does."""
    from vitexp.commands.train import train

    over = RUN + ["resume=auto", f"method.selection={selection}"]
    whole = train(make_cfg(over, tmp_path / "whole"))["metrics"]
    with pytest.raises(RuntimeError, match="preempted"):
        train(make_cfg(over, tmp_path / "split"), callbacks=[KillAfterLastEpoch(stage)])
    resumed = train(make_cfg(over, tmp_path / "split"))["metrics"]
    val = {k for k in whole if "val_" in k}
    assert {"val_top1", "soft_val_top1" if selection == "lapsum" else "selected_val_top1"} <= val
    assert all(whole[k] is not None for k in val)
    assert resumed.keys() == whole.keys()
    for key in sorted(k for k in whole if not k.endswith("time_s") and "throughput" not in k):
        assert resumed[key] == pytest.approx(whole[key], rel=1e-5), key
    (entry,) = [e for e in ledger_entries(results_dir) if len(e.get("attempts") or []) == 1]
    attempts = sum(a["wall_time_s"] for a in entry["attempts"]) + entry["attempt_wall_time_s"]
    assert entry["attempts"][0]["wall_time_s"] > 0
    assert resumed["wall_time_s"] == pytest.approx(attempts, abs=1.0)
    assert resumed["wall_time_s"] >= resumed["fit_time_s"]
