"""The data loader measured (issue 43): ImageNet-like JPEGs, the tensor decoding path normalised on the
device, images/s per worker in CPU time, and vitexp-bench bench.mode=loader recording both decoders."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import cli_env, ledger_entries

from vitexp.data.imagenet_like import JpegSpec, ensure_jpegs
from vitexp.data.loader_bench import cpu_rate, winner
from vitexp.data.tensor_images import DeviceNormalize, randaugment_options, tensor_transform
from vitexp.errors import ConfigError

SMALL = JpegSpec(classes=2, train_per_class=3, width=200, height=150, target_kb=20.0)
DATA_CONFIG = {
    "input_size": (3, 64, 64),
    "interpolation": "bicubic",
    "mean": (0.485, 0.456, 0.406),
    "std": (0.229, 0.224, 0.225),
    "crop_pct": 0.875,
}


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    return ensure_jpegs(SMALL, tmp_path_factory.mktemp("jpegs") / "small")


def test_generated_jpegs_reach_their_target_size_and_are_reused(jpegs, tmp_path):
    """The grain is set so the mean file size reaches the target (decode time follows file size); the
    val folder links to train; a folder whose manifest names the same parameters is not generated again."""
    from pathlib import Path

    root = Path(jpegs["root"])
    files = sorted((root / "train").rglob("*.JPEG"))
    assert len(files) == jpegs["images"] == 6 and (root / "val").resolve() == (root / "train").resolve()
    assert jpegs["mean_kb"] == pytest.approx(SMALL.target_kb, rel=0.2)
    assert sum(f.stat().st_size for f in files) / len(files) / 1e3 == pytest.approx(jpegs["mean_kb"])
    stamp = files[0].stat().st_mtime_ns
    again = ensure_jpegs(SMALL, root)
    assert again["mean_kb"] == jpegs["mean_kb"] and files[0].stat().st_mtime_ns == stamp


def test_cpu_rate_counts_each_workers_batches_after_its_first():
    # (worker, its CPU clock when it finished the batch, images): worker 0 makes 8 more images in 1.0 s of
    # CPU,
    # worker 1 makes 4 more in 0.2 s; their first batches only start the clocks
    stamps = [(0, 1.0, 4), (1, 2.0, 4), (0, 1.5, 4), (1, 2.2, 4), (0, 2.0, 4)]
    assert cpu_rate(stamps) == (12, pytest.approx(1.2), 2)


def test_a_decoder_wins_only_beyond_the_spread_of_its_rounds():
    assert winner({"pil": {"min": 90, "max": 110}, "tensor": {"min": 111, "max": 130}}) == "tensor"
    assert winner({"pil": {"min": 90, "max": 112}, "tensor": {"min": 111, "max": 130}}) is None


def _bench(run_id: str, pil: float, tensor: float) -> dict:
    return {
        "run_id": run_id,
        "kind": "bench",
        "status": "completed",
        "metrics": {"pil_images_per_s_per_worker": pil, "tensor_images_per_s_per_worker": tensor},
        "protocol": {
            "mode": "loader",
            "split": "train",
            "img_size": 224,
            "auto_augment": "rand-m9-mstd0.5-inc1",
            "random_erase": 0.25,
            "decoders": ["pil", "tensor"],
        },
    }


def test_a_decoder_wins_over_repeated_runs_only_beyond_their_spread():
    from vitexp.cost.loader import decoder_verdicts

    key = ("train", 224, "rand-m9-mstd0.5-inc1", 0.25)
    assert decoder_verdicts([_bench("a", 100, 130)])[key]["winner"] is None  # one run: no spread to beat
    assert decoder_verdicts([_bench("a", 100, 130), _bench("b", 110, 125)])[key]["winner"] == "tensor"
    overlapping = decoder_verdicts([_bench("a", 100, 130), _bench("b", 126, 125)])[key]
    assert overlapping["winner"] is None and overlapping["medians"] == {
        "pil": [100, 126],
        "tensor": [130, 125],
    }


def test_the_default_decoder_is_the_measured_winner():
    """data.decoder's default is the decoder that won DeiT's training loader over repeated runs in the
    committed ledger (pil when neither won)."""
    from pathlib import Path

    import yaml

    from vitexp.cost.loader import decoder_verdicts, loader_runs
    from vitexp.ledger import Ledger

    root = Path(__file__).resolve().parent.parent
    verdict = decoder_verdicts(loader_runs(Ledger.load(root / "results"))).get(
        ("train", 224, "rand-m9-mstd0.5-inc1", 0.25)
    )
    assert verdict is not None and len(verdict["runs"]) >= 2
    for name in ("imagenet", "imagefolder"):
        assert yaml.safe_load((root / "conf" / "data" / f"{name}.yaml").read_text())["decoder"] == (
            verdict["winner"] or "pil"
        )


def test_a_run_that_read_its_jpegs_with_pil_before_the_decoder_option_is_not_a_tensor_decoder_run():
    from vitexp.ledger import fingerprint as fp

    before = {"method": {"name": "baseline"}, "data": {"name": "imagenet", "root": "/x"}}
    today = {"method": {"name": "baseline"}, "data": {"name": "imagenet", "root": "/x", "decoder": "tensor"}}
    assert fp.differences(before, today) == ["data.decoder"]
    assert fp.differences(before, {**today, "data": {**today["data"], "decoder": "pil"}}) == []
    cifar = {"method": {"name": "baseline"}, "data": {"name": "cifar100"}}
    assert fp.differences(cifar, {**cifar, "data": {**cifar["data"], "decoder": "tensor"}}) == [
        "data.decoder"
    ]  # no default: a key it lacks separates it


def test_device_normalize_is_torchvisions_normalize_and_erases_only_in_training():
    from torchvision.transforms import v2

    x = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    norm = DeviceNormalize(DATA_CONFIG["mean"], DATA_CONFIG["std"], random_erase=1.0)
    expected = v2.Normalize(list(DATA_CONFIG["mean"]), list(DATA_CONFIG["std"]))(x.float() / 255)
    assert torch.allclose(norm(x), expected, atol=1e-5)
    torch.manual_seed(0)
    erased = norm(x, train=True)
    assert not torch.allclose(erased, expected, atol=1e-5)  # probability 1: every image has a region set to 0
    assert ((erased == 0).flatten(1).any(dim=1)).all()
    assert norm(expected) is expected  # a batch normalised by its workers passes through


def test_the_tensor_path_crops_uint8_and_reads_timms_randaugment_string():
    assert randaugment_options("rand-m9-mstd0.5-inc1") == {"num_ops": 2, "magnitude": 9}
    assert randaugment_options("rand-m7-n3") == {"num_ops": 3, "magnitude": 7}
    with pytest.raises(ConfigError, match="data.decoder=pil"):
        randaugment_options("augmix-m5-w4")
    image = torch.randint(0, 256, (3, 150, 200), dtype=torch.uint8)
    out = tensor_transform({**DATA_CONFIG, "input_size": (3, 64, 64)}, True, "rand-m9-mstd0.5-inc1")(image)
    assert out.dtype == torch.uint8 and out.shape == (3, 64, 64)
    out = tensor_transform(DATA_CONFIG, False)(image)
    assert out.dtype == torch.uint8 and out.shape == (3, 64, 64)


def test_an_imagefolder_with_the_tensor_decoder_normalises_its_training_batches_on_the_device(jpegs):
    from vitexp.data.datamodules import ImageFolderDataModule

    def module(decoder):
        dm = ImageFolderDataModule(
            jpegs["root"],
            num_classes=2,
            batch_size=3,
            num_workers=0,
            decoder=decoder,
            auto_augment="rand-m9-mstd0.5-inc1",
            random_erase=0.0,
            data_config=DATA_CONFIG,
        )
        dm.setup("fit")
        return dm

    tensor, pil = module("tensor"), module("pil")
    x, y = next(iter(tensor.train_dataloader()))
    assert x.dtype == torch.uint8 and x.shape == (3, 3, 64, 64)
    z, _ = tensor.on_after_batch_transfer([x, y], 0)
    assert z.dtype == torch.float32 and torch.allclose(z, tensor.device_normalize(x))
    assert next(iter(tensor.val_dataloader()))[0].dtype == torch.float32  # read outside Lightning's hooks too
    assert next(iter(tensor.train_eval_dataloader()))[0].dtype == torch.float32
    # the same image through both decoders' evaluation transforms: the same crop, within resampling error
    a, b = tensor.train_eval_set[0][0], pil.train_eval_set[0][0]
    assert a.shape == b.shape == (3, 64, 64) and (a - b).abs().mean() < 0.1
    assert pil.on_after_batch_transfer([x, y], 0)[0] is x  # the PIL path has nothing to do there
    with pytest.raises(ValueError, match=r"data.decoder='nope': valid decoders are \('pil', 'tensor'\)"):
        ImageFolderDataModule(jpegs["root"], decoder="nope")


@pytest.mark.slow
def test_a_run_trains_on_the_tensor_decoders_device_normalised_batches(
    jpegs, make_cfg, results_dir, tmp_path
):
    """A uint8 batch reaching the model would fail its first convolution: the run completing is the
    device-side normalisation at work, under Lightning (the datamodule's on_after_batch_transfer)."""
    from vitexp.commands.train import train

    cfg = make_cfg(
        [
            "logger=none",
            "trainer.enable_progress_bar=false",
            "data=imagefolder",
            f"data.root={jpegs['root']}",
            "data.num_classes=2",
            "data.num_workers=0",
            "data.decoder=tensor",
            "recipe=deit_scratch",
            "recipe.epochs=1",
            "recipe.warmup_epochs=0",
            "recipe.batch_size=2",
            "eval.throughput_batch=2",
            "eval.throughput_iters=1",
        ],
        tmp_path / "run",
    )
    metrics = train(cfg)["metrics"]
    assert metrics["steps"] == 3 and 0 <= metrics["top1"] <= 100
    assert ledger_entries(results_dir)[0]["config"]["data"]["decoder"] == "tensor"


@pytest.mark.slow
def test_vitexp_bench_loader_records_images_per_second_per_worker_for_each_decoder(
    jpegs, results_dir, tmp_path
):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "vitexp.commands.cli",
            "bench",
            "bench.mode=loader",
            "experiment=deit_tiny_baseline",
            "logger=none",
            "data.num_classes=2",
            f"bench.loader.root={jpegs['root']}",
            "recipe.batch_size=2",
            "bench.rounds=2",
            "bench.loader.batches=1",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=cli_env(results_dir),
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    closing = json.loads(out.stdout.strip().splitlines()[-1])
    (entry,) = ledger_entries(results_dir)
    assert (
        entry["kind"] == "bench"
        and entry["protocol"]["mode"] == "loader"
        and entry["run_id"] == closing["run_id"]
    )
    m, p = entry["metrics"], entry["protocol"]
    for decoder in ("pil", "tensor"):
        assert m[f"{decoder}_images_per_s_per_worker"] > 0 and m[f"{decoder}_min"] <= m[f"{decoder}_max"]
        assert len(p["rounds_per_decoder"][decoder]) == 2
    assert p["split"] == "train" and p["img_size"] == 224 and p["auto_augment"] == "rand-m9-mstd0.5-inc1"
    assert p["random_erase"] == 0.25 and "RandAugment" in p["transforms"]["tensor"] and p["workers"] == 1
    assert "images/s per worker" in out.stdout
