"""COCO's own protocol: vitexp's evaluation (the micro COCO's validation split through
CocoDataModule, DetectModule and torchmetrics' MeanAveragePrecision) gives the 12 summary numbers
that pycocotools' COCOeval gives on the same annotation file and the same detections, box and mask,
on a split with crowd regions; training targets leave the crowds out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from vitexp.detection.micro_coco import make_micro_coco

#: torchmetrics' names of COCOeval's 12 summary numbers, in COCOeval's ``stats`` order.
STATS = (
    "map",
    "map_50",
    "map_75",
    "map_small",
    "map_medium",
    "map_large",
    "mar_1",
    "mar_10",
    "mar_100",
    "mar_small",
    "mar_medium",
    "mar_large",
)


@pytest.fixture(scope="module")
def crowded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("coco") / "crowded"
    make_micro_coco(
        out, n_train=6, n_val=16, size=96, max_items=4, scale=(0.8, 2.0), seed=11, source="digits", crowd=0.7
    )
    return out


def _gt(root: Path):
    from pycocotools.coco import COCO

    return COCO(str(root / "annotations" / "instances_val2017.json"))


def _shifted(mask: np.ndarray, dx: int, dy: int) -> np.ndarray:
    out = np.zeros_like(mask)
    h, w = mask.shape
    ys, xs = np.nonzero(mask)
    ys, xs = ys + dy, xs + dx
    keep = (ys >= 0) & (ys < h) & (xs >= 0) & (xs < w)
    out[ys[keep], xs[keep]] = 1
    return out


def _detections(coco, seed: int = 0) -> dict[int, list[dict]]:
    """Per image: detections that hit, miss, duplicate and mislabel its instances, sit on its crowd
    regions (the ones COCOeval ignores) or on nothing, with distinct float32 scores."""
    rng = np.random.default_rng(seed)
    out: dict[int, list[dict]] = {}
    cats = sorted(coco.getCatIds())
    for image_id in sorted(coco.getImgIds()):
        info = coco.imgs[image_id]
        h, w = info["height"], info["width"]
        dets = []
        for ann in coco.loadAnns(coco.getAnnIds(imgIds=image_id)):
            mask = coco.annToMask(ann)
            x, y, bw, bh = (int(v) for v in ann["bbox"])
            if ann["iscrowd"]:  # parts of a crowd: unmatched, ignored by COCO's protocol
                for _ in range(2):
                    px, pw = x + int(rng.integers(0, max(1, bw // 2))), max(4, bw // 3)
                    part = np.zeros_like(mask)
                    part[y : y + bh, px : px + pw] = mask[y : y + bh, px : px + pw]
                    dets.append((part, [px, y, px + pw, y + bh], ann["category_id"]))
                continue
            for _ in range(int(rng.integers(1, 3))):  # a hit of some IoU, sometimes twice (a duplicate)
                dx, dy = (int(v) for v in rng.integers(-bw // 3 - 1, bw // 3 + 2, size=2))
                label = ann["category_id"] if rng.random() < 0.85 else int(rng.choice(cats))
                dets.append((_shifted(mask, dx, dy), [x + dx, y + dy, x + dx + bw, y + dy + bh], label))
        for _ in range(int(rng.integers(0, 3))):  # on nothing
            bw, bh = (int(v) for v in rng.integers(6, 40, size=2))
            x, y = int(rng.integers(0, w - bw)), int(rng.integers(0, h - bh))
            box = np.zeros((h, w), dtype=np.uint8)
            box[y : y + bh, x : x + bw] = 1
            dets.append((box, [x, y, x + bw, y + bh], int(rng.choice(cats))))
        scores = rng.permutation(len(dets)) / max(1, len(dets)) * 0.9 + rng.uniform(0.05, 0.1)
        out[image_id] = [
            {
                "mask": m.astype(np.uint8),
                "box": [float(v) for v in b],
                "category_id": c,
                "score": float(np.float32(s)),
            }
            for (m, b, c), s in zip(dets, scores)
        ]
    return out


def _cocoeval(coco, detections: dict[int, list[dict]], iou_type: str, tmp_path: Path) -> np.ndarray:
    """COCOeval's 12 numbers from a results file written as COCO's detection results format."""
    from pycocotools import mask as mask_utils
    from pycocotools.cocoeval import COCOeval

    results = []
    for image_id, dets in detections.items():
        for d in dets:
            x0, y0, x1, y1 = d["box"]
            item = {"image_id": image_id, "category_id": d["category_id"], "score": d["score"]}
            if iou_type == "bbox":
                item["bbox"] = [x0, y0, x1 - x0, y1 - y0]
            else:
                rle = mask_utils.encode(np.asfortranarray(d["mask"]))
                item["segmentation"] = {"size": rle["size"], "counts": rle["counts"].decode("ascii")}
            results.append(item)
    path = tmp_path / f"results_{iou_type}.json"
    path.write_text(json.dumps(results))
    ev = COCOeval(coco, coco.loadRes(str(path)), iou_type)
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return np.array(ev.stats)


class Replay(nn.Module):
    """A detector stand-in that returns the prepared detections of each image in the loader's order,
    as Mask R-CNN returns them (boxes x0 y0 x1 y1, mask probabilities N × 1 × H × W)."""

    def __init__(self, outputs: list[dict[str, torch.Tensor]]):
        super().__init__()
        self.outputs, self.served = outputs, 0
        self.anchor = nn.Parameter(torch.zeros(1))

    def forward(self, images):
        out = self.outputs[self.served : self.served + len(images)]
        assert [tuple(o["masks"].shape[-2:]) for o in out] == [tuple(i.shape[-2:]) for i in images]
        self.served += len(images)
        return out


def _vitexp_eval(root: Path, detections: dict[int, list[dict]], tmp_path: Path) -> dict[str, float]:
    """The 12 numbers of box and mask AP through vitexp's test loop on the micro COCO's val split."""
    import lightning as L

    from vitexp.detection.coco_data import CocoDataModule
    from vitexp.training.detection_module import DetectModule

    data = CocoDataModule(str(root), name="micro_coco", num_classes=10, batch_size=3, num_workers=0)
    data.setup()
    label_of = data.test_set.label_of
    outputs = []
    for image_id in data.test_set.coco_ds.ids:  # the loader's order
        dets = detections[image_id]
        outputs.append(
            {
                "boxes": torch.tensor([d["box"] for d in dets], dtype=torch.float32).reshape(-1, 4),
                "labels": torch.tensor([label_of[d["category_id"]] for d in dets], dtype=torch.int64),
                "scores": torch.tensor([d["score"] for d in dets], dtype=torch.float32),
                "masks": torch.stack(
                    [torch.from_numpy(d["mask"]).float().mul(0.8).add(0.1)[None] for d in dets]
                ),
            }
        )
    module = DetectModule(Replay(outputs), 10, {"opt": "sgd", "lr": 0.1, "weight_decay": 0.0, "epochs": 1})
    computed: dict[str, float] = {}
    module._log_map = lambda split, metric: computed.update(
        {k: float(v) for k, v in metric.compute().items() if v.numel() == 1}
    )
    trainer = L.Trainer(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        accelerator="cpu",
        default_root_dir=str(tmp_path),
    )
    trainer.test(module, datamodule=data, verbose=False)
    assert module.model.served == len(outputs)
    return computed


def test_the_split_has_crowd_regions_that_training_leaves_out(crowded):
    from vitexp.detection.coco_data import CocoInstances

    coco = _gt(crowded)
    crowds = [a for a in coco.loadAnns(coco.getAnnIds()) if a["iscrowd"]]
    assert len(crowds) >= 4 and all(
        isinstance(a["segmentation"]["counts"], list) for a in crowds
    )  # uncompressed RLE
    for a in crowds:  # the RLE decodes to the annotated area, inside the annotated box
        m = coco.annToMask(a).astype(bool)
        x, y, w, h = a["bbox"]
        assert m.sum() == a["area"] and not m[:y].any() and not m[y + h :].any() and not m[:, x + w :].any()
    images, annotations = crowded / "val2017", crowded / "annotations" / "instances_val2017.json"
    train, evaluation = (
        CocoInstances(images, annotations),
        CocoInstances(images, annotations, evaluation=True),
    )
    n_crowd = n_all = 0
    for i in range(len(train)):
        _, t = train[i]
        _, e = evaluation[i]
        n_crowd += int(e["iscrowd"].sum())
        n_all += len(e["labels"])
        assert len(t["labels"]) == int((e["iscrowd"] == 0).sum())  # training: the crowds are gone
        assert torch.equal(t["boxes"], e["boxes"][e["iscrowd"] == 0])
    assert n_crowd == len(crowds) and n_all == len(coco.getAnnIds())


def test_ap_equals_cocoeval_on_a_split_with_crowd_regions(crowded, tmp_path):
    """The 12 summary numbers, box and mask, agree with COCOeval's to 1e-4; and the crowd regions
    matter: scored as ordinary instances, the detections on them change AP."""
    coco = _gt(crowded)
    detections = _detections(coco)
    ours = _vitexp_eval(crowded, detections, tmp_path)
    for iou_type in ("bbox", "segm"):
        theirs = _cocoeval(coco, detections, iou_type, tmp_path)
        mine = np.array([ours[f"{iou_type}_{k}"] for k in STATS])
        assert np.abs(mine - theirs).max() < 1e-4, (iou_type, mine, theirs)
        assert theirs[0] > 0.01 and theirs[3] > 0  # not a degenerate case: real AP, small objects present
    for ann in coco.dataset["annotations"]:  # the same file with its crowds scored as instances
        ann["iscrowd"] = 0
    coco.createIndex()
    assert abs(_cocoeval(coco, detections, "bbox", tmp_path)[0] - ours["bbox_map"]) > 1e-3
