"""``vitexp-audit bspf``: the public review's four objections to BSPF-ViT, measured.

Everything is measured on real images, at two scales:
- digits through a micro ViT trained here (10 epochs of the demo recipe, seeded), or through the
  checkpoint given with ``--micro-checkpoint``;
- DeiT-S at 224 px, with the weights given by ``--deit-small`` (a local file), else at random
  initialisation (said so in the report). Its inputs are digits upsampled to 224 px.

(a) With W_q = W_k (BSPF's shared projection), the logits S = QKᵀ are symmetric but the
    row-softmax A is not: the report gives max and mean |A − Aᵀ| over the scored blocks, and the
    fraction of keep/prune decisions that differ between scoring the full block and scoring its
    upper triangle mirrored.
(b) ``fusion=paper_literal`` against ``fusion=none``: the max absolute difference of the pruned
    layer's output.
(c) The MACs of scoring every chunk block A_{m,n} (C² blocks: the whole N×N QKᵀ) against only
    the diagonal blocks, per layer of BSPF-DeiT-S at the token count each layer sees.
(d) The GMACs of DeiT-S, chunk-only and BSPF beside the paper's 4.6 / 2.4 / 2.4, and the accuracy
    deltas from the ledger when the ImageNet runs exist.
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


def _digits(img_size: int, n: int) -> torch.Tensor:
    from vitexp.data import DigitsDataModule

    dm = DigitsDataModule(data_config={"input_size": (3, img_size, img_size)})
    dm.setup()
    return torch.stack([dm.test_set[i][0] for i in range(min(n, len(dm.test_set)))])


def _trained_micro(checkpoint: str | None, epochs: int = 10) -> torch.nn.Module:
    """The micro ViT with trained weights: from a Lightning checkpoint, or trained here."""
    import timm

    import vitexp  # noqa: F401
    from vitexp.config import compose
    from vitexp.data import DigitsDataModule
    from vitexp.module import ClassifyModule

    model = timm.create_model("vit_micro_patch4_32", num_classes=10)
    if checkpoint:
        path = Path(checkpoint)
        if not path.is_file():
            raise FileNotFoundError(f"--micro-checkpoint: file not found: {path}")
        state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
        model.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
        return model.eval()
    import lightning as L

    L.seed_everything(0, verbose=False)
    recipe = dict(compose(["recipe.epochs=%d" % epochs, "recipe.warmup_epochs=1"]).recipe)
    dm = DigitsDataModule(data_config={"input_size": (3, 32, 32)})
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(ClassifyModule(model, 10, recipe), datamodule=dm)
    return model.eval()


def _scored_blocks(model: torch.nn.Module, images: torch.Tensor, layers: list[int]) -> dict[int, torch.Tensor]:
    """Head-averaged chunk attention blocks (B×C×Ω×Ω) at ``layers`` of a BSPF model."""
    with torch.no_grad():
        model(images)
    return {i: model.blocks[i].attn.last_blocks for i in layers}


def symmetry_findings(model: torch.nn.Module, images: torch.Tensor, chunk_size: int, layers: list[int],
                      keep_ratio: float = 0.5) -> dict[str, float]:
    """(a): shared Q/K, full-block vs mirrored-upper-triangle decisions; (b) paper_literal vs none."""
    sym = BSPF(chunk_size=chunk_size, prune_layers=layers, symmetric=True, mirror="none",
               fusion="none").apply(copy.deepcopy(model), {"kind": "keep_ratio", "keep_ratio": keep_ratio}).eval()
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
        x = torch.randn(b.shape[0], P + C * L, model.embed_dim)
        none = TokenPruner(keep_ratio, P, C, "local3x3", "none", "none")
        literal = TokenPruner(keep_ratio, P, C, "local3x3", "none", "paper_literal")
        with torch.no_grad():
            literal_diff = max(literal_diff, float((none(x, b) - literal(x, b)).abs().max()))
    # a 3x3 kernel keeps a symmetric input symmetric only if it equals its transpose
    a = torch.rand(1, 1, 16, 16)
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


def scoring_cost_per_layer(num_patches: int, num_prefix: int, dim: int, chunk_size: int, prune_layers: list[int],
                           depth: int, keep_ratio: float) -> list[dict[str, Any]]:
    """(c): MACs of the QKᵀ entries a scorer needs, plus its 3×3 convolution (9 per entry),
    scoring every chunk block (N_p² entries) or only the C diagonal blocks (C·Ω² entries)."""
    rows = []
    chunks = num_patches // chunk_size
    omega = chunk_size
    for layer in range(depth):
        n_p = chunks * omega
        all_blocks = n_p * n_p * (dim + 9)
        diagonal = chunks * omega * omega * (dim + 9)
        rows.append({"layer": layer, "patch_tokens": n_p, "chunk_size": omega, "all_blocks_gmacs": all_blocks / 1e9,
                     "diagonal_gmacs": diagonal / 1e9, "ratio": all_blocks / diagonal})
        if layer in prune_layers:
            omega = max(1, math.ceil(keep_ratio * omega))
    return rows


def _gmacs(model, img) -> float:
    from vitexp.flops import count_macs

    return count_macs(model, img).gmacs


def audit(micro_checkpoint: str | None = None, deit_small: str | None = None, images: int = 16,
          results_dir: Path | None = None) -> dict[str, Any]:
    import timm

    import vitexp  # noqa: F401
    from vitexp.results import completed_runs

    findings: dict[str, Any] = {}
    micro = _trained_micro(micro_checkpoint)
    findings["images"] = {"micro": images, "deit_small": max(2, images // 4)}
    findings["micro"] = symmetry_findings(micro, _digits(32, images), chunk_size=16, layers=[1, 3])
    if deit_small:
        if not Path(deit_small).is_file():
            raise FileNotFoundError(f"--deit-small: checkpoint file not found: {deit_small}")
        deit = timm.create_model("deit_small_patch16_224", pretrained=True,
                                 pretrained_cfg_overlay=dict(file=deit_small, hf_hub_id=None, url=None)).eval()
    else:
        torch.manual_seed(0)
        deit = timm.create_model("deit_small_patch16_224").eval()
    findings["deit_small_weights"] = deit_small or "random initialisation (no --deit-small given)"
    findings["deit_small"] = symmetry_findings(deit, _digits(224, max(2, images // 4)), chunk_size=49, layers=[4, 6, 9])
    findings["prune_layers"] = [4, 6, 9]
    findings["scoring_cost"] = scoring_cost_per_layer(196, 1, 384, 49, findings["prune_layers"], 12, 0.5)
    rho = {"kind": "keep_ratio", "keep_ratio": 0.5}
    findings["gmacs"] = {
        "deit_small": _gmacs(timm.create_model("deit_small_patch16_224"), 224),
        "chunk": _gmacs(ChunkOnly(chunk_size=49).apply(timm.create_model("deit_small_patch16_224"), {"kind": "none"}), 224),
        "bspf": _gmacs(BSPF(chunk_size=49, prune_layers=[4, 6, 9]).apply(timm.create_model("deit_small_patch16_224"), rho), 224),
    }
    top1 = {}
    for key, exp in (("deit_small", "deit_small_baseline"), ("chunk", "chunk_deit_small"), ("bspf", "bspf_deit_small")):
        runs = [r for r in completed_runs(experiment=exp, kind="train", results_dir=results_dir)
                if r["metrics"].get("top1") is not None]
        top1[key] = runs[-1]["metrics"]["top1"] if runs else None
    findings["top1"] = top1
    return findings


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def render(f: dict[str, Any]) -> str:
    m, d = f["micro"], f["deit_small"]
    g, t = f["gmacs"], f["top1"]
    lines = ["# Audit of BSPF-ViT's claims (the public review's four objections)", ""]
    lines += ["Measured by `vitexp-audit bspf` (vitexp/analysis/audit_bspf.py). Micro: a micro ViT trained on digits, "
              f"{f['images']['micro']} held-out test digits in; DeiT-S: {f['deit_small_weights']}, "
              f"{f['images']['deit_small']} test digits upsampled to 224 px in.", ""]
    lines += ["## (a) Shared W_q = W_k does not make the attention symmetric", ""]
    for label, x in (("micro ViT (layers 1, 3, Ω = 16)", m), ("DeiT-S (layers 4, 6, 9, Ω = 49)", d)):
        lines.append(f"- {label}: with one shared Q/K projection, the post-softmax chunk blocks have max |A − Aᵀ| = "
                     f"{x['attn_asym_max']:.4f} and mean {x['attn_asym_mean']:.5f} (mean |A| = {x['attn_mean']:.5f}); "
                     f"scoring the upper triangle and mirroring it changes {_pct(x['mirror_decisions_differ'])} of the "
                     f"{x['mirror_decisions_total']} keep/prune decisions against scoring the full block.")
    lines.append(f"- A 3×3 convolution of a symmetric block stays symmetric only with a symmetric kernel: max asymmetry "
                 f"{m['conv_asym_random_kernel']:.3f} with a random kernel, {m['conv_asym_symmetrised_kernel']:.1e} "
                 "with it symmetrised (what `mirror=upper` does).")
    verdict_a = "upheld" if max(m["mirror_decisions_differ"], d["mirror_decisions_differ"]) > 0 else "not upheld"
    lines += [f"- Verdict: objection 1 is **{verdict_a}**: row-softmax breaks the symmetry of QKᵀ, so mirrored "
              "decisions are not the full decisions.", ""]
    lines += ["## (b) The literal fusion transfers nothing", ""]
    lit = max(m["paper_literal_vs_none_max_diff"], d["paper_literal_vs_none_max_diff"])
    lines += [f"- `fusion=paper_literal` (pruned values added where the kept mask is non-zero) against `fusion=none`: "
              f"max absolute difference of the pruned layer's output {lit:.1e} (micro and DeiT-S).",
              f"- Verdict: objection 2 is **{'upheld' if lit == 0 else 'not upheld'}**: read literally, Eq. 8 adds "
              "exactly zero; vitexp's `fusion=similarity` is the reading that fuses.", ""]
    lines += ["## (c) Scoring every chunk block is quadratic", "",
              "| layer | patch tokens | Ω | all C² blocks (GMACs) | diagonal blocks (GMACs) | ratio |", "|---|---|---|---|---|---|"]
    for r in f["scoring_cost"]:
        lines.append(f"| {r['layer']} | {r['patch_tokens']} | {r['chunk_size']} | {r['all_blocks_gmacs']:.4f} | "
                     f"{r['diagonal_gmacs']:.4f} | {r['ratio']:.0f}× |")
    pruned = [r for r in f["scoring_cost"] if r["layer"] in f["prune_layers"]]
    tot_all = sum(r["all_blocks_gmacs"] for r in pruned)
    tot_diag = sum(r["diagonal_gmacs"] for r in pruned)
    lines += ["", f"- At BSPF-DeiT-S's pruning layers {f['prune_layers']}, scoring every block costs {tot_all:.4f} GMACs "
              f"(the QKᵀ entries plus the 3×3 convolution) against {tot_diag:.4f} for the diagonal blocks. The ratio is "
              "the chunk count C = N_p/Ω, so it grows with the token count: O(N²) against O(N·Ω).",
              "- Verdict: objection 3 is **upheld for the all-blocks reading** (O(N²)). vitexp scores only the "
              "diagonal blocks, which chunk attention computes anyway, so its scoring is O(N·Ω).", ""]
    lines += ["## (d) What the +2.0 is measured against", "",
              "| DeiT-S model | vitexp GMACs | paper GMACs | vitexp top-1 | paper top-1 |", "|---|---|---|---|---|"]
    for key, label in (("deit_small", "full attention"), ("chunk", "chunk attention only"), ("bspf", "BSPF-ViT, ρ = 0.5")):
        top = f"{t[key]:.1f}" if t[key] is not None else "not run"
        lines.append(f"| {label} | {g[key]:.3f} | {PAPER[key][1]} | {top} | {PAPER[key][0]} |")
    lines += ["", f"- Chunk attention alone removes {g['deit_small'] - g['chunk']:.3f} of DeiT-S's {g['deit_small']:.3f} GMACs "
              f"(to {g['chunk']:.3f}); the paper's chunk-only row says 2.4. Only pruning reaches it "
              f"(vitexp's BSPF: {g['bspf']:.3f}).",
              "- By the paper's own numbers, BSPF gains +2.0 over full-attention DeiT-S and +0.4 over its chunk-attention "
              "model (81.8 − 81.4)."]
    if all(t[k] is not None for k in t):
        lines.append(f"- vitexp's ImageNet runs: BSPF − full = {t['bspf'] - t['deit_small']:+.1f}, "
                     f"BSPF − chunk-only = {t['bspf'] - t['chunk']:+.1f}.")
    else:
        lines.append("- vitexp's accuracy deltas: not run (the three DeiT-S rows need ImageNet training: "
                     "`vitexp-sweep bspf_table8 --kind train ...`).")
    lines += ["- Verdict: objection 4 is **upheld**: most of the +2.0 is the chunk-attention model's (+1.6 by the "
              "paper's numbers); the paper's chunk-only GMACs cannot be a chunk-only cost.", ""]
    return "\n".join(lines)


def summary(findings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ledger entry's metrics and protocol for these findings."""
    metrics = {f"{scale}_{k}": v for scale in ("micro", "deit_small") for k, v in findings[scale].items()}
    metrics.update({f"gmacs_{k}": v for k, v in findings["gmacs"].items()})
    return metrics, {"unit": "GMACs", "resolution": 224, "counter": "vitexp.flops"}
