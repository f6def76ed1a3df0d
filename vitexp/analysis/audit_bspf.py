"""``vitexp-audit bspf``: the public review's four objections to BSPF-ViT, each finding labelled by what
backs it: measured on a pinned model, true by construction, or counted from shapes.

Its reasoning: docs/reading-bspf.md, "vitexp/analysis/audit_bspf.py".
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vitexp.methods.bspf import BSPF, ChunkOnly, TokenPruner

PAPER = {"deit_small": (79.8, 4.6), "chunk": (81.4, 2.4), "bspf": (81.8, 2.4)}
MICRO_RUN = "run:demo"
RANDOM_DEIT = "random initialisation (seed 0; no --deit-small given)"


def _digits(img_size: int, n: int) -> torch.Tensor:
    from vitexp.data.datamodules import DigitsDataModule

    dm = DigitsDataModule(data_config={"input_size": (3, img_size, img_size)})
    dm.setup()
    return torch.stack([dm.test_set[i][0] for i in range(min(n, len(dm.test_set)))])


def pinned_model(spec: str, results_dir: Path | None = None) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The trained backbone of a ledger train run (``run:<experiment>`` or ``run:<run_id>``),
    rebuilt from the run's recorded backbone config and class count and loaded strictly from its
    recorded weights, with what pins it (run id, experiment, weights file)."""
    from vitexp.ledger import default_results_dir, weights_file, weights_run
    from vitexp.models import build_backbone

    try:
        run = weights_run(spec, results_dir)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"--micro-run: {err}") from err
    cfg = run["config"]
    if (cfg.get("method") or {}).get("name", "baseline") != "baseline":
        raise ValueError(
            f"--micro-run {spec}: run {run['run_id']} trained method {cfg['method']['name']!r}; the "
            "audit applies BSPF to a trained baseline micro ViT (e.g. run:demo)"
        )
    model = build_backbone(
        {**cfg["backbone"], "pretrained": None}, num_classes=int(cfg["data"]["num_classes"])
    )
    weights = run["artifacts"]["weights"]
    model.load_state_dict(
        torch.load(
            weights_file(run, results_dir or default_results_dir()), map_location="cpu", weights_only=True
        )
    )
    return model.eval(), {
        "run_id": run["run_id"],
        "experiment": run["experiment"],
        "weights": weights,
        "top1": (run.get("metrics") or {}).get("top1"),
    }


def micro_findings(
    micro_run: str = MICRO_RUN, images: int = 16, results_dir: Path | None = None
) -> dict[str, Any]:
    """(a) and (b) on the pinned micro ViT (layers 1, 3, Ω = 16), with the run that pins it."""
    model, pinned = pinned_model(micro_run, results_dir)
    return {
        "pinned": pinned,
        "images": images,
        **symmetry_findings(model, _digits(32, images), chunk_size=16, layers=[1, 3]),
    }


def _scored_blocks(
    model: torch.nn.Module, images: torch.Tensor, layers: list[int]
) -> dict[int, torch.Tensor]:
    """Head-averaged chunk attention blocks (B×C×Ω×Ω) at ``layers`` of a BSPF model."""
    with torch.no_grad():
        model(images)
    return {i: model.blocks[i].attn.last_blocks for i in layers}


def symmetry_findings(
    model: torch.nn.Module, images: torch.Tensor, chunk_size: int, layers: list[int], keep_ratio: float = 0.5
) -> dict[str, float]:
    """(a): shared Q/K, full-block vs mirrored-upper-triangle decisions; (b) paper_literal vs none."""
    sym = (
        BSPF(chunk_size=chunk_size, prune_layers=layers, symmetric=True, mirror="none", fusion="none")
        .apply(copy.deepcopy(model), {"kind": "keep_ratio", "keep_ratio": keep_ratio})
        .eval()
    )
    blocks = _scored_blocks(sym, images, layers)
    asym = torch.cat([(b - b.transpose(-1, -2)).abs().flatten() for b in blocks.values()])
    mean_abs = torch.cat([b.abs().flatten() for b in blocks.values()]).mean()
    differ, total = 0, 0
    literal_diff = 0.0
    for i, b in blocks.items():
        P, C = sym.blocks[i].pruner.num_prefix, sym.blocks[i].pruner.num_chunks
        full = TokenPruner(keep_ratio, P, C, "local3x3", "none", "none")
        mirrored = TokenPruner(keep_ratio, P, C, "local3x3", "upper", "none")
        keep_full = full.select(b)[0]
        keep_mirror = mirrored.select(b)[0]
        L = b.shape[-1]
        k1 = torch.zeros(*b.shape[:2], L).scatter_(-1, keep_full, 1.0)
        k2 = torch.zeros(*b.shape[:2], L).scatter_(-1, keep_mirror, 1.0)
        differ += int((k1 != k2).sum())
        total += k1.numel()
        # (b) the literal fusion against dropping, on this layer's tokens
        x = torch.randn(b.shape[0], P + C * L, model.embed_dim, generator=torch.Generator().manual_seed(i))
        none = TokenPruner(keep_ratio, P, C, "local3x3", "none", "none")
        literal = TokenPruner(keep_ratio, P, C, "local3x3", "none", "paper_literal")
        with torch.no_grad():
            literal_diff = max(literal_diff, float((none(x, b) - literal(x, b)).abs().max()))
    # a 3x3 kernel keeps a symmetric input symmetric only if it equals its transpose
    a = torch.rand(1, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    a = a + a.transpose(-1, -2)
    kernel = torch.randn(1, 1, 3, 3, generator=torch.Generator().manual_seed(0))
    out = F.conv2d(a, kernel, padding=1)
    out_sym = F.conv2d(a, 0.5 * (kernel + kernel.transpose(-1, -2)), padding=1)
    return {
        "attn_asym_max": float(asym.max()),
        "attn_asym_mean": float(asym.mean()),
        "attn_mean": float(mean_abs),
        "mirror_decisions_differ": differ / max(total, 1),
        "mirror_decisions_total": total,
        "conv_asym_random_kernel": float((out - out.transpose(-1, -2)).abs().max()),
        "conv_asym_symmetrised_kernel": float((out_sym - out_sym.transpose(-1, -2)).abs().max()),
        "paper_literal_vs_none_max_diff": literal_diff,
    }


def scoring_cost_per_layer(
    num_patches: int,
    num_prefix: int,
    dim: int,
    chunk_size: int,
    prune_layers: list[int],
    depth: int,
    keep_ratio: float,
) -> list[dict[str, Any]]:
    """(c): MACs of the QKᵀ entries a scorer needs, plus its 3×3 convolution (9 per entry),
    scoring every chunk block (N_p² entries) or only the C diagonal blocks (C·Ω² entries)."""
    rows = []
    chunks = num_patches // chunk_size
    omega = chunk_size
    for layer in range(depth):
        n_p = chunks * omega
        all_blocks = n_p * n_p * (dim + 9)
        diagonal = chunks * omega * omega * (dim + 9)
        rows.append(
            {
                "layer": layer,
                "patch_tokens": n_p,
                "chunk_size": omega,
                "all_blocks_gmacs": all_blocks / 1e9,
                "diagonal_gmacs": diagonal / 1e9,
                "ratio": all_blocks / diagonal,
            }
        )
        if layer in prune_layers:
            omega = max(1, math.ceil(keep_ratio * omega))
    return rows


def _gmacs(model, img) -> float:
    from vitexp.measure.flops import count_macs

    return count_macs(model, img).gmacs


def deit_small_model(weights: str | None, results_dir: Path | None = None) -> tuple[torch.nn.Module, str]:
    """DeiT-S with the given weights (a local file or ``run:<...>``), else randomly initialised
    with seed 0; and how its weights are described in the report."""
    import timm

    import vitexp  # noqa: F401
    from vitexp.config.weights import resolve_weights

    if not weights:
        torch.manual_seed(0)
        return timm.create_model("deit_small_patch16_224").eval(), RANDOM_DEIT
    path = resolve_weights(weights, results_dir)
    if not Path(path).is_file():
        raise FileNotFoundError(f"--deit-small: checkpoint file not found: {path}")
    model = timm.create_model(
        "deit_small_patch16_224",
        pretrained=True,
        pretrained_cfg_overlay=dict(file=path, hf_hub_id=None, url=None),
    )
    return model.eval(), f"{weights} ({path})" if path != weights else path


def audit(
    micro_run: str = MICRO_RUN,
    deit_small: str | None = None,
    images: int = 16,
    results_dir: Path | None = None,
) -> dict[str, Any]:
    import timm

    import vitexp  # noqa: F401
    from vitexp.ledger import Ledger

    findings: dict[str, Any] = {"micro": micro_findings(micro_run, images, results_dir)}
    deit, described = deit_small_model(deit_small, results_dir)
    findings["images"] = {"micro": images, "deit_small": max(2, images // 4)}
    findings["deit_small_weights"] = described
    findings["deit_small"] = symmetry_findings(
        deit, _digits(224, max(2, images // 4)), chunk_size=49, layers=[4, 6, 9]
    )
    findings["prune_layers"] = [4, 6, 9]
    findings["scoring_cost"] = scoring_cost_per_layer(196, 1, 384, 49, findings["prune_layers"], 12, 0.5)
    rho = {"kind": "keep_ratio", "keep_ratio": 0.5}
    findings["gmacs"] = {
        "deit_small": _gmacs(timm.create_model("deit_small_patch16_224"), 224),
        "chunk": _gmacs(
            ChunkOnly(chunk_size=49).apply(timm.create_model("deit_small_patch16_224"), {"kind": "none"}), 224
        ),
        "bspf": _gmacs(
            BSPF(chunk_size=49, prune_layers=[4, 6, 9]).apply(
                timm.create_model("deit_small_patch16_224"), rho
            ),
            224,
        ),
    }
    top1, top1_runs = {}, {}
    ledger = Ledger.load(results_dir)
    pairs = (
        ("deit_small", "deit_small_baseline"),
        ("chunk", "chunk_deit_small"),
        ("bspf", "bspf_deit_small"),
    )
    ledger.check([exp for _, exp in pairs])
    for key, exp in pairs:
        run = ledger.newest(exp, "train", lambda r: r["metrics"].get("top1") is not None)
        top1[key] = run["metrics"]["top1"] if run else None
        top1_runs[key] = run["run_id"] if run else None
    findings["top1"] = top1
    findings["top1_runs"] = top1_runs
    return findings


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def render(f: dict[str, Any]) -> str:
    m, d = f["micro"], f["deit_small"]
    g, t = f["gmacs"], f["top1"]
    pin = m["pinned"]
    random_deit = f["deit_small_weights"] == RANDOM_DEIT
    lines = ["# Audit of BSPF-ViT's claims (the public review's four objections)", ""]
    lines += [
        (
            "Produced by `vitexp-audit bspf` (vitexp/analysis/audit_bspf.py). Each finding says what backs"
            " it: **measured** on a pinned model, **true by construction**, or **counted** from shapes."
        ),
        "",
        (
            "Pinned models (rerunning the audit on the same ledger gives the same numbers; every random draw"
            " is seeded):"
        ),
        "",
        (
            f"- micro ViT: trained run `{pin['run_id']}` (experiment `{pin['experiment']}`, weights "
            f"`{pin['weights']}`), {m['images']} held-out test digits in;"
        ),
        f"- DeiT-S: {f['deit_small_weights']}, {f['images']['deit_small']} test digits upsampled to 224 px in"
        + (": an untrained DeiT-S, not the released model." if random_deit else "."),
        "",
    ]
    lines += [
        "## (a) Shared W_q = W_k does not make the attention symmetric",
        "",
        "Measured. The shared projection is initialised from each model's (W_q + W_k)/2 and not retrained.",
        "",
    ]
    deit_label = "DeiT-S at random initialisation" if random_deit else "DeiT-S"
    for label, x in (("micro ViT (layers 1, 3, Ω = 16)", m), (f"{deit_label} (layers 4, 6, 9, Ω = 49)", d)):
        lines.append(
            f"- {label}: with one shared Q/K projection, the post-softmax chunk blocks have max |A − Aᵀ| ="
            f" {x['attn_asym_max']:.4f} and mean {x['attn_asym_mean']:.5f} (mean |A| = {x['attn_mean']:.5f});"
            f" scoring the upper triangle and mirroring it changes {_pct(x['mirror_decisions_differ'])} of"
            f" the {x['mirror_decisions_total']} keep/prune decisions against scoring the full block."
        )
    lines.append(
        "- A 3×3 convolution of a symmetric block stays symmetric only with a symmetric kernel: max"
        f" asymmetry {m['conv_asym_random_kernel']:.3f} with a random kernel,"
        f" {m['conv_asym_symmetrised_kernel']:.1e} with it symmetrised (what `mirror=upper` does)."
    )
    verdict_a = (
        "upheld" if max(m["mirror_decisions_differ"], d["mirror_decisions_differ"]) > 0 else "not upheld"
    )
    lines += [
        f"- Verdict: objection 1 is **{verdict_a}**: row-softmax breaks the symmetry of QKᵀ, so mirrored "
        "decisions are not the full decisions"
        + (
            " (on the trained micro ViT; the DeiT-S figures are from random weights)." if random_deit else "."
        ),
        "",
    ]
    lines += [
        "## (b) The literal fusion transfers nothing",
        "",
        (
            "True by construction: read literally, Eq. 8 multiplies the pruned values by the complement of"
            " the same mask that keeps tokens, so what it adds is zero wherever it is added. The measurement"
            " below only checks that `fusion=paper_literal` implements that reading."
        ),
        "",
    ]
    lit = max(m["paper_literal_vs_none_max_diff"], d["paper_literal_vs_none_max_diff"])
    lines += [
        (
            "- `fusion=paper_literal` against `fusion=none`: max absolute difference of the pruned layer's"
            f" output {lit:.1e} (micro and DeiT-S)."
        ),
        (
            f"- Verdict: objection 2 is **{'upheld' if lit == 0 else 'not upheld'}**, by construction: the"
            " literal Eq. 8 adds exactly zero; vitexp's `fusion=similarity` is the reading that fuses."
        ),
        "",
    ]
    lines += [
        "## (c) Scoring every chunk block is quadratic",
        "",
        "Counted from the layer shapes (no model run).",
        "",
        "| layer | patch tokens | Ω | all C² blocks (GMACs) | diagonal blocks (GMACs) | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in f["scoring_cost"]:
        lines.append(
            f"| {r['layer']} | {r['patch_tokens']} | {r['chunk_size']} | {r['all_blocks_gmacs']:.4f} | "
            f"{r['diagonal_gmacs']:.4f} | {r['ratio']:.0f}× |"
        )
    pruned = [r for r in f["scoring_cost"] if r["layer"] in f["prune_layers"]]
    tot_all = sum(r["all_blocks_gmacs"] for r in pruned)
    tot_diag = sum(r["diagonal_gmacs"] for r in pruned)
    lines += [
        "",
        (
            f"- At BSPF-DeiT-S's pruning layers {f['prune_layers']}, scoring every block costs {tot_all:.4f}"
            f" GMACs (the QKᵀ entries plus the 3×3 convolution) against {tot_diag:.4f} for the diagonal"
            " blocks. The ratio is the chunk count C = N_p/Ω, so it grows with the token count: O(N²)"
            " against O(N·Ω)."
        ),
        (
            "- Verdict: objection 3 is **upheld for the all-blocks reading** (O(N²)). vitexp scores only the "
            "diagonal blocks, which chunk attention computes anyway, so its scoring is O(N·Ω)."
        ),
        "",
    ]
    runs = f.get("top1_runs") or {}
    lines += [
        "## (d) What the +2.0 is measured against",
        "",
        "Measured: GMACs (vitexp-flops counter); top-1 only from pinned ImageNet train runs in the ledger.",
        "",
        "| DeiT-S model | vitexp GMACs | paper GMACs | vitexp top-1 | paper top-1 |",
        "|---|---|---|---|---|",
    ]
    for key, label in (
        ("deit_small", "full attention"),
        ("chunk", "chunk attention only"),
        ("bspf", "BSPF-ViT, ρ = 0.5"),
    ):
        top = f"{t[key]:.1f} (`{runs.get(key)}`)" if t[key] is not None else "not run"
        lines.append(f"| {label} | {g[key]:.3f} | {PAPER[key][1]} | {top} | {PAPER[key][0]} |")
    lines += [
        "",
        (
            f"- Chunk attention alone removes {g['deit_small'] - g['chunk']:.3f} of DeiT-S's"
            f" {g['deit_small']:.3f} GMACs (to {g['chunk']:.3f}); the paper's chunk-only row says 2.4. Only"
            f" pruning reaches it (vitexp's BSPF: {g['bspf']:.3f})."
        ),
        (
            "- By the paper's own numbers (not a vitexp measurement), BSPF gains +2.0 over full-attention"
            " DeiT-S and +0.4 over its chunk-attention model (81.8 − 81.4)."
        ),
    ]
    accuracy_run = all(t[k] is not None for k in t)
    if accuracy_run:
        lines.append(
            f"- vitexp's ImageNet runs: BSPF − full = {t['bspf'] - t['deit_small']:+.1f}, "
            f"BSPF − chunk-only = {t['bspf'] - t['chunk']:+.1f}."
        )
    lines += [
        "- Verdict on FLOPs: objection 4 is **upheld**: the paper's chunk-only GMACs cannot be a chunk-only"
        " cost."
        + (
            " Verdict on accuracy: from the runs above."
            if accuracy_run
            else (
                " On accuracy: **accuracy not run** (the three DeiT-S rows need ImageNet training:"
                " `vitexp-sweep bspf_table8 --kind train ...`), so whether most of the +2.0 is the"
                " chunk-attention model's (+1.6 by the paper's numbers) is not measured here."
            )
        ),
        "",
    ]
    return "\n".join(lines)


def summary(findings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ledger entry's metrics (the numbers) and protocol (units, and the run ids that pin the models)."""
    metrics = {
        f"{scale}_{k}": v
        for scale in ("micro", "deit_small")
        for k, v in findings[scale].items()
        if isinstance(v, (int, float))
    }
    metrics.update({f"gmacs_{k}": v for k, v in findings["gmacs"].items()})
    return metrics, {
        "unit": "GMACs",
        "resolution": 224,
        "counter": "vitexp.measure.flops",
        "micro_run": findings["micro"]["pinned"]["run_id"],
        "deit_small_weights": findings["deit_small_weights"],
        "top1_runs": findings.get("top1_runs"),
    }
