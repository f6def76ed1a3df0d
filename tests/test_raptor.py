"""RAPTOR (vitexp/methods/raptor/): phases, surrogate, the two training stages, the cache,
the probes in a run, the phases analysis and the FLOPs audit."""

from __future__ import annotations

import pytest
import timm
import torch
from conftest import run_config

import vitexp  # noqa: F401
from vitexp.config.composition import ConfigError
from vitexp.measure.flops import count_macs
from vitexp.methods.probe import ProbeModel
from vitexp.methods.raptor import (
    RaptorDistill,
    RaptorSurrogate,
    TeacherCache,
    anneal_tau,
    layer_distance_matrix,
    max_cut_phases,
    phases_for_blocks,
    teacher_states,
    weighted_token_mse,
)


def block_matrix(sizes, inside=0.1, outside=1.0):
    n = sum(sizes)
    w = torch.full((n, n), outside)
    start = 0
    for s in sizes:
        w[start : start + s, start : start + s] = inside
        start += s
    w.fill_diagonal_(0)
    return w


@pytest.mark.parametrize("sizes", [[7, 5], [7, 3, 2]])
def test_max_cut_recovers_constructed_phases(sizes):
    phases = max_cut_phases(block_matrix(sizes), f=0.7, min_size=2)
    assert [len(p) for p in phases] == sizes
    assert [l for p in phases for l in p] == list(range(sum(sizes)))


def dinov2_b_like_matrix():
    """12 layers drifting along one path: steps of 0.1 inside RAPTOR's ViT-B phases
    [1-4][5-7][8-10][11-12] and jumps of 0.4, 1.0, 0.6 between them; distance 2(1 − e^(−gap)),
    which saturates at 2 like 1 − cos summed over CLS and mean patch."""
    steps = [0.1] * 11
    steps[3], steps[6], steps[9] = 0.4, 1.0, 0.6
    position = torch.tensor([0.0] + steps).cumsum(0).double()
    return 2 * (1 - torch.exp(-(position[:, None] - position[None, :]).abs()))


@pytest.mark.parametrize("matrix", ["blocks", "dinov2_b_like"])
@pytest.mark.parametrize("sizes", [[7, 5], [7, 3, 2], [4, 3, 3, 2]])
def test_phases_for_a_block_budget_recover_raptors_vit_b_partitions(sizes, matrix):
    """RAPTOR's ViT-B phases: [1-7][8-12]; [1-7][8-10][11-12]; [1-4][5-7][8-10][11-12]."""
    w = block_matrix(sizes) if matrix == "blocks" else dinov2_b_like_matrix()
    assert [len(p) for p in phases_for_blocks(w, len(sizes))] == sizes


def test_the_free_threshold_is_vitexps_rule_and_gives_5_phases_on_a_dinov2_b_like_matrix():
    """What docs/reading-raptor.md says of ``vitexp-analyze phases``: at the default f = 0.7 the drift inside
    RAPTOR's first phase [1-4] is cut too; only a block budget gives RAPTOR's partitions."""
    from vitexp.analysis.phases import one_based

    assert one_based(max_cut_phases(dinov2_b_like_matrix(), f=0.7)) == "[1-2][3-4][5-7][8-10][11-12]"


def test_homogeneous_layers_are_not_split():
    assert max_cut_phases(block_matrix([12], inside=1.0), f=0.7) == [list(range(12))]


def test_layer_distance_matrix():
    feats = torch.randn(5, 8, 2, 16)
    feats[3] = feats[2]  # two identical layers: distance 0
    d = layer_distance_matrix(feats)
    assert d.shape == (5, 5)
    torch.testing.assert_close(d, d.T)
    assert float(d[2, 3]) == pytest.approx(0.0, abs=1e-9) and float(d.diagonal().abs().max()) < 1e-9
    assert float(d[0, 1]) > 0.5  # random directions: 1 - cos ~ 1 for each of the 2 token kinds


@pytest.mark.parametrize(
    "phases", [[range(0, 7), range(7, 12)], [range(0, 4), range(4, 7), range(7, 10), range(10, 12)]]
)
@pytest.mark.parametrize(
    "name, gflops", [("vit_base_patch14_reg4_dinov2", 61.86), ("vit_small_patch14_reg4_dinov2", 16.15)]
)
def test_raptor_flops_under_its_own_setting(name, gflops, phases):
    """224 px, 4 registers (261 tokens), SwiGLU, 12 block applications, linear head on
    [CLS ‖ mean patch]: the same GFLOPs for 2 and 4 blocks."""
    teacher = timm.create_model(name, img_size=224, num_classes=1000)
    surrogate = RaptorSurrogate(teacher, [list(p) for p in phases])
    model = ProbeModel(surrogate, 1000)
    assert count_macs(model, 224, registers=4).gflops == pytest.approx(gflops, abs=0.02)


def test_surrogate_runs_all_layers_with_k_blocks_and_only_blocks_train():
    torch.manual_seed(0)
    teacher = timm.create_model("vit_micro_patch14_dinov2", num_classes=0)
    surrogate = RaptorSurrogate(teacher, [[0, 1], [2, 3]])
    calls = []
    for b in surrogate.blocks:
        b.attn.register_forward_hook(lambda m, i, o: calls.append(1))
    out = surrogate.forward_features(torch.randn(2, 3, 56, 56))
    assert out.shape == (2, 17, 64) and len(calls) == 4 and len(surrogate.blocks) == 2
    trainable = {n.split(".")[0] for n, p in surrogate.named_parameters() if p.requires_grad}
    assert trainable == {"blocks"}
    out.sum().backward()
    assert all(p.grad is not None for p in surrogate.blocks.parameters())


def micro_teacher(reg_tokens: int = 4, depth: int = 4):
    torch.manual_seed(0)
    return timm.create_model(
        "vit_micro_patch14_dinov2", num_classes=0, reg_tokens=reg_tokens, depth=depth
    ).eval()


def test_tau_anneals_from_teacher_forced_to_autoregressive_over_a_quarter_of_the_steps():
    assert [anneal_tau(p) for p in (0.0, 0.125, 0.25, 0.5, 1.0)] == [1.0, 0.5, 0.0, 0.0, 0.0]


def test_weighted_token_mse_weights_cls_registers_and_patches():
    target = torch.zeros(2, 1 + 4 + 16, 8)
    for kind, sl, weight in (
        ("cls", slice(0, 1), 0.45),
        ("registers", slice(1, 5), 0.10),
        ("patches", slice(5, None), 0.45),
    ):
        pred = target.clone()
        pred[:, sl] = 2.0  # squared error 4 on that kind's tokens only
        assert float(weighted_token_mse(pred, target, 5)) == pytest.approx(4 * weight), kind
    pred = target.clone()
    pred[:, 1:] = 1.0  # no registers: CLS and patches renormalised to 0.5 each
    assert float(
        weighted_token_mse(pred[:, [0] + list(range(5, 21))], target[:, [0] + list(range(5, 21))], 1)
    ) == pytest.approx(0.5)


def test_teacher_states_are_the_blocks_outputs():
    teacher = micro_teacher()
    x = torch.randn(2, 3, 56, 56)
    h = teacher_states(teacher, x)
    assert h.shape == (5, 2, 21, 64)
    torch.testing.assert_close(teacher.norm(h[-1]), teacher.forward_features(x))


def pair_with_recorded_blocks():
    """A micro teacher/surrogate pair, an input, the teacher's states, and the list each block
    application appends (its input, its output) to."""
    teacher = micro_teacher()
    pair = RaptorDistill(teacher, RaptorSurrogate(teacher, [[0, 1], [2, 3]]))
    x = torch.randn(2, 3, 56, 56)
    seen = []
    for block in pair.surrogate.blocks:
        block.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    return pair, x, teacher_states(teacher, x), seen


def test_stage1_teacher_forced_feeds_each_block_the_teachers_states_and_trains_only_blocks():
    pair, x, h, seen = pair_with_recorded_blocks()
    loss = pair.stage1_loss(x, tau=1.0)
    assert len(seen) == 4
    for (got, _), layer in zip(seen, [0, 1, 2, 3]):
        torch.testing.assert_close(got, h[layer])
    loss.backward()
    assert all(p.grad is not None for p in pair.surrogate.blocks.parameters())
    assert all(p.grad is None for p in pair.teacher.parameters())


def test_stage1_autoregressive_feeds_each_block_its_own_output_from_the_phase_start():
    pair, x, h, seen = pair_with_recorded_blocks()
    pair.stage1_loss(x, tau=0.0)
    (in0, out0), (in1, _), (in2, out2), (in3, _) = seen
    torch.testing.assert_close(in0, h[0])
    torch.testing.assert_close(in1, out0)  # recurrent: its own output
    torch.testing.assert_close(in2, h[2])  # the second block starts from the teacher at its phase start
    torch.testing.assert_close(in3, out2)


def test_stage2_runs_the_whole_surrogate_and_equals_the_weighted_mse_per_layer():
    teacher = micro_teacher()
    pair = RaptorDistill(teacher, RaptorSurrogate(teacher, [[0, 1], [2, 3]]))
    x = torch.randn(2, 3, 56, 56)
    h = teacher_states(teacher, x)
    z, expected = h[0], []
    for block, phase in zip(pair.surrogate.blocks, pair.surrogate.phases):
        for layer in phase:
            z = block(z, layer)
            expected.append(weighted_token_mse(z, h[layer + 1], 5))
    torch.testing.assert_close(pair.stage2_loss(x), sum(expected) / 4)
    torch.testing.assert_close(teacher.norm(z), pair.surrogate.forward_features(x))
    final = RaptorDistill(teacher, pair.surrogate, stage2_targets="final")
    torch.testing.assert_close(final.stage2_loss(x), expected[-1] * 0 + weighted_token_mse(z, h[-1], 5))


def test_teacher_cache_hits_on_the_same_images_and_misses_on_new_ones(tmp_path):
    teacher = micro_teacher()
    cache = TeacherCache(tmp_path / "cache", teacher)
    x = torch.randn(3, 3, 56, 56)
    first = cache.states(teacher, x)
    assert (cache.hits, cache.misses) == (0, 3) and len(list(cache.dir.glob("*.pt"))) == 3
    again = cache.states(teacher, torch.cat([x[:2], torch.randn(1, 3, 56, 56)]))
    assert (cache.hits, cache.misses) == (2, 4)
    torch.testing.assert_close(again[:, :2], first[:, :2], rtol=1e-3, atol=1e-3)  # stored in float16
    torch.testing.assert_close(first, teacher_states(teacher, x), rtol=1e-3, atol=1e-3)
    other = micro_teacher(depth=4)
    other.blocks[0].mlp.fc1.weight.data += 1
    assert TeacherCache(tmp_path / "cache", other).dir != cache.dir  # another teacher, another folder


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["budget.k=4"], r"budget.k: 4 blocks must be in \[1, 3\]"),
        (["budget=heads"], "accepts budget kinds \\['blocks'\\]"),
        (["method.phases=[[0,1,2],[4,5]]"], "method.phases"),
        (["+method.probe.lrr=1"], "method.probe.lrr: not a key of method.probe"),  # past Hydra's struct check
        (["backbone=caformer_micro"], "MetaFormer"),
    ],
)
def test_raptor_config_errors_name_the_key(make_cfg, overrides, match):
    from vitexp.training.resolve import validate

    base = ["backbone=dinov2_micro_reg", "method=raptor", "budget=blocks", "recipe=raptor"]
    with pytest.raises(ConfigError, match=match):
        validate(make_cfg(base + overrides))


def test_run_weights_that_do_not_exist_name_what_to_run(make_cfg):
    from vitexp.training.resolve import validate

    with pytest.raises(ConfigError, match="vitexp-train experiment=raptor_micro_teacher"):
        validate(make_cfg(["experiment=raptor_micro"]))


def test_micro_raptor_run_trains_teacher_then_surrogate_then_both_probes(make_cfg, results_dir, tmp_path):
    """Teacher (a short demo-recipe run) -> ``backbone.pretrained=run:<teacher>`` -> phases from
    its distance matrix, stages 1 and 2, the probes; the ledger holds both accuracies."""
    from conftest import QUIET, ledger_entries

    from vitexp.commands.train import train

    small = ["eval.throughput_iters=1", "eval.throughput_batch=8"]
    teacher = train(
        make_cfg(
            QUIET + small + ["experiment=raptor_micro_teacher", "recipe.epochs=4", "recipe.warmup_epochs=1"],
            tmp_path / "teacher",
        )
    )
    out = train(
        make_cfg(
            QUIET
            + small
            + [
                "experiment=raptor_micro",
                f"backbone.pretrained=run:{teacher['run_id']}",
                "recipe.epochs=2",
                "method.probe.epochs=3",
                "method.phase_images=64",
                "recipe.warmup_steps=4",
                "method.probe.warmup_steps=4",
            ],
            tmp_path / "raptor",
        )
    )
    m = out["metrics"]
    assert {"top1", "teacher_top1", "recovered", "stage1_val_loss", "stage2_val_loss"} <= set(m)
    assert m["best_val_top1"] >= m["val_top1"] and m["teacher_best_val_top1"] >= m["teacher_val_top1"]
    assert m["recovered"] == pytest.approx(m["top1"] / m["teacher_top1"])
    # above chance (10 classes: 10 %) by more than 3 binomial stds (1.6 points on 360 test digits)
    assert m["teacher_top1"] > 15 and m["top1"] > 15
    assert m["heads"] == 8  # 2 blocks x 4 heads, applied over 6 layers
    entry = [e for e in ledger_entries(results_dir) if e["run_id"] == out["run_id"]][0]
    assert entry["status"] == "completed" and entry["protocol"]["registers"] == 4
    assert len(entry["phases"]) == 2 and sum(map(len, entry["phases"])) == 6
    assert entry["phases_source"].startswith("max-cut") and len(entry["distance_matrix"]) == 6
    for stage in ("stage1", "stage2", "probe", "teacher_probe"):
        assert (tmp_path / "raptor" / "checkpoints" / stage / "last.ckpt").is_file()
    # the surrogate's weights: the probe model as deployed, loadable again
    from vitexp.ledger.paths import local_path

    state = torch.load(local_path(entry["artifacts"]["weights"], results_dir), weights_only=True)
    assert any(k.startswith("backbone.blocks.1.gate") for k in state)


def test_analyze_phases_writes_the_heatmap_and_phases(results_dir, capsys):
    import json

    from conftest import ledger_entries

    from vitexp.commands.cli import analyze_main

    analyze_main(
        ["phases", "backbone=dinov2_micro_reg", "logger=none", "--images", "32", "--blocks", "2", "3"]
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["status"] == "completed"
    (entry,) = ledger_entries(results_dir)
    assert open(out["figure"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"  # the ledger keeps it relative
    by_k = entry["metrics"]["phases_by_blocks"]
    assert sorted(by_k) == ["2", "3"] and all(sum(map(len, p)) == 6 for p in by_k.values())
    assert len(entry["distance_matrix"]) == 6


def test_audit_raptor_decomposes_the_flops_gap(results_dir):
    from vitexp.analysis import audit_raptor

    f = audit_raptor.audit(["s"])["s"]
    rows = f["rows"]
    assert rows["dinov2"]["gflops"] == pytest.approx(12.25, abs=0.02)
    assert rows["raptor_k2"]["gflops"] == pytest.approx(16.15, abs=0.02) and f["k_independent"]
    assert rows["raptor_k2"]["tokens"] == 261 and rows["raptor_noreg"]["tokens"] == 257
    # SwiGLU adds one d x 4d matrix per layer: 12 layers x 257 tokens x 4 d^2 MACs
    assert f["swiglu_gflops"] == pytest.approx(2 * 12 * 257 * 4 * 384**2 / 1e9, rel=1e-3)
    total = rows["raptor_k2"]["gflops"] - rows["dinov2"]["gflops"]
    assert f["swiglu_gflops"] + f["registers_gflops"] + f["gates_gflops"] == pytest.approx(total)
    assert "upheld" in audit_raptor.render({"s": f})


def test_phases_for_blocks_never_cuts_itself_out_of_the_budget():
    """6 uniform layers, 3 phases of >= 2: a first cut 3 | 3 would leave no third phase."""
    for k in (1, 2, 3):
        phases = phases_for_blocks(block_matrix([6], inside=1.0), k)
        assert len(phases) == k and [l for p in phases for l in p] == list(range(6))
        assert min(map(len, phases)) >= 2
    with pytest.raises(ValueError, match="cannot form 4 phases"):
        phases_for_blocks(block_matrix([6], inside=1.0), 4)


def test_resumed_raptor_run_skips_finished_stages_and_ends_with_the_same_metrics(make_cfg, tmp_path):
    """A finished run resumed from its folder: every stage restores its last checkpoint, nothing
    retrains, and the probes test to the same accuracies."""
    from conftest import QUIET

    from vitexp.commands.train import train

    base = QUIET + [
        "backbone=dinov2_micro",
        "method=raptor",
        "budget=blocks",
        "recipe=raptor",
        "data=synthetic",
        "data.num_train=32",
        "data.num_val=16",
        "data.num_test=16",
        "recipe.batch_size=8",
        "recipe.epochs=1",
        "recipe.warmup_steps=1",
        "method.probe.epochs=2",
        "method.probe.batch_size=8",
        "method.phase_images=16",
        "eval.throughput=false",
    ]
    first = train(make_cfg(base, tmp_path / "run"))["metrics"]
    ckpt = tmp_path / "run" / "checkpoints" / "probe" / "last.ckpt"
    stamp = ckpt.stat().st_mtime_ns
    again = train(make_cfg(base + ["resume=true"], tmp_path / "run"))["metrics"]
    for key in (
        "top1",
        "teacher_top1",
        "test_loss",
        "teacher_test_loss",
        "best_val_top1",
        "teacher_best_val_top1",
        "val_top1",
        "teacher_val_top1",
        "stage1_val_loss",
        "stage2_val_loss",
    ):  # restored stages validate nothing
        assert first[key] is not None and again[key] == pytest.approx(first[key]), key
    assert ckpt.stat().st_mtime_ns == stamp  # the probe was not trained again


@pytest.mark.parametrize("data, k, gflops", [("imagenet", 3, 16.15), ("cifar100", 4, 16.15)])
def test_vitexp_flops_on_raptor_experiments(data, k, gflops, make_cfg, results_dir):
    """What `vitexp-flops experiment=raptor_dinov2` records: RAPTOR's setting, any k (CIFAR's
    100-class head is smaller than ImageNet's)."""
    from vitexp.commands.inspect import run_flops

    out = run_flops(make_cfg(["experiment=raptor_dinov2", f"data={data}", f"budget.k={k}", "logger=none"]))
    head = 2 * 2 * 384 * (1000 - 100) / 1e9 if data == "cifar100" else 0.0
    assert out["metrics"]["gflops"] == pytest.approx(gflops - head, abs=0.02)
    assert out["protocol"]["registers"] == 4 and out["metrics"]["heads"] == 6 * k


def test_swiglu_gates_with_the_first_half():
    from vitexp.methods.raptor import swiglu

    mlp = swiglu(8, 32)
    x = torch.randn(2, 3, 8)
    a, b = mlp.fc1(x).chunk(2, dim=-1)
    assert mlp.fc1.out_features == 64 and mlp.fc2.in_features == 32
    torch.testing.assert_close(mlp(x), mlp.fc2(torch.nn.functional.silu(a) * b))


def test_teacher_probe_run_reads_the_teachers_accuracy_from_the_ledger(make_cfg, results_dir):
    from vitexp.ledger import LedgerEntry
    from vitexp.methods import method_from_config

    def teacher_probe_from_ledger(
        method, cfg
    ):  # as the run resolves what the method needs: it never reads storage
        from vitexp.training.resolve import resolve_needs

        method.lookup(cfg, resolve_needs(method, cfg.results_dir))
        return method.extra_metrics({})

    probe = LedgerEntry(
        "probe_micro",
        "train",
        run_config(top={"backbone": {"name": "dinov2_micro_reg"}, "data": {"name": "digits"}}),
        results_dir,
    ).start()
    probe.finish({"top1": 91.5, "top5": 99.0})
    cfg = make_cfg(
        [
            "backbone=dinov2_micro_reg",
            "method=raptor",
            "budget=blocks",
            f"method.teacher_probe_run={probe.run_id}",
        ]
    )
    method = method_from_config(cfg.method)
    assert teacher_probe_from_ledger(method, cfg) == {
        "teacher_top1": 91.5,
        "teacher_top5": 99.0,
        "teacher_probe_run": probe.run_id,
    }
    assert [s.name for s in method.stages(None)] == ["stage1", "stage2", "probe"]  # no teacher probe to train
    other = make_cfg(
        ["backbone=dinov2_micro", "method=raptor", "budget=blocks", "method.teacher_probe_run=probe_micro"]
    )
    with pytest.raises(ValueError, match="backbone is dinov2_micro_reg, this run's is dinov2_micro"):
        teacher_probe_from_ledger(method_from_config(other.method), other)


def test_a_wrong_teacher_probe_run_fails_before_any_training(make_cfg, results_dir, tmp_path):
    from conftest import QUIET, ledger_entries

    from vitexp.commands.train import train

    cfg = make_cfg(
        QUIET
        + [
            "backbone=dinov2_micro",
            "method=raptor",
            "budget=blocks",
            "data=synthetic",
            "method.teacher_probe_run=nope",
        ],
        tmp_path / "run",
    )
    with pytest.raises(FileNotFoundError, match="method.teacher_probe_run=nope"):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert ledger_entries(results_dir) == []  # found missing by the resolve step, before the run started


# -- as the reference trains it (KempnerInstitute/raptor) ------------------------------------------
def test_gate_sees_the_one_based_output_layer_and_starts_as_the_reference():
    """The reference feeds the gate MLP t = the 1-based index of the layer the application outputs
    (1..L), draws the gate's last bias from N(0, 1e-4), and uses nn.LayerNorm's eps 1e-5."""
    surrogate = RaptorSurrogate(micro_teacher(), [[0, 1], [2, 3]])
    seen = []
    for block in surrogate.blocks:
        block.gate.register_forward_hook(lambda m, args, out: seen.append(float(args[0])))
    surrogate.forward_features(torch.randn(1, 3, 56, 56))
    assert seen == [1.0, 2.0, 3.0, 4.0]
    block = surrogate.blocks[0]
    assert block.norm1.eps == block.norm2.eps == 1e-5
    assert 0.5e-4 < float(block.gate[2].bias.std()) < 2e-4


@pytest.mark.parametrize("tau", [1.0, 0.0])
def test_stage1_weights_tokens_for_the_block_that_ends_at_the_last_layer_and_sums_the_blocks(tau):
    """Phases [0, 1] | [2, 3] of 4 layers: the first block trains with plain MSE, the second
    (ending at the last layer) with the token-weighted MSE at the reference's stage-1 weights."""
    from vitexp.methods.raptor import STAGE1_FINAL_TOKEN_WEIGHTS

    teacher = micro_teacher()
    for block in teacher.blocks:  # LayerScale 1: consecutive layers differ, so the losses are not ~0
        block.ls1.gamma.data.fill_(1.0)
        block.ls2.gamma.data.fill_(1.0)
    pair = RaptorDistill(teacher, RaptorSurrogate(teacher, [[0, 1], [2, 3]]))
    x = torch.randn(2, 3, 56, 56)
    h = teacher_states(teacher, x)
    weighted = lambda p, t: weighted_token_mse(p, t, 5, STAGE1_FINAL_TOKEN_WEIGHTS)  # noqa: E731

    def block_loss(block, phase, criterion):
        if tau == 1.0:
            return sum(criterion(block(h[l], l), h[l + 1]) for l in phase) / len(phase)
        z, total = h[phase[0]], 0.0
        for l in phase:
            z = block(z, l)
            total = total + criterion(z, h[l + 1])
        return total / len(phase)

    first, second = pair.surrogate.blocks
    expected = block_loss(first, [0, 1], torch.nn.functional.mse_loss) + block_loss(second, [2, 3], weighted)
    assert float(expected) > 1e-4
    torch.testing.assert_close(pair.stage1_loss(x, tau), expected, rtol=1e-5, atol=0)
    assert STAGE1_FINAL_TOKEN_WEIGHTS == {"cls": 0.34, "registers": 0.33, "patches": 0.33}


@pytest.mark.parametrize("stage", [1, 2])
def test_stage1_clips_each_blocks_gradient_norm_and_stage2_clips_them_together(stage):
    """recipe.grad_clip through Lightning's clipping hook: in stage 1 a block with a large gradient
    is clipped to norm 1 and leaves the other block's small gradient alone (RAPTOR trains each
    block in a run of its own); in stage 2 one norm covers both."""
    import lightning as L

    from vitexp.training.modules import RaptorStageModule

    teacher = micro_teacher()
    pair = RaptorDistill(teacher, RaptorSurrogate(teacher, [[0, 1], [2, 3]]))
    module = RaptorStageModule(pair, 10, {}, stage=stage)
    module.trainer = L.Trainer(
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        accelerator="cpu",
    )
    big, small = pair.surrogate.blocks
    for block, value in ((big, 1.0), (small, 1e-4)):
        for p in block.parameters():
            p.grad = torch.full_like(p, value)
    small_before = [p.grad.clone() for p in small.parameters()]
    optimizer = torch.optim.AdamW(pair.surrogate.blocks.parameters())

    def norm(block):
        return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in block.parameters()])))

    big_norm, small_norm = norm(big), norm(small)
    module.configure_gradient_clipping(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
    if stage == 1:
        assert norm(big) == pytest.approx(1.0, rel=1e-4)
        for p, before in zip(small.parameters(), small_before):
            torch.testing.assert_close(p.grad, before, rtol=0, atol=0)
    else:  # one scale 1 / (joint norm) for both blocks
        scale = 1.0 / (big_norm**2 + small_norm**2) ** 0.5
        assert norm(big) == pytest.approx(big_norm * scale, rel=1e-4)
        assert norm(small) == pytest.approx(small_norm * scale, rel=1e-4) and scale < 0.01


def save_head(path, classes, features, seed=0):
    g = torch.Generator().manual_seed(seed)
    state = {"weight": torch.randn(classes, features, generator=g), "bias": torch.randn(classes, generator=g)}
    torch.save(state, path)
    return state


def test_probes_start_from_the_given_linear_head(tmp_path):
    from vitexp.methods.raptor import Raptor

    state = save_head(tmp_path / "head.pth", 10, 2 * 64)
    method = Raptor(phases=[[0, 1], [2, 3]], probe_head=str(tmp_path / "head.pth"))
    teacher = timm.create_model("vit_micro_patch14_dinov2", num_classes=10, reg_tokens=4, depth=4)
    model = method.apply(teacher, {"kind": "blocks", "k": 2})
    probes = {s.name: s.model() for s in method.stages(model) if s.name.endswith("probe")}
    assert sorted(probes) == ["probe", "teacher_probe"]
    for probe in probes.values():
        torch.testing.assert_close(probe.head.weight, state["weight"])
        torch.testing.assert_close(probe.head.bias, state["bias"])
    assert probes["probe"].head.weight is not probes["teacher_probe"].head.weight  # each probe trains its own


def test_a_missing_or_misshapen_linear_head_is_a_clear_error(tmp_path, make_cfg):
    from vitexp.methods.raptor import Raptor
    from vitexp.training.resolve import validate

    base = ["backbone=dinov2_micro_reg", "method=raptor", "budget=blocks", "recipe=raptor"]
    with pytest.raises(
        ConfigError, match=f"method.probe_head: checkpoint file not found: {tmp_path}/nope.pth"
    ):
        validate(make_cfg(base + [f"method.probe_head={tmp_path}/nope.pth"]))
    teacher = timm.create_model("vit_micro_patch14_dinov2", num_classes=10, reg_tokens=4, depth=4)
    save_head(tmp_path / "b.pth", 1000, 2 * 768)  # Meta's ViT-B head on a 64-wide, 10-class probe
    with pytest.raises(ValueError, match=r"weight \(1000, 1536\).*needs weight \(10, 128\)"):
        Raptor(probe_head=str(tmp_path / "b.pth")).apply(teacher, {"kind": "blocks", "k": 2})
    torch.save({"fc.weight": torch.zeros(10, 128)}, tmp_path / "keys.pth")
    with pytest.raises(ValueError, match=r"expected a state dict with 'weight' and 'bias'.*fc.weight"):
        Raptor(probe_head=str(tmp_path / "keys.pth")).apply(teacher, {"kind": "blocks", "k": 2})


def test_probe_records_the_best_validation_top1_including_the_evaluation_before_training(make_cfg, tmp_path):
    """RAPTOR reports the best ImageNet-val accuracy over the evaluation before training and every
    epoch's; the ledger keeps it as best_val_top1 beside the final model's test top1."""
    import lightning as L
    from conftest import QUIET

    from vitexp.commands.train import train

    class ValidationLog(L.Callback):
        def __init__(self):
            self.events = []

        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                self.events.append(
                    (trainer.state.fn.value, trainer.global_step, float(trainer.callback_metrics["val/top1"]))
                )

    save_head(tmp_path / "head.pth", 10, 2 * 64)
    log = ValidationLog()
    cfg = make_cfg(
        QUIET
        + [
            "backbone=dinov2_micro",
            "method=raptor",
            "budget=blocks",
            "recipe=raptor",
            "data=synthetic",
            "data.num_train=32",
            "data.num_val=16",
            "data.num_test=16",
            "method.stage1_epochs=0",
            "method.stage2_epochs=0",
            "method.teacher_probe=false",
            "method.probe.epochs=2",
            "method.probe.batch_size=8",
            "method.probe.lr=0.05",
            "method.phases=[[0,1],[2,3]]",
            "budget.k=2",
            "eval.throughput=false",
            f"method.probe_head={tmp_path}/head.pth",
        ],
        tmp_path / "run",
    )
    m = train(cfg, callbacks=[log])["metrics"]
    assert [(fn, step) for fn, step, _ in log.events] == [("validate", 0), ("fit", 4), ("fit", 8)]
    assert m["best_val_top1"] == pytest.approx(100 * max(v for _, _, v in log.events))
    assert m["val_top1"] == pytest.approx(100 * log.events[-1][2]) and "top1" in m


def test_raptor_distils_on_the_evaluation_transforms_and_probes_on_the_augmentations(make_cfg, tmp_path):
    """Stages 1-2 see the training images as the evaluation transforms give them (RAPTOR's
    precomputed activations), the probes the augmented ones; method.distill_augment=true distils on
    the augmentations too. digits with data.augment=true: an affine-jittered image never equals its
    evaluation tensor."""
    from conftest import QUIET
    from lightning.pytorch.callbacks import Callback

    from vitexp.commands.train import train

    class Batches(Callback):
        def __init__(self):
            self.seen: dict[str, list[torch.Tensor]] = {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            kind = type(pl_module).__name__
            self.seen.setdefault(kind, []).append(batch[0].detach().clone())
            self.bank = trainer.datamodule.train_eval_dataloader()

    def fraction_of_evaluation_tensors(batches, bank) -> float:
        evaluated = torch.cat([x for x, _ in bank]).flatten(1)
        rows = torch.cat(batches).flatten(1)
        return float(
            (
                torch.cdist(rows, evaluated, compute_mode="donot_use_mm_for_euclid_dist").min(dim=1).values
                < 1e-6
            )
            .float()
            .mean()
        )

    base = QUIET + [
        "backbone=dinov2_micro",
        "method=raptor",
        "budget=blocks",
        "recipe=raptor",
        "data=digits",
        "data.augment=true",
        "recipe.batch_size=64",
        "recipe.epochs=1",
        "recipe.warmup_steps=1",
        "method.probe.epochs=1",
        "method.probe.batch_size=64",
        "method.phase_images=32",
        "method.teacher_probe=false",
        "eval.throughput=false",
        "trainer.limit_train_batches=2",
    ]
    for augment, expected in (("false", 1.0), ("true", 0.0)):
        seen = Batches()
        train(make_cfg(base + [f"method.distill_augment={augment}"], tmp_path / augment), callbacks=[seen])
        assert fraction_of_evaluation_tensors(seen.seen["RaptorStageModule"], seen.bank) == expected
        assert fraction_of_evaluation_tensors(seen.seen["ClassifyModule"], seen.bank) == 0.0


# -- the reference code's files (method.surrogate) -------------------------------------------------
#: The micro teacher of the reference fixture (tests/fixtures/reference/raptor.json): width 16, 2 heads, depth
#: 4.
REFERENCE_ARCH = {"depth": 4, "num_heads": 2, "embed_dim": 16, "patch_size": 14, "num_prefix_tokens": 5}


def _reference_files():
    from pathlib import Path

    return Path(__file__).parent / "fixtures" / "reference"


def _reference_block_state(mlp_ratio: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A reference ``block.Block`` state dict (the reference's key names) of width 16 at ``mlp_ratio``."""
    from vitexp.methods.raptor.reference import KEY_MAP
    from vitexp.methods.raptor.surrogate import RaptorBlock

    torch.manual_seed(seed)
    ours = RaptorBlock(16, 2, mlp_ratio=mlp_ratio).state_dict()
    back = {v: k for k, v in KEY_MAP.items()}
    return {back.get(k, k): v for k, v in ours.items()}


def test_a_reference_file_with_another_mlp_width_is_refused_naming_the_file(tmp_path):
    """A reference block built with another mlp_ratio (build_config's, 4 by default) is refused when
    the config is validated, in one line naming the file and both widths; it no longer passes and
    fails in apply with a raw size mismatch after the run's ledger entry."""
    from vitexp.methods.raptor import Raptor

    path = tmp_path / "block_mlp2.pt"
    torch.save(_reference_block_state(mlp_ratio=2.0), path)
    method = Raptor(surrogate=str(path), phases=[[0, 1, 2, 3]])
    with pytest.raises(ConfigError, match="MLP hidden width is 32") as err:
        method.validate_budget({"kind": "blocks", "k": 1}, REFERENCE_ARCH)
    message = str(err.value)
    assert str(path) in message and "64" in message and "\n" not in message
    torch.save(_reference_block_state(mlp_ratio=4.0), path)  # the reference's default: accepted
    Raptor(surrogate=str(path), phases=[[0, 1, 2, 3]]).validate_budget(
        {"kind": "blocks", "k": 1}, REFERENCE_ARCH
    )


def test_a_file_holding_another_class_is_not_a_reference_file_in_one_line(tmp_path):
    """A pickled module of another class: one line naming the file, the class met and what a
    reference file is; torch's advice to load with weights_only=False is not passed on."""
    from vitexp.methods.raptor import Raptor
    from vitexp.methods.raptor.reference import read_surrogate

    path = tmp_path / "conv.pt"
    torch.save(torch.nn.Conv2d(1, 1, 1), path)
    with pytest.raises(ValueError) as err:
        read_surrogate(path)
    message = str(err.value)
    assert str(path) in message and "torch.nn.modules.conv.Conv2d" in message
    assert "KempnerInstitute/raptor" in message and "raptor.Raptor" in message and "block.Block" in message
    assert "weights_only" not in message and "\n" not in message
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file" * 16)
    with pytest.raises(ConfigError) as err:
        Raptor(surrogate=str(junk)).validate_budget({"kind": "blocks", "k": 2}, REFERENCE_ARCH)
    assert str(junk) in str(err.value) and "weights_only" not in str(err.value) and "\n" not in str(err.value)


def test_reference_files_without_thresholds_require_method_phases(tmp_path):
    """Stage-1 Block files, or a Raptor saved as a state dict, do not say which layers each block
    was trained for: without method.phases the config is refused naming the key (no phases from
    data or an even split chosen silently); with it the run uses them and records method.phases."""
    from vitexp.methods.raptor import Raptor
    from vitexp.methods.raptor.reference import _torch_load

    block = str(_reference_files() / "raptor_block.pt")
    whole = tmp_path / "raptor_state_dict.pt"
    torch.save(_torch_load(_reference_files() / "raptor_surrogate.pt").state_dict(), whole)
    budget = {"kind": "blocks", "k": 2}
    for surrogate in ([block, block], str(whole)):
        with pytest.raises(ConfigError, match=r"method\.phases: required .*hold no thresholds"):
            Raptor(surrogate=surrogate).validate_budget(budget, REFERENCE_ARCH)
    method = Raptor(surrogate=[block, block], phases=[[0, 1], [2, 3]], stage1_epochs=0, stage2_epochs=0)
    method.validate_budget(budget, REFERENCE_ARCH)
    teacher = timm.create_model(
        "vit_micro_patch14_dinov2", embed_dim=16, num_heads=2, depth=4, reg_tokens=4, num_classes=10
    )
    model = method.apply(teacher, budget)
    assert model.surrogate.phases == [[0, 1], [2, 3]] and method.record()["phases_source"] == "method.phases"


def test_each_probe_logs_its_own_keys_so_the_loggers_test_top1_is_the_ledgers(
    make_cfg, results_dir, tmp_path
):
    """The two probe stages log under their metrics prefix: the surrogate's ``test/top1`` (the
    ledger's ``top1``, W&B's summary) is not overwritten by the teacher's, logged as
    ``teacher_test/top1`` (``teacher_top1``)."""
    import csv

    from conftest import QUIET

    from vitexp.commands.train import train

    out = train(
        make_cfg(
            [
                *QUIET,
                "logger=csv",
                "backbone=dinov2_micro_reg",
                "method=raptor",
                "budget=blocks",
                "recipe=raptor",
                "data=synthetic",
                "recipe.epochs=1",
                "method.probe.epochs=1",
                "method.phase_images=16",
                "eval.throughput=false",
                "eval.flops=false",
            ],
            tmp_path / "run",
        )
    )
    rows = list(csv.DictReader((tmp_path / "run" / "csv" / "metrics.csv").open()))
    last = lambda key: [float(r[key]) for r in rows if r.get(key)][-1]  # noqa: E731
    assert last("test/top1") == pytest.approx(out["metrics"]["top1"])
    assert last("teacher_test/top1") == pytest.approx(out["metrics"]["teacher_top1"])
    assert last("teacher_val/top1") == pytest.approx(out["metrics"]["teacher_val_top1"])
