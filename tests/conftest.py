"""Shared fixtures: every test writes its ledger and outputs under a temporary folder."""

from __future__ import annotations

import itertools
import json
import os
import socket
from pathlib import Path

# Before torch is imported (vitexp imports it): the micro models' small matrices run faster on one
# thread than on two that wait on each other; the subprocesses the tests start inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
from omegaconf import open_dict  # noqa: E402
from slurm_cluster import slurm_cluster  # noqa: E402,F401  (the two-node SLURM of the slurm tests)

import vitexp.config.composition as vconfig  # noqa: E402

#: Overrides that keep a test run small and quiet (no logger, no progress bar).
QUIET = ["logger=none", "trainer.enable_progress_bar=false"]
#: A training run of a few seconds: the demo on 32 synthetic images, one epoch, no costs measured.
TINY_TRAIN = [
    "experiment=demo",
    "data=synthetic",
    "data.num_train=32",
    "data.num_val=16",
    "data.num_test=16",
    "recipe.batch_size=16",
    "recipe.epochs=1",
    "recipe.warmup_epochs=0",
    "eval.throughput=false",
    "eval.flops=false",
]


#: The backbone every method runs on in the default suite, and the methods every backbone runs under.
PAIRWISE_BACKBONE = "vit_micro"
PAIRWISE_METHODS = ("baseline", "bspf")


def pairwise(backbones, methods) -> list:
    """A backbone x method matrix, split: every method on :data:`PAIRWISE_BACKBONE` and every backbone
    under :data:`PAIRWISE_METHODS` run in the default suite; the rest of the cross product is marked
    ``slow`` (``pytest -m slow``, and CI's full-matrix step when methods or backbones change)."""
    assert PAIRWISE_BACKBONE in backbones and set(PAIRWISE_METHODS) <= set(methods)
    return [
        pytest.param(b, m, marks=() if b == PAIRWISE_BACKBONE or m in PAIRWISE_METHODS else pytest.mark.slow)
        for b in backbones
        for m in methods
    ]


@pytest.fixture(autouse=True)
def _isolated_results(tmp_path, monkeypatch):
    monkeypatch.setenv("VITEXP_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    yield


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """Each test gets back the SIGINT and SIGTERM handlers it started with. Lightning answers a
    KeyboardInterrupt outside a vitexp run (a bare ``Trainer.fit``) by setting SIGINT to ``SIG_IGN`` and
    leaves it so; an ignored SIGINT would then reach later tests of the same worker and, inherited
    across ``exec``, the subprocesses they start (tests/test_run.py's signal tests fail that way)."""
    import signal

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    if before[signal.SIGINT] in (
        signal.SIG_IGN,
        None,
    ):  # ignored before this test began: Python's default back
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    for s, handler in before.items():
        if handler is not None and signal.getsignal(s) is not handler:
            signal.signal(s, handler)


@pytest.fixture
def results_dir(tmp_path) -> Path:
    return tmp_path / "results"


@pytest.fixture
def make_cfg(tmp_path):
    """Compose the real config tree with overrides; output_dir is a temporary folder."""

    def _make(overrides=(), output_dir: str | Path | None = None):
        cfg = vconfig.compose(list(overrides))
        with open_dict(cfg):
            cfg.output_dir = str(output_dir or tmp_path / "run")
        return cfg

    return _make


@pytest.fixture(scope="session")
def _trained_once(tmp_path_factory):
    """overrides -> (folder, result) of one training run per configuration in this session (per xdist
    worker): ``<folder>/results`` holds its ledger entry and ``<folder>/<run>`` its run folder."""
    from vitexp.commands.train import train

    done: dict[tuple[str, ...], tuple[Path, dict]] = {}

    def get(overrides: tuple[str, ...], run: str) -> tuple[Path, dict]:
        key = (*overrides, run)
        if key not in done:
            folder = tmp_path_factory.mktemp("trained")
            saved = {k: os.environ.get(k) for k in ("VITEXP_RESULTS", "WANDB_DIR")}
            os.environ.update(VITEXP_RESULTS=str(folder / "results"), WANDB_DIR=str(folder / "wandb"))
            try:
                cfg = vconfig.compose(list(overrides))
                with open_dict(cfg):
                    cfg.output_dir = str(folder / run)
                done[key] = (folder, train(cfg))
            finally:
                for k, v in saved.items():
                    os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        return done[key]

    return get


@pytest.fixture
def trained_run(_trained_once, tmp_path):
    """A run trained once per session for its overrides, copied into this test's folders: its ledger
    entry into ``tmp_path/results`` and its run folder into ``tmp_path/<run>`` (the entry's paths are
    relative to the results folder, so they hold in the copy). For tests that read a trained run, or
    change their own copy of it; returns the run's result (``metrics``, ``run_id``, ...)."""
    import copy
    import shutil

    def get(overrides, run: str = "run") -> dict:
        folder, result = _trained_once(tuple(overrides), run)
        shutil.copytree(folder / "results", tmp_path / "results", dirs_exist_ok=True)
        shutil.copytree(folder / run, tmp_path / run)
        return copy.deepcopy(result)

    return get


def recorded(spec: dict | None, runs: list[dict], start: str = "2026-01-01T00:00:00+00:00") -> list[dict]:
    """Stub records as vitexp records a run (the ledger matches a row's runs by their config and
    orders them by ``started``): each gets a ``started``, one second apart in the given order, unless
    it has one; one named like a row of ``spec`` that composes (the row's name, or
    ``<name>+seed=<s>``) gets that row's composed config for its seed, its own config keys on top."""
    import copy
    import datetime as dt
    import re

    from vitexp.config import rows as vrows
    from vitexp.ledger import portable_paths

    queries = {}
    if spec is not None:
        for row in vrows.expand_rows(spec["rows"]):
            if row.get("experiment") and not row.get("cited"):
                queries.setdefault(vrows.row_name(row), vrows.row_query(spec, row))
    first = dt.datetime.fromisoformat(start)
    out = []
    for i, run in enumerate(runs):
        run = copy.deepcopy(run)
        run.setdefault("started", (first + dt.timedelta(seconds=i)).isoformat())
        name = run["experiment"]
        match = re.fullmatch(r"(.*)\+seed=(\d+)", name)
        query = queries.get(name) or (queries.get(match.group(1)) if match else None)
        if query is not None:
            seed = (run.get("config") or {}).get("seed", int(match.group(2)) if match else None)
            with vrows.composing():
                config = query.composed(seed if query.seeds is not None else None)
            if config is not None:  # its paths as an entry stores them (vitexp.ledger.portable_paths)
                run["config"] = portable_paths(_merged(copy.deepcopy(dict(config)), run.get("config") or {}))
        out.append(run)
    return out


def config_of(name: str, seed: int | None = None, top: dict | None = None) -> dict:
    """The config a run of ``name`` records: its experiment (the name before ``+``) composed with
    ``seed`` (``None``: the experiment's own), ``top`` on top; for a name with no experiment file,
    :func:`run_config` of ``seed`` and ``top`` (a stub, matched by name)."""
    import copy

    from vitexp import CONF_DIR
    from vitexp.config.rows import composed_config, composing

    base = name.split("+", 1)[0]
    config: dict = run_config(seed)
    if (CONF_DIR / "experiment" / f"{base}.yaml").is_file():
        with composing():
            config = copy.deepcopy(composed_config((f"experiment={base}",), seed))
    return _merged(config, top or {})


def run_config(seed: int | None = None, top: dict | None = None) -> dict:
    """A minimal full run config, what a train entry's config must be: every group a run composes
    (:data:`vitexp.ledger.schema.RUN_GROUPS`), each an empty object here, with ``seed`` and ``top``."""
    from vitexp.ledger.schema import RUN_GROUPS

    return _merged({"seed": seed, **{group: {} for group in RUN_GROUPS}}, top or {})


def _merged(base: dict, top: dict) -> dict:
    for k, v in top.items():
        base[k] = (
            _merged(base.get(k) if isinstance(base.get(k), dict) else {}, v) if isinstance(v, dict) else v
        )
    return base


def ledger_entries(results_dir: Path) -> list[dict]:
    """The entries under ``results_dir/runs``, read as the ledger reads them: hidden files are
    atomic_write's temporary files (a requeued job's killed attempt can orphan an empty one)."""
    runs = results_dir / "runs"
    return (
        [json.loads(p.read_text()) for p in sorted(runs.glob("*.json")) if not p.name.startswith(".")]
        if runs.exists()
        else []
    )


_PORTS = itertools.count()


def free_port() -> int:
    """A port for one process group (DDP's ``MASTER_PORT``), never one another xdist worker of this
    session hands out: worker ``gwN`` draws from its own block of 500, in turn, skipping ports in use."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    block = 20000 + 500 * int(worker[2:] or 0) if worker.startswith("gw") else 20000
    for _ in range(500):
        port = block + next(_PORTS) % 500
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {block}..{block + 499}")


def cli_env(results_dir: Path) -> dict[str, str]:
    """The environment of a vitexp command run as a subprocess: its results under ``results_dir``, W&B
    offline, and a process-group port of this worker's own (:func:`free_port`)."""
    env = dict(os.environ)
    env["VITEXP_RESULTS"] = str(results_dir)
    env["WANDB_MODE"] = "offline"
    env["PYTHONUNBUFFERED"] = "1"
    env["MASTER_PORT"] = str(free_port())
    return env


def vit_analytic_macs(
    *,
    img_size: int,
    patch_size: int,
    embed_dim: int,
    depth: int,
    mlp_ratio: float,
    num_classes: int,
    in_chans: int = 3,
    num_prefix_tokens: int = 1,
) -> int:
    """Closed-form MACs of a DeiT-layout ViT under vitexp's protocol (the reference the counter is
    checked against).

    Patch embedding P·(c·p²)·D; per block, with N = P + prefix tokens: qkv 3·N·D², attention
    Q·Kᵀ and A·V 2·N²·D, output projection N·D², MLP 2·N·D·(r·D); classifier D·C."""
    patches = (img_size // patch_size) ** 2
    n, d = patches + num_prefix_tokens, embed_dim
    hidden = int(mlp_ratio * d)
    per_block = 3 * n * d * d + 2 * n * n * d + n * d * d + 2 * n * d * hidden
    return patches * in_chans * patch_size**2 * d + depth * per_block + d * num_classes
