"""Token source maps (vitexp/analysis/tokens.py) from the decisions the token methods record
(vitexp/methods/token_record.py), and ``vitexp-analyze tokens``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import ledger_entries

import vitexp  # noqa: F401
from vitexp.analysis.tokens import (
    LayerMap,
    chunk_count,
    first_order,
    patch_chunks,
    record_decisions,
    source_maps,
)
from vitexp.methods.bspf.pruning import TokenPruner
from vitexp.methods.evit.fuse import fuse_decision, prune_and_fuse
from vitexp.methods.token_record import recording_modules
from vitexp.methods.tome.merge import match, merge_decision, merge_fn


def check_map(m: LayerMap, chunk_of_patch: torch.Tensor | None = None) -> None:
    """Every patch is in exactly one state (kept, fused, dropped); a kept patch anchors its own
    token and no token has two anchors; every output token holds a patch; with chunks, a patch's
    token is in the patch's chunk."""
    assert ((m.token >= -1) & (m.token < m.tokens_out)).all()
    states = m.kept.int() + m.fused.int() + m.dropped.int()
    assert (states == 1).all() and not (m.kept & m.dropped).any()
    for b in range(m.token.shape[0]):
        anchors = torch.bincount(m.token[b][m.kept[b]], minlength=m.tokens_out)
        assert anchors.max() <= 1
        held = set(m.token[b][m.token[b] >= 0].tolist())
        assert held == set(range(m.tokens_out)), (
            f"block {m.block}: tokens {set(range(m.tokens_out)) - held} hold no patch"
        )
    if chunk_of_patch is not None:
        alive = m.token >= 0
        per = max(1, m.tokens_out // m.chunks)  # the chunk of the token each patch went into
        assert (m.token[alive] // per == chunk_of_patch.expand_as(m.token)[alive]).all()


# -- BSPF-ViT on a constructed input whose decisions are known ------------------------------------


def _blocks(keep_pairs):
    """(1, C, Ω, Ω) attention blocks with ones at the given entries (score=single scores A itself)."""
    C, L = len(keep_pairs), 1 + max(max(max(e) for e in entries) for entries in keep_pairs)
    blocks = torch.zeros(1, C, L, L)
    for c, entries in enumerate(keep_pairs):
        for i, j in entries:
            blocks[0, c, i, j] = 1.0
    return blocks


def _tokens(vectors):
    """(1, 1 + M, 8): a prefix token, then the given basis vectors as patch tokens."""
    eye = torch.eye(8)
    return torch.cat([torch.ones(1, 8), eye[vectors]]).unsqueeze(0)


# Layer A: 2 chunks of 4 tokens, keep 2 each. Chunk 0 keeps 0 and 2 (token 1 fuses into 0, 3 into 2);
# chunk 1 keeps 1 and 3 (0 into 1, 2 into 3). The top-8 entries give those tokens 6 of the 8 row+column
# counts; a pruned token's mask row is at Hamming distance 2 from both kept tokens', so the
# cosine decides, and each pruned token is a copy of its partner.
LAYER_A = [
    [(0, 0), (0, 2), (2, 0), (2, 2), (1, 0), (0, 1), (3, 2), (2, 3)],
    [(1, 1), (1, 3), (3, 1), (3, 3), (0, 1), (1, 0), (2, 3), (3, 2)],
]
X_A = [0, 0, 1, 1, 2, 2, 3, 3]
# Layer B: 2 chunks of 2 tokens, keep 1 each: chunk 0 keeps its first, chunk 1 its second; the other
# has the same mask row and features, so it fuses.
LAYER_B = [[(0, 0), (1, 0)], [(1, 1), (0, 1)]]
X_B = [0, 0, 2, 2]


@pytest.mark.parametrize(
    "fusion, after_a, after_b",
    [
        ("similarity", [0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 0, 0, 1, 1, 1, 1]),
        ("none", [0, -1, 1, -1, -1, 2, -1, 3], [0, -1, -1, -1, -1, -1, -1, 1]),
        # Table 8's ablations merge too: cosine alone picks each copy's partner; Hamming alone ties at
        # distance 2 in layer A, and the tie goes to the chunk's first kept token
        ("cosine", [0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 0, 0, 1, 1, 1, 1]),
        ("hamming", [0, 0, 1, 0, 2, 2, 2, 3], [0, 0, 0, 0, 1, 1, 1, 1]),
    ],
)
def test_bspf_source_maps_on_known_decisions(fusion, after_a, after_b):
    pruners = [TokenPruner(0.5, 1, 2, "single", "none", fusion).eval() for _ in range(2)]
    for p in pruners:
        p.record_decisions = True
    with torch.no_grad():
        out = pruners[0](_tokens(X_A), _blocks(LAYER_A))
        pruners[1](_tokens(X_B), _blocks(LAYER_B))
    assert out.shape[1] == 1 + 4
    maps = source_maps([(1, pruners[0].decision), (3, pruners[1].decision)], 8)
    assert maps[0].token[0].tolist() == after_a and maps[1].token[0].tolist() == after_b
    assert maps[0].kept[0].tolist() == [True, False, True, False, False, True, False, True]
    assert maps[1].kept[0].tolist() == [True] + [False] * 6 + [True]
    chunks = patch_chunks(8, 2, None)
    assert chunks.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    if fusion != "none":
        for m in maps:
            check_map(m, chunks)


def test_dropping_a_layer_is_refused():
    pruners = [TokenPruner(0.5, 1, 2, "single", "none", "similarity").eval() for _ in range(2)]
    for p in pruners:
        p.record_decisions = True
    with torch.no_grad():
        pruners[0](_tokens(X_A), _blocks(LAYER_A))
        pruners[1](_tokens(X_B), _blocks(LAYER_B))
    with pytest.raises(ValueError, match="decision is missing"):
        source_maps([(3, pruners[1].decision)], 8)


# -- EViT and ToMe on constructed inputs ------------------------------------------------------------


def test_evit_decision_is_where_prune_and_fuse_puts_each_token():
    """CLS attention [.1, .4, .2, .3], keep 2: tokens 1 and 3 kept (slots 0, 1), 0 and 2 fused (slot 2);
    the same read off prune_and_fuse applied to one-hot features."""
    attn = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
    d = fuse_decision(attn, 2)
    assert d.target.tolist() == [[2, 0, 2, 1]] and d.kept.tolist() == [[False, True, False, True]]
    assert d.tokens_out == 3
    onehot = prune_and_fuse(torch.cat([torch.zeros(1, 1, 4), torch.eye(4)[None]], 1), attn, 2, 1)[:, 1:]
    assert (onehot != 0).float().argmax(
        1
    ).tolist() == d.target.tolist()  # the output token holding each input
    assert fuse_decision(attn, 2, fuse=False).target.tolist() == [[-1, 0, -1, 1]]


def test_tome_decision_is_where_the_merge_puts_each_token():
    """Tokens (after CLS) e0 e1 e2 e0 e1 e3: A = positions 1, 3, 5, B = 0, 2, 4. With r = 2, the A
    tokens at 1 and 3 merge into their copies at 4 and 0; 5 stays. Output: [5, 0+3, 2, 4+1]."""
    eye = torch.eye(5)
    metric = torch.stack([eye[4]] + [eye[i] for i in (0, 1, 2, 0, 1, 3)])[None]
    matching = match(metric, 2, num_prefix=1)
    d = merge_decision(matching, 6)
    assert d.target.tolist() == [[1, 3, 2, 1, 3, 0]] and d.tokens_out == 4
    assert d.kept.tolist() == [[True, False, True, False, True, True]]
    onehot = merge_fn(matching, 1)(torch.cat([torch.zeros(1, 1, 6), torch.eye(6)[None]], 1))[:, 1:]
    assert onehot.argmax(1).tolist() == d.target.tolist()


# -- the methods' own models ---------------------------------------------------------------------------


@pytest.mark.parametrize("experiment", ["bspf_demo", "evit_demo", "tome_demo"])
def test_token_maps_of_the_patched_micro_vit_account_for_every_patch(experiment):
    from vitexp.config.composition import compose
    from vitexp.training.build import build_model

    cfg = compose([f"experiment={experiment}"])
    torch.manual_seed(0)
    model, _, _ = build_model(cfg)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        reference = model.eval()(x)
        decisions = record_decisions(model, x)
        assert torch.equal(model(x), reference)  # recording changes nothing
    modules = recording_modules(model)
    assert modules and all(not m.record_decisions and m.decision is None for m in modules)
    order = first_order(model)
    maps = source_maps(decisions, 64, order)
    blocks = {"bspf_demo": [1, 3], "evit_demo": [1, 3, 4], "tome_demo": [0, 1, 2, 3, 4, 5]}[experiment]
    assert [m.block for m in maps] == blocks
    chunks = patch_chunks(64, chunk_count(model), order) if experiment == "bspf_demo" else None
    if chunks is not None:
        assert chunk_count(model) == 4 and torch.bincount(chunks).tolist() == [16] * 4
    for m in maps:
        check_map(m, chunks)
    if experiment == "tome_demo":  # ToMe's own token sizes: the patches each final token stands for
        size = model.blocks[0].tome.size[:, 1:, 0]
        counts = torch.stack([torch.bincount(t, minlength=maps[-1].tokens_out) for t in maps[-1].token])
        assert torch.equal(counts.float(), size)


# -- the command ---------------------------------------------------------------------------------------


def _image_folder(root: Path) -> None:
    from PIL import Image

    for split in ("train", "val"):
        for label in ("a", "b"):
            (root / split / label).mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (40, 40), (60 * i, 120, 200)).save(root / split / label / f"{i}.png")


@pytest.mark.parametrize("case", ["tome_digits", "evit_imagefolder", "bspf_fashion_mnist"])
def test_analyze_tokens_writes_a_png_per_image_and_records_them(case, results_dir, tmp_path, capsys):
    from vitexp.commands.cli import analyze_main
    from vitexp.ledger import local_path

    overrides = {
        "tome_digits": ["experiment=tome_demo"],
        "evit_imagefolder": [
            "experiment=evit_demo",
            "data=imagefolder",
            f"data.root={tmp_path / 'images'}",
            "data.num_classes=2",
            "data.num_workers=0",
        ],
        "bspf_fashion_mnist": ["experiment=fmnist_bspf_vit_micro", "backbone.pretrained=null"],
    }[case]
    if case == "evit_imagefolder":
        _image_folder(tmp_path / "images")
    if (
        case == "bspf_fashion_mnist"
        and not Path("/usr/share/datasets/fashion-mnist").is_dir()
        and not os.environ.get("VITEXP_REQUIRE_FASHION_MNIST")
    ):  # .ci/run: run, and fail, without it
        pytest.skip("dataset-fashion-mnist is not installed")
    analyze_main(["tokens", *overrides, "logger=none", "--images", "2"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["status"] == "completed"
    (entry,) = ledger_entries(results_dir)
    assert entry["kind"] == "analyze" and len(entry["figures"]) == 2
    for figure in entry["figures"]:
        assert open(local_path(figure, results_dir), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert entry["layers"] and all(
        layer["kept"] + layer["fused"] + layer["dropped"] == 64 for layer in entry["layers"]
    )


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["experiment=demo"], "valid methods"),
        (["experiment=bspf_demo", "backbone=caformer_micro"], "use a ViT backbone"),
    ],
)
def test_analyze_tokens_refuses_what_it_cannot_draw(overrides, says, results_dir, capsys):
    from vitexp.commands.cli import analyze_main

    with pytest.raises(SystemExit) as exit_info:
        analyze_main(["tokens", *overrides, "logger=none"])
    assert exit_info.value.code == 2
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["status"] == "invalid" and says in out["error"] and not ledger_entries(results_dir)
