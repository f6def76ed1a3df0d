"""Detection: the micro COCO generator, COCO AP against hand-computed cases, Mask R-CNN on a
vitexp backbone (one training step, evaluation), and the detector's FLOPs protocol."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vitexp.detection.micro_coco import make_micro_coco


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            h.update(f.relative_to(folder).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def micro_coco(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("coco") / "micro"
    make_micro_coco(out, n_train=8, n_val=4, size=64, max_items=3, scale=(0.8, 1.2), seed=3, source="digits")
    return out


def test_generator_is_deterministic_for_a_seed(tmp_path, micro_coco):
    again = tmp_path / "again"
    make_micro_coco(
        again, n_train=8, n_val=4, size=64, max_items=3, scale=(0.8, 1.2), seed=3, source="digits"
    )
    other = tmp_path / "other"
    make_micro_coco(
        other, n_train=8, n_val=4, size=64, max_items=3, scale=(0.8, 1.2), seed=4, source="digits"
    )
    assert _digest(again) == _digest(micro_coco)
    assert _digest(other) != _digest(micro_coco)


def test_generator_masks_lie_inside_tight_boxes(micro_coco):
    from pycocotools.coco import COCO

    coco = COCO(str(micro_coco / "annotations" / "instances_train2017.json"))
    anns = coco.loadAnns(coco.getAnnIds())
    assert len(anns) >= 8  # at least one item per canvas
    for ann in anns:
        mask = coco.annToMask(ann).astype(bool)
        x, y, w, h = ann["bbox"]
        inside = np.zeros_like(mask)
        inside[y : y + h, x : x + w] = True
        assert mask.sum() == ann["area"] > 0
        assert not (mask & ~inside).any()  # no mask pixel outside its box
        ys, xs = np.nonzero(mask)  # and the box is the mask's tight extent
        assert (xs.min(), ys.min(), xs.max() + 1 - x, ys.max() + 1 - y) == (x, y, w, h)
    by_image = {}
    for ann in anns:  # instances of one canvas never overlap
        m = coco.annToMask(ann).astype(bool)
        prev = by_image.setdefault(ann["image_id"], np.zeros_like(m))
        assert not (prev & m).any()
        by_image[ann["image_id"]] = prev | m


def test_generator_refuses_to_overwrite(micro_coco):
    with pytest.raises(FileExistsError, match="--overwrite"):
        make_micro_coco(micro_coco, n_train=1, n_val=1, size=64, source="digits")


def _box_mask(box, size=64):
    m = torch.zeros(size, size, dtype=torch.bool)
    x0, y0, x1, y1 = (int(v) for v in box)
    m[y0:y1, x0:x1] = True
    return m


def _ap_of(preds, targets):
    """AP through the module's own conversion: predicted masks as Mask R-CNN gives them
    (N×1×H×W probabilities), targets as the dataset gives them (uint8)."""
    from vitexp.training.detection_module import ap_metrics, mean_average_precision, to_metric_inputs

    preds = [{**p, "masks": p["masks"].float().mul(0.9).add(0.05)[:, None]} for p in preds]
    targets = [{**t, "masks": t["masks"].to(torch.uint8)} for t in targets]
    metric = mean_average_precision()
    metric.update(*to_metric_inputs(preds, targets))
    return ap_metrics(metric.compute())


def test_map_perfect_prediction_is_one():
    boxes = [torch.tensor([[4.0, 4.0, 24.0, 30.0]]), torch.tensor([[30.0, 10.0, 60.0, 40.0]])]
    targets = [{"boxes": b, "labels": torch.tensor([1]), "masks": _box_mask(b[0])[None]} for b in boxes]
    preds = [{**t, "scores": torch.tensor([0.9])} for t in targets]
    ap = _ap_of(preds, targets)
    assert ap["ap_box"] == pytest.approx(1.0) and ap["ap_mask"] == pytest.approx(1.0)


def test_map_of_a_shifted_box_is_what_its_iou_implies():
    """Image 1 is predicted exactly (score 0.9); image 2's box is shifted to IoU 31/49 ≈ 0.633
    (score 0.8). At IoU thresholds 0.5, 0.55, 0.6 both are true positives (AP 1); at the 7 thresholds above,
    the ranked
    list is TP, FP over 2 ground truths: precision 1 up to recall 0.5, so COCO's 101-point
    interpolation gives 51/101. AP@[.5:.95] = (3 · 1 + 7 · 51/101) / 10."""
    gt2 = torch.tensor([[10.0, 10.0, 50.0, 40.0]])  # 40 × 30
    # shifted right by s = 9: IoU = (40 − s)/(40 + s) = 31/49, clear of the 0.6 and 0.65 thresholds
    pred2 = gt2 + torch.tensor([[9.0, 0.0, 9.0, 0.0]])
    gt1 = torch.tensor([[2.0, 2.0, 20.0, 20.0]])
    targets = [
        {"boxes": gt1, "labels": torch.tensor([1]), "masks": _box_mask(gt1[0])[None]},
        {"boxes": gt2, "labels": torch.tensor([1]), "masks": _box_mask(gt2[0])[None]},
    ]
    preds = [
        {**targets[0], "scores": torch.tensor([0.9])},
        {
            "boxes": pred2,
            "labels": torch.tensor([1]),
            "scores": torch.tensor([0.8]),
            "masks": _box_mask(pred2[0])[None],
        },
    ]
    expected = (3 * 1.0 + 7 * 51 / 101) / 10
    ap = _ap_of(preds, targets)
    assert ap["ap_box"] == pytest.approx(expected, abs=1e-4)
    assert ap["ap_mask"] == pytest.approx(expected, abs=1e-4)  # box-shaped masks: the same IoU
    assert ap["ap_box_50"] == pytest.approx(1.0) and ap["ap_box_75"] == pytest.approx(51 / 101, abs=1e-4)


def _detector(size=64, **cfg):
    import timm

    import vitexp.models  # noqa: F401  (registers the micro backbones)
    from vitexp.detection.model import build_detector

    backbone = timm.create_model(
        "caformer_micro", num_classes=10, pretrained_cfg_overlay=dict(input_size=(3, size, size))
    )
    return build_detector(
        backbone,
        10,
        {
            "min_size": size,
            "max_size": size,
            "anchor_scale": 4,
            "rpn_post_nms_top_n_test": 50,
            "detections_per_img": 10,
            "fpn_channels": 32,
            "box_representation": 64,
            "mask_layers": [16, 16],
            **cfg,
        },
    )


def test_mask_rcnn_trains_one_step_and_evaluates_on_micro_coco(micro_coco, tmp_path):
    import lightning as L

    from vitexp.detection.coco_data import CocoDataModule
    from vitexp.training.detection_module import DetectModule

    torch.manual_seed(0)
    data = CocoDataModule(str(micro_coco), name="micro_coco", num_classes=10, batch_size=2, num_workers=0)
    recipe = {
        "opt": "sgd",
        "lr": 0.01,
        "momentum": 0.9,
        "weight_decay": 1e-4,
        "epochs": 1,
        "sched": "multistep",
        "decay_epochs": [1],
        "warmup_steps": 1,
    }
    module = DetectModule(_detector(), 10, recipe)
    before = {k: v.clone() for k, v in module.model.state_dict().items() if v.is_floating_point()}
    trainer = L.Trainer(
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
        accelerator="cpu",
    )
    trainer.fit(module, datamodule=data)
    changed = [
        k for k, v in module.model.state_dict().items() if k in before and not torch.equal(v, before[k])
    ]
    assert any(k.startswith("roi_heads") for k in changed) and any(
        k.startswith("backbone.body") for k in changed
    )
    result = trainer.test(module, datamodule=data, verbose=False)[0]
    assert {"test/ap_box", "test/ap_mask", "test/ap_box_50", "test/ap_mask_75"} <= set(result)
    assert all(0.0 <= v <= 1.0 for v in result.values())


def test_coco_targets_follow_the_annotations(micro_coco):
    from pycocotools.coco import COCO

    from vitexp.detection.coco_data import CocoInstances

    ds = CocoInstances(micro_coco / "val2017", micro_coco / "annotations" / "instances_val2017.json")
    coco = COCO(str(micro_coco / "annotations" / "instances_val2017.json"))
    image, target = ds[0]
    anns = coco.loadAnns(coco.getAnnIds(imgIds=ds.coco_ds.ids[0]))
    assert image.shape == (3, 64, 64) and image.max() <= 1.0
    assert target["boxes"].tolist() == [
        [a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2], a["bbox"][1] + a["bbox"][3]] for a in anns
    ]
    assert target["labels"].tolist() == [a["category_id"] for a in anns]  # ids 1..10 map to labels 1..10
    assert target["masks"].sum().item() == sum(a["area"] for a in anns)


def test_detector_macs_count_the_heads_on_the_test_time_rois():
    """The mask head is 4 conv 3×3 at 14×14, a 2×2 stride-2 deconvolution and a 1×1 predictor at
    28×28, per detection; the box head two linear layers and the predictor per RoI. Counted on the
    configured numbers of RoIs and detections, the parts follow those formulas exactly."""
    from vitexp.detection.model import detector_macs

    det = _detector(
        size=64,
        rpn_post_nms_top_n_test=30,
        detections_per_img=7,
        fpn_channels=32,
        box_representation=64,
        mask_layers=[16, 16, 16, 16],
    )
    r = detector_macs(det, 64, 64)
    c, m, rep, k = 32, 16, 64, 11
    mask_per_det = 14 * 14 * c * m * 9 + 3 * 14 * 14 * m * m * 9 + 14 * 14 * m * m * 4 + 28 * 28 * m * k
    box_per_roi = c * 7 * 7 * rep + rep * rep + rep * k + rep * 4 * k
    assert r["by_part_gmacs"]["mask_head"] * 1e9 == pytest.approx(7 * mask_per_det)
    assert r["by_part_gmacs"]["box_head"] * 1e9 == pytest.approx(30 * box_per_roi)
    assert r["gmacs"] == pytest.approx(sum(r["by_part_gmacs"].values()))
    assert r["by_part_gmacs"]["backbone_fpn"] > 0 and r["by_part_gmacs"]["rpn_head"] > 0


def test_cli_writes_the_dataset_and_prints_json(tmp_path, capsys):
    from vitexp.detection.micro_coco import main

    assert (
        main(
            [
                "make-micro-coco",
                "--out",
                str(tmp_path / "m"),
                "--train",
                "2",
                "--val",
                "1",
                "--size",
                "64",
                "--source",
                "digits",
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["status"] == "completed" and summary["train"]["images"] == 2
    assert (
        main(["make-micro-coco", "--out", str(tmp_path / "m"), "--source", "digits"]) == 2
    )  # exists: refused
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["status"] == "failed"


@pytest.mark.parametrize("experiment", ["caformer", "bspf_caformer", "shvit", "bspf_shvit"])
def test_detector_trains_under_bf16_autocast(experiment, make_cfg):
    """Forward and backward of the micro detector (plain and BSPF-ViT backbone) under CPU bf16 autocast."""
    from vitexp.detection import detector_for
    from vitexp.training.build import build_model

    overrides = [f"experiment=micro_coco_{experiment}", "data.root=/nonexistent"]
    model, _, data_config = build_model(make_cfg(overrides))
    cfg = make_cfg(overrides)
    detector = detector_for(cfg, model, data_config).train()
    mask = torch.zeros(1, 128, 128, dtype=torch.uint8)
    mask[0, 20:60, 30:70] = 1
    targets = [
        {"boxes": torch.tensor([[30.0, 20.0, 70.0, 60.0]]), "labels": torch.tensor([4]), "masks": mask}
    ] * 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = detector([torch.rand(3, 128, 128), torch.rand(3, 128, 128)], targets)
    loss = sum(losses.values())
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in detector.backbone.body.model.stages.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    # a from-scratch backbone's normalisation scales train (freeze_bn: auto): frozen, SHViT's
    # zero-initialised residual BatchNorm scales would stay 0 and switch its blocks off
    for name, stage in detector.backbone.body.model.stages.named_children():
        scales = [p.grad for n, p in stage.named_parameters() if n.endswith("weight") and p.dim() == 1]
        assert any(g is not None and g.abs().sum() > 0 for g in scales), (
            f"stage {name}: no normalisation scale learns"
        )
    if experiment.startswith("bspf"):  # the detector's backbone really pruned
        from vitexp.methods.bspf import TokenPruner

        realised = [m.realised for m in detector.modules() if isinstance(m, TokenPruner)]
        assert realised and all(kept < total for kept, total in realised)


def test_the_images_a_padded_sampler_repeats_are_emptied_before_the_metric():
    """7 validation images on 2 ranks, batch 2: Lightning's DistributedSampler gives rank 1 the images
    1, 3, 5 and 0 again; that last one (batch 1, position 1) is emptied, nothing on rank 0."""
    from types import SimpleNamespace

    from torch.utils.data import DistributedSampler

    from vitexp.training.detection_module import DetectModule

    def at(rank):
        dm = SimpleNamespace(val_set=list(range(7)), test_set=list(range(7)), batch_size=2)
        return SimpleNamespace(trainer=SimpleNamespace(world_size=2, global_rank=rank, datamodule=dm))

    order = list(DistributedSampler(range(7), num_replicas=2, rank=1, shuffle=False))
    assert order == [1, 3, 5, 0]  # the padding repeats image 0 at rank 1's fourth place
    assert [DetectModule._padding(at(1), b, 2, "val") for b in (0, 1)] == [[], [1]]
    assert [DetectModule._padding(at(0), b, 2, "test") for b in (0, 1)] == [[], []]


def test_micro_detection_runs_under_ddp_gloo(results_dir, tmp_path):
    """objective=detect in 2 DDP processes (gloo): one ledger entry with box and mask APs; 3 validation
    images, so the padded sampler repeats one (emptied, and the per-image gather still lines up)."""
    import subprocess
    import sys

    from conftest import cli_env, ledger_entries

    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "vitexp-train"),
            "experiment=micro_coco_caformer",
            "trainer=ddp_cpu",
            f"data.root={tmp_path / 'coco'}",
            "data.generate.n_train=8",
            "data.generate.n_val=3",
            "recipe.batch_size=2",
            "recipe.epochs=1",
            "recipe.warmup_steps=1",
            "logger=none",
            "trainer.enable_progress_bar=false",
            "trainer.num_sanity_val_steps=0",
            f"hydra.run.dir={tmp_path / 'out'}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=cli_env(results_dir),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (entry,) = ledger_entries(results_dir)
    m = entry["metrics"]
    assert entry["status"] == "completed" and m["world_size"] == 2
    assert m["steps"] == 2  # 8 canvases, batch 2, 2 ranks: 2 steps per rank
    assert {"ap_box", "ap_mask", "ap_box_50", "gmacs", "gmacs_backbone_fpn"} <= set(m)
    assert (
        m["best_val_ap_box"] == pytest.approx(m["val_ap_box"]) and m["best_val_epoch"] == 1
    )  # one epoch: its own


def test_batchnorm_is_frozen_only_for_a_backbone_that_starts_from_weights(make_cfg, tmp_path):
    """freeze_bn: auto. A from-scratch shvit_micro keeps trainable BatchNorm (frozen at init, its
    zero-initialised residual scales would stay 0); with weights, BatchNorm is frozen as usual."""
    from torchvision.ops.misc import FrozenBatchNorm2d  # what timm.layers.freeze_batch_norm_2d makes

    from vitexp.detection import detector_for
    from vitexp.training.build import build_model

    def frozen(overrides):
        cfg = make_cfg(["experiment=micro_coco_shvit", "data.root=/nonexistent", *overrides])
        model, _, data_config = build_model(cfg)
        body = detector_for(cfg, model, data_config).backbone.body
        return [
            isinstance(m, FrozenBatchNorm2d)
            for m in body.modules()
            if isinstance(m, (torch.nn.BatchNorm2d, FrozenBatchNorm2d))
        ]

    scratch = frozen([])
    assert scratch and not any(scratch)
    assert all(frozen(["detector.freeze_bn=true"]))


def test_the_detect_objective_resumes_like_the_others():
    """DetectModule is an ObjectiveModule: its checkpoints carry the global RNG states (exact resume)
    and a non-finite loss stops with the shared guard's error."""
    from vitexp.errors import NonFiniteLossError
    from vitexp.training.detection_module import DetectModule

    module = DetectModule(torch.nn.Linear(2, 2), 10, {"lr": 1e-3})
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    assert set(checkpoint["vitexp_rng"]) == {"torch", "numpy", "python"}
    with pytest.raises(NonFiniteLossError, match="detection loss"):
        module.check_finite(torch.tensor(float("nan")), "detection loss")


def test_flips_follow_the_epoch_in_persistent_workers(micro_coco):
    """The epoch reaches the loader's (persistent) worker with each index: epoch 1 flips other images
    than epoch 0, the flips the main process draws for that epoch, not a repeat of epoch 0's."""
    from vitexp.detection.coco_data import CocoDataModule

    dm = CocoDataModule(micro_coco, num_classes=10, batch_size=4, num_workers=1, hflip=0.5, loader_seed=1)
    dm.setup()
    plain = {
        int(t["image_id"]): img
        for img, t in (
            dm.val_set.__class__(
                micro_coco / "train2017", micro_coco / "annotations" / "instances_train2017.json"
            )[i]
            for i in range(len(dm.train_set))
        )
    }
    loader = dm.train_dataloader()
    assert loader.persistent_workers
    flipped = []
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        seen = {
            int(t["image_id"]): not torch.equal(img, plain[int(t["image_id"])])
            for images, targets in loader
            for img, t in zip(images, targets)
        }
        expected = {
            int(t["image_id"]): not torch.equal(img, plain[int(t["image_id"])])
            for img, t in (dm.train_set[(epoch, i)] for i in range(len(dm.train_set)))
        }
        assert seen == expected, epoch
        flipped.append({k for k, v in seen.items() if v})
    assert flipped[0] != flipped[1] and flipped[0] and flipped[1]
