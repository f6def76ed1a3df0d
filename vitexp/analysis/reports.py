"""The bodies of ``vitexp-analyze tokens`` and ``vitexp-analyze heads`` inside their owned run
(vitexp/commands/inspect.py opens it): model and data from the config or the run, the figures, what the
ledger entry records.

**Which weights** (``tokens``). ``backbone.pretrained`` (a file or ``run:<experiment|run_id>``)
holds either a backbone's weights, on which the method is applied as configured (a token
method's own parameters, BSPF-ViT's scorer, at their initial values), or the saved model of a
train run of that method (BSPF-ViT's ``weights.pth`` with its scorer), loaded whole into the
method model. The first is tried first; the second when the backbone refuses the file's keys.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, open_dict

from vitexp.errors import ConfigError

#: How the figure's title names where the weights came from (:func:`token_model`).
WEIGHTS = {
    "backbone": "backbone weights, method applied",
    "method": "the trained method model's weights",
    "none": "random init",
}
#: The methods whose token decisions ``vitexp-analyze tokens`` draws.
TOKEN_METHODS = ("bspf", "chunk", "evit", "tome")


def check_request(cfg: DictConfig, analysis: str, record: dict[str, Any] | None) -> None:
    """A ConfigError, before any ledger entry, for a method that reduces no tokens (``tokens``) or
    a run that is not a SAPER run (``heads``)."""
    if analysis == "tokens" and cfg.method.name not in TOKEN_METHODS:
        raise ConfigError(
            f"vitexp-analyze tokens: method={cfg.method.name} reduces no tokens; "
            f"valid methods: {list(TOKEN_METHODS)}"
        )
    family = (cfg.backbone.get("arch") or {}).get("family", "vit")
    if analysis == "tokens" and family in ("metaformer", "shvit"):
        raise ConfigError(
            f"vitexp-analyze tokens draws a ViT's patch tokens; backbone={cfg.backbone.name} is a "
            f"{family} (use a ViT backbone: vit_micro, t2t_vit_micro, lvvit_micro, dinov2_micro, DeiT)"
        )
    if analysis == "heads" and not (record or {}).get("kept_heads"):
        raise ConfigError(
            f"vitexp-analyze heads: run {(record or {}).get('run_id')} ({(record or {}).get('experiment')}) "
            "has no kept_heads: it is not a completed SAPER train run (method=saper_ft or saper_kd)"
        )


def token_model(cfg: DictConfig, path: str | None):
    """(model, method, data config, where its weights came from: ``backbone`` | ``method`` | ``none``);
    ``path``: ``backbone.pretrained`` as the command's resolve step found it (``None``: none)."""
    from vitexp.models import CheckpointMismatchError
    from vitexp.training.build import build_model, load_weights

    try:
        model, method, data_config = build_model(cfg, None, path)
        return model, method, data_config, "backbone" if path else "none"
    except CheckpointMismatchError as err:
        bare = copy.deepcopy(cfg)
        with open_dict(bare):
            bare.backbone.pretrained = None
        model, method, data_config = build_model(bare)
        missing, unexpected = model.load_state_dict(load_weights(path), strict=False)
        if missing or unexpected:
            raise CheckpointMismatchError(
                str(path),
                list(missing),
                list(unexpected),
                f"neither the backbone's keys ({err}) nor the {method.name} model's",
            ) from None
        return model, method, data_config, "method"


def token_report(
    cfg: DictConfig, args: argparse.Namespace, out_dir: Path, path: str | None
) -> dict[str, Any]:
    """Source maps of the first ``args.images`` test images, one PNG each (``path``: the resolved weights)."""
    from vitexp.analysis import tokens
    from vitexp.analysis.token_plots import draw_token_maps
    from vitexp.training.build import build_datamodule

    model, method, data_config, weights = token_model(cfg, path)
    model.eval()
    datamodule = build_datamodule(cfg, data_config)
    datamodule.setup("test")
    test = datamodule.test_set
    n = min(int(args.images), len(test))
    images, labels = zip(*(test[i] for i in range(n)))
    batch = torch.stack(images)
    grid = tokens.patch_grid(model)
    order = tokens.first_order(model)
    chunks = tokens.chunk_count(model)
    maps = tokens.source_maps(tokens.record_decisions(model, batch), grid[0] * grid[1], order)
    chunk_of = tokens.patch_chunks(grid[0] * grid[1], chunks, order) if chunks > 1 else None
    figures = []
    for i in range(n):
        out = out_dir / f"{cfg.name}_tokens_{i}.png"
        title = f"{cfg.name} ({method.name}; {WEIGHTS[weights]}); test image {i}, label {int(labels[i])}"
        figures.append(draw_token_maps(batch[i], maps, i, grid, chunk_of, out, title))
    return {
        "images": n,
        "chunks": chunks,
        "weights": weights,
        "grid": list(grid),
        "layers": tokens.layer_counts(maps),
        "figures": figures,
    }


def pin_teacher(cfg: DictConfig, record: dict[str, Any]) -> None:
    """``backbone.pretrained: run:<experiment>`` pinned to the teacher SAPER run ``record`` loaded, not a
    newer run of that name (before the command's resolve step)."""
    from vitexp.analysis.audit_saper import teacher_of
    from vitexp.ledger import RUN_WEIGHTS_PREFIX

    if str(cfg.backbone.get("pretrained") or "").startswith(RUN_WEIGHTS_PREFIX):
        with open_dict(cfg):
            cfg.backbone.pretrained = teacher_of(record, Path(cfg.results_dir))


def head_report(
    cfg: DictConfig, record: dict[str, Any], args: argparse.Namespace, out_dir: Path, path: str | None
) -> dict[str, Any]:
    """The heads grid of SAPER run ``record`` beside the head clusters of its unpruned backbone (built
    with ``path``, the teacher's weights the command's resolve step found: :func:`pin_teacher`)."""
    from vitexp.analysis.head_grid import checkpoint_scores, draw_head_grid, kept_mask
    from vitexp.analysis.heads import head_clusters
    from vitexp.ledger import local_path
    from vitexp.training.build import build_configured_backbone, build_datamodule, data_config_for

    kept = record["kept_heads"]
    backbone = build_configured_backbone(cfg, path).eval()
    heads = int(backbone.blocks[0].attn.num_heads)
    output_dir = local_path(record.get("output_dir"), cfg.results_dir)
    # the select stage's checkpoint holds the scores (a run before the two stages: checkpoints/last.ckpt)
    checkpoint = (
        next(
            (
                c
                for c in (
                    output_dir / "checkpoints" / "select" / "last.ckpt",
                    output_dir / "checkpoints" / "last.ckpt",
                )
                if c.is_file()
            ),
            None,
        )
        if output_dir
        else None
    )
    scores = checkpoint_scores(checkpoint)
    mask = kept_mask(kept, heads)
    agree = None
    if scores is not None:
        top = torch.zeros(scores.numel(), dtype=torch.bool)
        top[scores.topk(int(mask.sum())).indices] = True
        agree = bool((top.reshape(mask.shape).numpy() == mask).all())
    datamodule = build_datamodule(cfg, data_config_for(cfg, backbone))
    datamodule.setup("test")
    test = datamodule.test_set
    n = min(int(args.images), len(test))
    images = torch.stack([test[i][0] for i in range(n)])
    prefix = int(getattr(backbone, "num_prefix_tokens", 1))
    name = f"{record['experiment']}_{record['run_id'][-6:]}"
    clusters = head_clusters(backbone, images, prefix, args.clusters, out_dir / f"{name}_head_clusters.png")
    out = out_dir / f"{name}_heads.png"
    title = (
        f"{record['experiment']} (run {record['run_id']}): {int(mask.sum())} of {mask.size} heads kept; "
        f"clusters over {n} test images"
    )
    marked = draw_head_grid(kept, heads, scores, clusters["labels"], out, title)
    return {
        "figures": [out, out_dir / f"{name}_head_clusters.png"],
        "marked": marked,
        "backbone_weights": cfg.backbone.get("pretrained"),
        "kept_heads": kept,
        "head_scores": None if scores is None else [round(float(s), 6) for s in scores],
        "scores_from": str(checkpoint) if scores is not None else None,
        "scores_agree_with_kept": agree,
        "head_clusters": clusters["labels"],
        "silhouette": clusters["silhouette"],
        "davies_bouldin": clusters["davies_bouldin"],
        "images": n,
    }
