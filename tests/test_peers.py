"""The token-reduction peers run in vitexp: ToMe (vitexp/methods/tome/) and EViT (vitexp/methods/evit/)."""

from __future__ import annotations

import copy
import math

import pytest
import timm
import torch
import torch.nn.functional as F
from conftest import recorded, vit_analytic_macs

import vitexp  # noqa: F401  (registers the micro backbones)
import vitexp.config.composition as vconfig
from vitexp.measure.flops import count_macs
from vitexp.methods.evit import EViT
from vitexp.methods.evit.fuse import keep_count, keep_rate_at, prune_and_fuse
from vitexp.methods.tome import ToMe
from vitexp.methods.tome.merge import match, merge_fn, merge_wavg, parse_r
from vitexp.methods.tome.patch import ToMeAttention
from vitexp.training import resolve

#: the micro backbones (timm name, kwargs, image size): DeiT layout, DINOv2 with registers, T2T-ViT, LV-ViT
MICRO = {
    "vit_micro": ("vit_micro_patch4_32", {}, 32),
    "dinov2_micro_reg": ("vit_micro_patch14_dinov2", {"reg_tokens": 4, "depth": 6}, 56),
    "t2t_vit_micro": ("t2t_vit_micro", {}, 64),
    "lvvit_micro": ("lvvit_micro", {}, 64),
}


def micro(name: str = "vit_micro", seed: int = 0):
    timm_name, kwargs, size = MICRO[name]
    torch.manual_seed(seed)
    model = timm.create_model(timm_name, num_classes=10, **kwargs).eval()
    if name == "dinov2_micro_reg":  # LayerScale 1e-5 would hide the blocks: make them count
        for block in model.blocks:
            block.ls1.gamma.data.fill_(0.5)
            block.ls2.gamma.data.fill_(0.5)
    return model, torch.randn(3, 3, size, size)


def tome(model, r):
    return ToMe().apply(model, {"kind": "merge", "r": r})


def evit(model, keep, **kwargs):
    return EViT(**kwargs).apply(model, {"kind": "keep_ratio", "keep_ratio": keep})


def tokens_after_each_block(model, x) -> list[int]:
    counts = []
    hooks = [b.register_forward_hook(lambda m, i, o: counts.append(o.shape[1])) for b in model.blocks]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return counts


# -- no reduction: the unmodified model -------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MICRO))
def test_tome_r0_and_evit_keep1_equal_the_backbone(name):
    base, x = micro(name)
    with torch.no_grad():
        expected = base(x)
        for reduced in (tome(copy.deepcopy(base), 0), evit(copy.deepcopy(base), 1.0, prune_layers=[0, 1, 2])):
            assert type(reduced.blocks[1]).__name__ in ("ToMeBlock", "EViTBlock")
            torch.testing.assert_close(reduced(x), expected, rtol=1e-5, atol=1e-5)


# -- token counts -------------------------------------------------------------------------------------------
def test_tome_merges_r_tokens_in_every_layer_and_never_a_prefix_token():
    model, x = micro("dinov2_micro_reg")  # 16 patches + CLS + 4 registers = 21 tokens, depth 6
    tome(model, 2)
    assert tokens_after_each_block(model, x) == [21 - 2 * (i + 1) for i in range(6)]
    state = model.blocks[0].tome
    # the 5 prefix tokens keep size 1; the patch tokens' sizes add up to the 16 patches
    assert torch.equal(state.size[:, :5, 0], torch.ones(3, 5))
    assert torch.equal(state.size[:, 5:, 0].sum(1), torch.full((3,), 16.0))


def test_tome_per_layer_r_and_the_half_limit():
    assert parse_r([4, 0, 3], 5) == [4, 0, 3, 0, 0] and parse_r(2, 3) == [2, 2, 2]
    with pytest.raises(ValueError, match="for a backbone of 2 layers"):
        parse_r([1, 1, 1], 2)
    model, x = micro("vit_micro")  # 65 tokens, depth 6
    tome(model, [40, 5])  # at most half of the 64 patch tokens merge in a layer
    assert tokens_after_each_block(model, x) == [33, 28, 28, 28, 28, 28]


def test_evit_keeps_ceil_rho_candidates_plus_cls_plus_fused_after_blocks_4_7_10():
    torch.manual_seed(0)  # DeiT-S token layout (196 patches + CLS, 12 blocks) at width 32
    model = timm.create_model("vit_small_patch16_224", embed_dim=32, num_heads=2, num_classes=10).eval()
    rho = 0.7
    evit(model, rho)
    counts = tokens_after_each_block(model, torch.randn(2, 3, 224, 224))
    expected, n = [], 197
    for i in range(12):
        if i in (3, 6, 9):  # 1-based blocks 4, 7, 10
            n = math.ceil(rho * (n - 1)) + 1 + 1  # kept + CLS + fused
        expected.append(n)
    assert counts == expected == [197] * 3 + [140] * 3 + [100] * 3 + [72] * 3


def test_evit_keeps_the_most_cls_attended_tokens_and_fuses_the_rest_weighted_by_attention():
    x = torch.arange(2 * 6 * 2, dtype=torch.float).view(2, 6, 2)  # CLS + 5 candidates
    attn = torch.tensor([[0.1, 0.4, 0.05, 0.3, 0.15], [0.3, 0.1, 0.2, 0.05, 0.35]])
    out = prune_and_fuse(x, attn, keep=2, num_prefix=1)
    assert torch.equal(out[:, 0], x[:, 0])
    torch.testing.assert_close(out[0, 1:3], x[0, [2, 4]])  # attention 0.4, 0.3
    torch.testing.assert_close(out[1, 1:3], x[1, [5, 1]])  # attention 0.35, 0.3
    torch.testing.assert_close(out[0, 3], 0.1 * x[0, 1] + 0.05 * x[0, 3] + 0.15 * x[0, 5])
    assert prune_and_fuse(x, attn, keep=2, num_prefix=1, fuse=False).shape[1] == 3
    assert keep_count(0.7, 100) == 70 and keep_count(0.7, 196) == 138 and keep_count(0.01, 5) == 1


# -- ToMe's matching and proportional attention -------------------------------------------------------------
def test_bipartite_matching_merges_the_most_similar_pairs_size_weighted():
    # CLS, then patches p0..p5: B = p0, p2, p4; A = p1, p3, p5. p3 duplicates p0 and p5 nearly p4.
    metric = torch.tensor([[[1.0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0], [0, 1, 1], [0, 1, 1.1]]])
    matching = match(metric, 2, num_prefix=1)
    merge, r = merge_fn(matching, num_prefix=1), int(matching.src.shape[1])
    assert r == 2
    x = torch.arange(7, dtype=torch.float).view(1, 7, 1)
    size = torch.tensor([1.0, 1, 1, 1, 3, 1, 1]).view(1, 7, 1)  # p3 stands for 3 patches
    out, new_size = merge_wavg(merge, x, size)
    # prefix, unmerged A (p1), then B: p0 absorbs p3 (size 3), p2 alone, p4 absorbs p5
    torch.testing.assert_close(out[0, :, 0], torch.tensor([0.0, 2, (1 + 3 * 4) / 4, 3, (5 + 6) / 2]))
    torch.testing.assert_close(new_size[0, :, 0], torch.tensor([1.0, 1, 4, 1, 2]))


def test_proportional_attention_a_token_of_size_two_attends_as_two_identical_tokens():
    model, _ = micro("vit_micro")
    attn = model.blocks[0].attn
    attn.__class__ = ToMeAttention
    torch.manual_seed(1)
    x = torch.randn(2, 4, 64)
    duplicated = torch.cat([x, x[:, 3:]], dim=1)  # token 3 twice
    size = torch.tensor([1.0, 1, 1, 2]).view(1, 4, 1).expand(2, 4, 1)
    out_dup, _ = attn(duplicated)
    out_merged, _ = attn(x, size)
    torch.testing.assert_close(out_merged, out_dup[:, :4], rtol=1e-5, atol=1e-6)
    out_plain, _ = attn(x)  # without the size the merged token is under-weighted
    assert (out_plain - out_dup[:, :4]).abs().max() > 1e-3


# -- batch independence, bf16 -------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["tome", "evit"])
def test_each_image_is_reduced_on_its_own(method):
    model, x = micro("vit_micro")
    tome(model, 5) if method == "tome" else evit(model, 0.5, prune_layers=[1, 3])
    with torch.no_grad():
        batch = model(x)
        single = torch.cat([model(x[i : i + 1]) for i in range(len(x))])
    torch.testing.assert_close(batch, single, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(MICRO) + ["dinov2_micro"])
@pytest.mark.parametrize("method", ["tome", "evit"])
def test_bf16_autocast_forward_and_backward(method, name):
    if name == "dinov2_micro":
        torch.manual_seed(0)
        model, x = timm.create_model("vit_micro_patch14_dinov2", num_classes=10), torch.randn(3, 3, 56, 56)
    else:
        model, x = micro(name)
    model.train()
    tome(model, 2) if method == "tome" else evit(model, 0.5, prune_layers=[1, 2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
        loss = F.cross_entropy(logits, torch.tensor([0, 1, 2]))
    loss.backward()
    assert logits.dtype == torch.bfloat16 and torch.isfinite(loss)
    qkv = model.blocks[0].attn.qkv.weight.grad
    assert qkv is not None and torch.isfinite(qkv).all() and qkv.abs().sum() > 0
    assert tokens_after_each_block(model.eval(), x)[-1] < model.patch_embed.num_patches


# -- EViT's keep-rate warm-up -------------------------------------------------------------------------------
def test_evit_keep_rate_warmup_follows_evits_schedule_while_training_only():
    assert keep_rate_at(5, 0.5, start=10, ramp=100) == 1.0
    assert keep_rate_at(10, 0.5, start=10, ramp=100) == 1.0
    assert keep_rate_at(60, 0.5, start=10, ramp=100) == pytest.approx(0.75)
    assert keep_rate_at(35, 0.5, start=10, ramp=100) == pytest.approx(
        0.5 + 0.5 * (1 + math.cos(math.pi / 4)) / 2
    )
    assert keep_rate_at(110, 0.5, start=10, ramp=100) == 0.5 and keep_rate_at(3, 0.5, 0, 0) == 0.5
    model, x = micro("vit_micro")  # 64 candidates at block 1
    evit(model, 0.5, prune_layers=[1], keep_warmup_start_epochs=1, keep_warmup_epochs=2, epochs=4)
    train_tokens = lambda: tokens_after_each_block(model.train(), x)[1]  # noqa: E731
    model.set_progress(0.2)  # epoch 0.8: before the warm-up starts
    assert train_tokens() == 65
    model.set_progress(0.5)  # epoch 2: half-way down the cosine, rho_t = 0.75
    assert train_tokens() == 1 + 48 + 1
    model.set_progress(1.0)
    assert train_tokens() == 1 + 32 + 1
    model.set_progress(0.0)  # evaluation always uses the target
    assert tokens_after_each_block(model.eval(), x)[1] == 1 + 32 + 1


# -- FLOPs --------------------------------------------------------------------------------------------------
def _block_macs(n_attn: int, n_mlp: int, d: int = 64, hidden: int = 256) -> int:
    return 4 * n_attn * d * d + 2 * n_attn * n_attn * d + 2 * n_mlp * d * hidden


def test_tome_count_includes_the_matching_matmul():
    model, _ = micro("vit_micro")
    tome(model, 4)
    outer = vit_analytic_macs(img_size=32, patch_size=4, embed_dim=64, depth=0, mlp_ratio=4, num_classes=10)
    expected, n = outer, 65
    for _ in range(6):
        a = (n - 1) // 2
        expected += _block_macs(n, n - 4) + a * (n - 1 - a) * 16  # matching: |A| x |B| x head dim 16
        n -= 4
    assert count_macs(model, 32).gmacs * 1e9 == pytest.approx(expected)


def test_evit_count_is_the_reduced_blocks_plus_the_fusion_matmul():
    model, _ = micro("vit_micro")
    evit(model, 0.5, prune_layers=[1, 3])
    outer = vit_analytic_macs(img_size=32, patch_size=4, embed_dim=64, depth=0, mlp_ratio=4, num_classes=10)
    # block 1: 65 in, 1 + 32 + 1 out (32 fused); block 3: 34 in, 1 + 17 + 1 out (16 fused)
    expected = (
        outer
        + _block_macs(65, 65)
        + _block_macs(65, 34)
        + 32 * 64
        + _block_macs(34, 34)
        + _block_macs(34, 19)
        + 16 * 64
        + 2 * _block_macs(19, 19)
    )
    assert count_macs(model, 32).gmacs * 1e9 == pytest.approx(expected)


@pytest.mark.slow
@pytest.mark.parametrize("keep,published", [(0.7, 3.0), (0.6, 2.6), (0.5, 2.3)])
def test_evit_deit_small_lands_on_evits_gmacs(keep, published):
    model = timm.create_model("deit_small_patch16_224")
    assert count_macs(evit(model, keep), 224).gmacs == pytest.approx(published, abs=0.1)


# -- configs ------------------------------------------------------------------------------------------------
def test_budget_errors_name_the_key():
    with pytest.raises(vconfig.ConfigError, match="budget.r"):
        resolve.validate(vconfig.compose(["method=tome", "budget=merge", "budget.r=[1,1,1,1,1,1,1]"]))
    with pytest.raises(vconfig.ConfigError, match="accepts budget kinds \\['merge'\\]"):
        resolve.validate(vconfig.compose(["method=tome", "budget=keep_ratio"]))
    with pytest.raises(vconfig.ConfigError, match="method.prune_layers"):
        resolve.validate(vconfig.compose(["method=evit", "budget=keep_ratio", "method.prune_layers=[6]"]))
    with pytest.raises(vconfig.ConfigError, match="does not apply"):
        resolve.validate(vconfig.compose(["backbone=caformer_micro", "method=evit", "budget=keep_ratio"]))


# -- several methods timed in one interleaved run -----------------------------------------------------------
def test_bench_compare_takes_a_table_rows_name_composed_as_its_row():
    """bench.compare names experiments or table rows: EViT's keep rates and ToMe's r are rows of the
    DeiT-S specs (a base experiment + overrides), composed as the sweep composes them and recorded
    under the row's name; a name that is neither is refused with both places named."""
    from vitexp.commands.bench import _compose_experiment

    evit = _compose_experiment("evit_deit_small_keep05")
    assert (evit.name, evit.budget.keep_ratio, evit.method.name) == ("evit_deit_small_keep05", 0.5, "evit")
    assert evit.backbone.pretrained is None  # a timing loads no weights
    assert _compose_experiment("tome_deit_small_r8").budget.r == 8
    with pytest.raises(vconfig.ConfigError, match="neither an experiment .* nor the name of a table row"):
        _compose_experiment("evit_deit_small_keep04")


def test_bench_compare_times_several_experiments_together_one_entry_each(make_cfg, results_dir):
    from conftest import QUIET, ledger_entries

    from vitexp.commands.bench import run_bench

    names = ["demo", "tome_demo", "evit_demo"]
    cfg = make_cfg(
        QUIET
        + [
            f"bench.compare=[{','.join(names)}]",
            "bench.rounds=1",
            "bench.iters=1",
            "bench.warmup=0",
            "bench.batch_size=2",
            "bench.device=cpu",
        ]
    )
    run_bench(cfg)
    entries = {e["experiment"]: e for e in ledger_entries(results_dir)}
    assert sorted(entries) == sorted(names) and all(e["kind"] == "bench" for e in entries.values())
    ref = entries["demo"]["metrics"]
    assert ref["throughput_ratio"] == 1.0 and ref["gmacs_ratio"] == 1.0
    for name in ("tome_demo", "evit_demo"):
        m, p = entries[name]["metrics"], entries[name]["protocol"]
        assert p["interleaved_with"] == names and p["reference"] == "demo" and p["batch_size"] == 2
        assert m["baseline_throughput"] == ref["throughput"]
        assert m["throughput_ratio"] == pytest.approx(m["throughput"] / ref["throughput"])
        assert m["gmacs"] < ref["gmacs"] and m["gmacs_ratio"] == pytest.approx(ref["gmacs"] / m["gmacs"])
    with pytest.raises(vconfig.ConfigError, match="at least two different experiments"):
        run_bench(make_cfg(QUIET + ["bench.compare=[demo,demo]"]))


def test_a_comparison_that_fails_marks_its_entries_failed_and_says_so(
    make_cfg, results_dir, monkeypatch, capsys
):
    """A runtime error while timing is a failed run (its entries failed, a closing line naming them),
    not an invalid config."""
    import json

    from conftest import QUIET, ledger_entries

    import vitexp.measure.throughput
    from vitexp.commands.bench import run_bench

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(vitexp.measure.throughput, "compare_throughput", broken)
    with pytest.raises(RuntimeError) as raised:
        run_bench(make_cfg(QUIET + ["bench.compare=[demo,tome_demo]", "bench.device=cpu"]))
    assert getattr(raised.value, "vitexp_reported", False)  # the CLI prints no second, "invalid", line
    closing = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert closing["status"] == "failed" and len(closing["run_id"]) == 2
    assert sorted(e["status"] for e in ledger_entries(results_dir)) == ["failed", "failed"]


def test_rows_of_a_series_become_one_curve_each_in_the_plot():
    from vitexp.report.tables import fill, load_spec, series_curves

    spec = load_spec("peers_deit_small")
    runs = [
        {
            "run_id": f"r{i}",
            "experiment": e,
            "status": "completed",
            "kind": "flops",
            "metrics": {"gmacs": g, "top1": t},
        }
        for i, (e, g, t) in enumerate(
            [
                ("evit_deit_small_keep07", 3.0, 79.0),
                ("evit_deit_small_keep05", 2.3, 78.0),
                ("tome_deit_small_r13", 2.7, 79.1),
            ]
        )
    ]
    curves = series_curves(fill(spec, recorded(spec, runs)), "gmacs", "top1")
    assert curves["EViT"]["vitexp"] == [(2.3, 78.0), (3.0, 79.0)]  # sorted by GMACs
    assert curves["EViT"]["paper"] == [(2.3, 78.5), (2.6, 78.9), (3.0, 79.5)]
    assert "vitexp" not in curves["ToMe"] and "BSPF-ViT" in curves  # one ToMe point is no curve
