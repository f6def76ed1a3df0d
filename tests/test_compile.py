"""``torch.compile`` (the config's ``compile`` block, :mod:`vitexp.models.compiled`): every method's model
compiles whole (``fullgraph=True``) or with the graph breaks docs/measurements.md lists, one graph per
grad mode whatever the batch size, and its outputs equal eager's.

The default suite captures graphs on the micro backbones with dynamo's ``eager`` backend (graph breaks
and recompiles are dynamo's: no code is generated, seconds per method); ``-m slow`` compiles with
inductor at DeiT-S size (fp32 and bf16, a forward and a training step against eager) and Mask R-CNN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omegaconf import open_dict

import vitexp.config.composition as vconfig
from vitexp.models.compiled import CompileOptions, compile_call
from vitexp.training.build import build_model

#: method -> (overrides on a micro backbone, overrides at full size); SAPER and RAPTOR are compiled as
#: deployed (the head-pruned model; the surrogate under its probe).
METHODS = {
    "baseline": (["experiment=demo"], ["experiment=deit_small_baseline"]),
    "bspf": (["experiment=bspf_demo"], ["experiment=bspf_deit_small"]),
    "bspf_shared_qk": (
        ["experiment=bspf_demo", "method.symmetric=true", "method.mirror=upper"],
        ["experiment=bspf_deit_small_symmetric"],
    ),
    "chunk": (["experiment=chunk_demo"], ["experiment=chunk_deit_small"]),
    "tome": (["experiment=tome_demo"], ["experiment=tome_deit_small"]),
    "evit": (["experiment=evit_demo"], ["experiment=evit_deit_small"]),
    "saper_pruned": (
        ["experiment=saper_micro", "backbone.pretrained=null"],
        ["experiment=saper_dinov2", "backbone.pretrained=null", "data=synthetic"],
    ),
    "raptor_surrogate": (
        ["experiment=raptor_micro", "backbone.pretrained=null"],
        ["experiment=raptor_dinov2", "backbone.pretrained=null", "data=synthetic"],
    ),
}


def _model(overrides: list[str]) -> tuple[torch.nn.Module, int, int]:
    """(the deployed model, its resolution, its classes) of ``overrides``, seeded."""
    cfg = vconfig.compose([*overrides, "logger=none"])
    if cfg.method.name == "raptor":
        depth = int(cfg.backbone.arch.depth)
        with open_dict(cfg):
            cfg.method.phases = [list(range(depth // 2)), list(range(depth // 2, depth))]
    torch.manual_seed(0)
    model, method, _ = build_model(cfg)
    if cfg.method.name.startswith("saper"):
        model.selector.scores.data.normal_()  # a selection that prunes heads unevenly across layers
    return method.deploy(model), int(cfg.backbone.img_size), int(cfg.data.num_classes)


def _counted(model: torch.nn.Module):
    """``model`` compiled whole (``fullgraph=True``) through vitexp's call (batch dimension dynamic),
    with a backend that counts the graphs dynamo hands it (no code generated)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("eager")
    torch._dynamo.reset()
    return compile_call(model, CompileOptions(True, fullgraph=True), backend=counter), counter


#: The methods captured in the default suite (about 25 s on one core); the others under -m slow.
DEFAULT_SUITE = ("baseline", "bspf", "saper_pruned", "raptor_surrogate")


@pytest.mark.parametrize(
    "method", [pytest.param(m, marks=() if m in DEFAULT_SUITE else pytest.mark.slow) for m in sorted(METHODS)]
)
def test_every_method_compiles_whole_with_one_graph_per_grad_mode(method):
    """A training batch, a last training batch of another size, then validation and test batches
    (of two sizes, under inference mode as Lightning runs them): two graphs, no recompile. A graph
    break fails here (``fullgraph=True``), as a ``.item()`` or a branch on a tensor in a forward would."""
    model, img, _ = _model(METHODS[method][0])
    call, counter = _counted(model)
    model.train()
    for batch in (6, 5):
        call(torch.randn(batch, 3, img, img)).float().pow(2).mean().backward()
    model.eval()
    with torch.inference_mode():
        for batch in (6, 3):
            call(torch.randn(batch, 3, img, img))
    assert counter.frame_count == 2, f"{method}: {counter.frame_count} graphs, not one per grad mode"


def test_objective_modules_compile_their_entries():
    """The LightningModules run the compiled call under ``compile.enabled`` (forward; SAPER-KD's
    distillation targets; RAPTOR's stage loss), and the plain model otherwise; a deployed model
    that replaces ``module.model`` gets a compiled call of its own."""
    from vitexp.training.modules import ClassifyModule

    model, img, classes = _model(METHODS["baseline"][0])
    module = ClassifyModule(model, classes, {"lr": 1e-3})
    assert module.compiled() is model
    module.set_compile(CompileOptions(True, backend="eager"))
    first = module.compiled()
    assert first is not model and module.compiled() is first and hasattr(first, "compiled")
    x = torch.randn(3, 3, img, img)
    torch._dynamo.reset()
    assert torch.equal(module(x), model(x))
    module.model = torch.nn.Sequential(model)  # a deployed model in its place
    assert module.compiled() is not first
    module.set_compile(CompileOptions(False))
    assert module.compiled() is module.model


def test_compile_is_checked_recorded_and_outside_the_fingerprint(make_cfg):
    from vitexp.errors import ConfigError
    from vitexp.ledger.fingerprint import fingerprint
    from vitexp.training.fit import compile_protocol
    from vitexp.training.resolve import validate

    cfg = make_cfg(["logger=none"])
    assert cfg.compile.enabled is False and compile_protocol(cfg) == {}
    on = make_cfg(["logger=none", "compile.enabled=true", "compile.mode=max-autotune"])
    validate(on, need_data=False)
    assert compile_protocol(on)["compile"]["mode"] == "max-autotune"
    to_dict = vconfig.to_container
    assert fingerprint(to_dict(cfg)) == fingerprint(to_dict(on))
    for key, value in (("mode", "fastest"), ("backend", "tvm")):
        bad = make_cfg(["logger=none", f"compile.{key}={value}"])
        with pytest.raises(ConfigError, match=f"compile.{key}"):
            validate(bad, need_data=False)


# -- inductor, at full size (-m slow) -----------------------------------------------------------------

#: (atol relative to the output's largest magnitude) of compiled against eager.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def _scaled_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_inductor_equals_eager_at_full_size(method, dtype):
    """DeiT-S size (DINOv2-S for SAPER and RAPTOR), batch 4: a forward in evaluation and one
    training step (cross-entropy, backward, SGD) give eager's logits, gradients and updated
    weights within :data:`TOLERANCE` (bf16: under autocast, as the GPU runs)."""
    import copy

    model, img, classes = _model(METHODS[method][1])
    twin = copy.deepcopy(model)
    torch._dynamo.reset()
    call = compile_call(twin, CompileOptions(True, fullgraph=True))
    torch.manual_seed(1)
    x, y = torch.randn(4, 3, img, img), torch.randint(0, classes, (4,))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    model.eval(), twin.eval()
    with torch.no_grad(), autocast:
        eager, compiled = model(x), call(x)
    assert _scaled_error(compiled, eager) < TOLERANCE[dtype], f"{method} forward"
    model.train(), twin.train()
    for m, f in ((model, model), (twin, call)):
        with autocast:
            loss = F.cross_entropy(f(x).float(), y)
        loss.backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        if p.grad is None:
            continue
        assert _scaled_error(q.grad, p.grad) < 10 * TOLERANCE[dtype], f"{method}: gradient of {name}"
        assert _scaled_error(q, p) < TOLERANCE[dtype], f"{method}: {name} after the step"


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["micro_coco_shvit", "micro_coco_bspf_shvit"])
def test_mask_rcnn_compiles_its_backbone_whole_and_lists_the_rest(experiment):
    """Mask R-CNN on SHViT ± BSPF-ViT: the backbone and FPN (what ``compile`` compiles,
    :meth:`vitexp.training.detection_module.DetectModule.compiled`) are one graph; the whole detector
    breaks only in torchvision's box code (data-dependent shapes), the breaks docs/measurements.md lists."""
    from vitexp.training.objectives import objective_for

    cfg = vconfig.compose([f"experiment={experiment}", "logger=none"])
    torch.manual_seed(0)
    model, method, data_config = build_model(cfg)
    detector = objective_for(cfg).stages(cfg, method, model, data_config)[0].model().eval()
    call, counter = _counted(type(detector.backbone).forward.__get__(detector.backbone))
    with torch.no_grad():
        for batch in (2, 1 + 2):
            x = torch.randn(batch, 3, 128, 128)
            out = call(x)
            eager = detector.backbone(x)
            assert all(torch.allclose(out[k], eager[k], atol=1e-5) for k in eager)
    assert counter.frame_count == 1
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(detector)([torch.rand(3, 128, 128)])
    files = {br.user_stack[-1].filename for br in explained.break_reasons if br.user_stack}
    assert explained.graph_break_count > 0 and all("torchvision" in f for f in files), files


@pytest.mark.slow  # about 20 s on one core: five traces of the micro teacher and surrogate
def test_raptor_stage_loss_compiles_one_graph_per_phase_of_its_schedule():
    """RAPTOR's stage 1 loss is three computations along τ's schedule (τ = 1 at the first step:
    teacher-forced only; 0 < τ < 1: both terms; τ = 0: autoregressive only), each one graph when
    reached, whatever the batch size; stage 2 is one more."""
    cfg = vconfig.compose(["experiment=raptor_micro", "backbone.pretrained=null", "logger=none"])
    depth = int(cfg.backbone.arch.depth)
    with open_dict(cfg):
        cfg.method.phases = [list(range(depth // 2)), list(range(depth // 2, depth))]
    torch.manual_seed(0)
    model, _, _ = build_model(cfg)
    call, counter = _counted(model.stage_loss)
    img = int(cfg.backbone.img_size)
    model.train()
    for stage, progress, batch in [(1, 0.0, 4), (1, 0.1, 4), (1, 0.2, 3), (1, 0.5, 4), (1, 0.9, 3)]:
        call(torch.randn(batch, 3, img, img), stage, progress).backward()
    assert counter.frame_count == 3
    for progress, batch in ((0.1, 4), (0.7, 3)):
        call(torch.randn(batch, 3, img, img), 2, progress).backward()
    assert counter.frame_count == 4


def test_saper_selection_breaks_only_where_the_docs_say():
    """SAPER's soft selection stage (LapSum gates, the model ``select`` trains before deployment)
    compiles with graph breaks: the schedule reads the progress buffer as a Python number
    (``float(self.progress)``, selector.py). The list is docs/measurements.md's; a new break fails."""
    cfg = vconfig.compose(["experiment=saper_micro", "backbone.pretrained=null", "logger=none"])
    torch.manual_seed(0)
    model, _, _ = build_model(cfg)
    model.train()
    model.set_progress(0.3)
    torch._dynamo.reset()
    img = int(cfg.backbone.img_size)
    explained = torch._dynamo.explain(model)(torch.randn(2, 3, img, img))
    where = {
        (br.user_stack[-1].filename.rsplit("vitexp/", 1)[-1], br.user_stack[-1].lineno)
        for br in explained.break_reasons
    }
    assert {f for f, _ in where} == {"methods/saper/selector.py"}, where


def test_bench_times_each_model_eager_and_compiled_interleaved():
    """``compile.enabled``: every model of a timing is timed eager and compiled in the same rounds;
    its entry has the compiled images/s, their ratio to eager and the first compiled call's seconds,
    and the bench's metrics the speedup over the reference under compile."""
    from vitexp.commands.bench import compiled_metrics
    from vitexp.measure.throughput import compare_throughput

    models = {
        name: torch.nn.Sequential(torch.nn.Conv2d(3, width, 4, 4), torch.nn.Flatten())
        for name, width in (("a", 4), ("b", 2))
    }
    res = compare_throughput(
        models, 2, 8, warmup=1, rounds=2, iters=1, compiled=CompileOptions(True, backend="eager")
    )
    for r in res.values():
        assert r["compiled_throughput"] > 0 and r["compile_s"] > 0 and r["compile"]["backend"] == "eager"
        assert r["compiled_ratio"] == pytest.approx(r["compiled_throughput"] / r["throughput"])
    metrics = compiled_metrics(res["b"], res["a"])
    assert metrics["compiled_throughput_ratio"] == pytest.approx(
        res["b"]["compiled_throughput"] / res["a"]["compiled_throughput"]
    )
    assert compiled_metrics(compare_throughput(models, 2, 8, rounds=1, iters=1)["a"], res["a"]) == {}
