"""vitexp's cluster path on a real scheduler: the one-node SLURM of scripts/local_slurm.sh
(tests/slurm_cluster.py), every command of docs/cluster.md run as written (tests/doc_commands.py).

Marker ``slurm`` (``pytest -m slurm``; CI runs it with VITEXP_REQUIRE_SLURM=1): a table swept through
``hydra/launcher=slurm``, preemption through both requeue paths (the sbatch template's SIGUSR1 and
submitit's SIGUSR2), DDP started by ``srun``, the sbatch template submitted as written.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ledger_entries
from doc_commands import run_doc
from slurm_cluster import ROOT
from test_ddp import FROZEN_CLASSIFIER, assert_same_bank

pytestmark = pytest.mark.slurm

TEMPLATE = ROOT / "scripts" / "slurm" / "vitexp.sbatch"
#: A run of three short epochs on synthetic images, no FLOPs or timing (the preemption tests).
SMALL = [
    "data=synthetic",
    "data.num_train=64",
    "data.num_val=16",
    "data.num_test=32",
    "recipe.batch_size=16",
    "recipe.epochs=3",
    "recipe.warmup_epochs=0",
    "logger=none",
    "trainer.enable_progress_bar=false",
    "eval.throughput=false",
    "eval.flops=false",
]
COMPARED = ("top1", "top5", "test_loss", "val_loss", "val_top1", "steps")


def sbatch(cluster, cwd: Path, results: Path, *args: str) -> str:
    """Submit the sbatch template as written, with sbatch options and vitexp overrides ``args``; the job
    id."""
    cwd.mkdir(parents=True, exist_ok=True)
    options = [a for a in args if a.startswith("--")]
    overrides = [a for a in args if not a.startswith("--")]
    done = subprocess.run(
        ["sbatch", "--parsable", *options, str(TEMPLATE), *overrides],
        env=cluster.env(results),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def wait_for(path_glob: str, cwd: Path, timeout: float = 300) -> Path:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = sorted(cwd.glob(path_glob))
        if found:
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"nothing matches {cwd}/{path_glob} after {timeout} s")


def one_completed_entry(results: Path) -> dict:
    (entry,) = ledger_entries(results)
    assert entry["status"] == "completed", entry.get("error")
    return entry


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, tmp_path_factory):
    """The metrics of :data:`SMALL` run through the template with no signal (submitted now, read on
    first use, so it runs beside the interrupted job)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    job = sbatch(slurm_cluster, folder, folder / "results", *SMALL)
    got: dict = {}

    def metrics() -> dict:
        if not got:
            info = slurm_cluster.wait(job)
            assert info["JobState"] == "COMPLETED", (folder / f"slurm-{job}.out").read_text()[-3000:]
            got.update(one_completed_entry(folder / "results")["metrics"])
        return got

    return metrics


def assert_requeued_once(entry: dict, signal: str, expected: dict) -> None:
    """One entry, completed, its first attempt interrupted by ``signal`` (never failed), the metrics
    of the uninterrupted run; the second attempt resumed from the first's checkpoint with at least one
    epoch done (``resumed_from``: a requeued job that trained again from scratch, same seed, would end
    with the same metrics)."""
    assert [a["status"] for a in entry["attempts"]] == ["interrupted"], entry["attempts"]
    assert entry["attempts"][0]["signal"] == signal
    for key in COMPARED:
        assert entry["metrics"][key] == pytest.approx(expected[key], rel=1e-6, abs=0), key
    assert entry["attempts"][0]["resumed_from"] is None  # the first attempt started fresh
    resumed = (entry["resumed_from"] or {}).get("main")
    assert resumed and resumed["checkpoint"] == f"{entry['output_dir']}/checkpoints/last.ckpt", entry[
        "resumed_from"
    ]
    assert 0 < resumed["epoch"] <= 3 and resumed["global_step"] == 4 * resumed["epoch"], (
        resumed
    )  # 64 images, batch 16


def test_the_guides_local_cluster_runs_jobs(slurm_cluster, tmp_path):
    """The guide's lines after ``start``: the ``export`` it printed points SLURM's commands at the
    cluster, whose one node is idle in partition ``local``."""
    env = slurm_cluster.env(tmp_path / "results")
    env.pop("SLURM_CONF")
    done = run_doc(
        "export SLURM_CONF=<folder>/slurm.conf",
        {"<folder>": str(slurm_cluster.folder)},
        env=env,
        then='srun --ntasks=1 hostname -s && scontrol show config | grep -i "^SLURM_CONF"',
    )
    assert done.returncode == 0, done.stderr
    assert str(slurm_cluster.conf) in done.stdout
    done = run_doc("sinfo", env=slurm_cluster.env(tmp_path / "results"))
    assert re.search(r"local\*\s+up\s+infinite\s+1\s+idle", done.stdout), done.stdout


def test_first_command_of_the_guide_sweeps_the_demo_and_builds_its_table(slurm_cluster, tmp_path):
    """The guide's first command as written: the demo table's rows queue as SLURM jobs (submitit,
    ``hydra/launcher=slurm``), run, and write their ledger entries; ``vitexp-tables`` builds the table
    from them; the same command again (how a sweep resumes) launches nothing."""
    results = tmp_path / "results"
    env = slurm_cluster.env(results)
    assert run_doc("sinfo", env=env).returncode == 0
    sweep = run_doc("vitexp-sweep demo hydra/launcher=slurm", env=env, cwd=tmp_path, background=True)
    seen = set()
    while sweep.poll() is None:
        queue = run_doc("squeue", env=env, timeout=60).stdout
        seen |= set(re.findall(r"\b(PD|R)\b", queue))
        time.sleep(1)
    out, err = sweep.communicate()
    assert sweep.returncode == 0, (out[-2000:], err[-3000:])
    assert "R" in seen, "no job was seen running in squeue"
    entries = ledger_entries(results)
    assert sorted((e["kind"], e["experiment"]) for e in entries) == [
        ("flops", "deit_small_baseline"),
        ("flops", "deit_tiny_baseline"),
        ("train", "demo"),
    ]
    assert all(e["status"] == "completed" for e in entries)
    assert len(list(tmp_path.glob("multirun/*/.submitit/*/*_log.out"))) >= 2  # one log per SLURM job
    demo = next(e for e in entries if e["experiment"] == "demo")
    tables = run_doc("vitexp-tables demo", env=env, cwd=tmp_path, timeout=300)
    assert tables.returncode == 0, tables.stderr[-2000:]
    table = (results / "tables" / "demo.md").read_text()
    assert f"{demo['metrics']['top1']:.1f}" in table and "not run" not in table.split("DeiT-T")[0]
    again = run_doc("vitexp-sweep demo hydra/launcher=slurm", env=env, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["launched"] == {}
    assert len(ledger_entries(results)) == 3


def test_sbatch_template_requeues_on_sigusr1_and_the_run_ends_as_an_uninterrupted_one(
    slurm_cluster, tmp_path, uninterrupted
):
    """Lightning's SLURM path: the template's ``--signal=B:USR1@120`` and ``--requeue``, the signal sent
    as the guide says once the first epoch's checkpoint exists: the job is requeued and resumes."""
    results = tmp_path / "results"
    job = sbatch(slurm_cluster, tmp_path, results, *SMALL)
    wait_for(f"outputs/*/slurm-{job}/checkpoints/last.ckpt", tmp_path)
    done = run_doc(
        "scancel --signal=USR1 --batch <job id>", {"<job id>": job}, env=slurm_cluster.env(results)
    )
    assert done.returncode == 0, done.stderr
    info = slurm_cluster.wait(job, restarts=1)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-3000:]
    entry = one_completed_entry(results)
    assert entry["attempts"][0].get("requeued") == f"scontrol requeue {job}"
    assert_requeued_once(entry, "SIGUSR1", uninterrupted())


def test_submitit_requeue_on_sigusr2_closes_the_attempt_interrupted(slurm_cluster, tmp_path, uninterrupted):
    """submitit's path (``hydra/launcher=slurm``): its SIGUSR2 handler checkpoints the job, runs
    ``scontrol requeue`` and exits; the attempt is recorded ``interrupted`` (SIGUSR2), not ``failed``,
    and the requeued job continues the same entry to the uninterrupted run's metrics."""
    results = tmp_path / "results"
    env = slurm_cluster.env(results)
    launcher = subprocess.Popen(
        ["vitexp-train", "-m", *SMALL, "hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path / 'multirun'}"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for("multirun/0_*/checkpoints/last.ckpt", tmp_path)
    job = wait_for("multirun/.submitit/[0-9]*", tmp_path).name
    done = run_doc("scancel --signal=USR2 <job id>", {"<job id>": job}, env=env)
    assert done.returncode == 0, done.stderr
    out, err = launcher.communicate(timeout=900)
    assert launcher.returncode == 0, (out[-2000:], err[-3000:])
    assert slurm_cluster.job(job).get("Restarts") == "1"
    entry = one_completed_entry(results)
    assert entry["attempts"][0].get("requeued") == "submitit: checkpoint and scontrol requeue"
    assert_requeued_once(entry, "SIGUSR2", uninterrupted())


def test_ddp_started_by_srun_equals_one_process_on_odd_splits(slurm_cluster, tmp_path):
    """``--ntasks-per-node=2``: srun starts both ranks and Lightning's SLURM environment joins them
    (gloo, CPU). On 7 test and 5 validation images a frozen classifier's top-1, top-5 and losses, and
    k-NN on a bank of 301 images, equal one process's, and so does the bank itself (its size, its images per
    label and the sum of its features, from the runs' protocol ``knn_bank``)."""
    odd = [
        "data=synthetic",
        "data.noise=1.5",
        "data.num_val=5",
        "data.num_test=7",
        "logger=none",
        "trainer.enable_progress_bar=false",
        "eval.flops=false",
        "eval.throughput=false",
    ]
    knn = [
        "backbone=dinov2_micro",
        "method=knn",
        "budget=none",
        "method.knn_features=cls_mean",
        "method.knn_k=50",
        "data.num_train=301",
        "recipe.batch_size=32",
    ]
    runs = {"classify": [*FROZEN_CLASSIFIER, "data.num_train=16"], "knn": knn}
    jobs = {}
    for what, model in runs.items():
        for tasks, trainer in ((2, "ddp_cpu"), (1, "cpu")):
            folder = tmp_path / f"{what}_{tasks}"
            jobs[what, tasks] = (
                folder,
                sbatch(
                    slurm_cluster,
                    folder,
                    folder / "results",
                    f"--ntasks-per-node={tasks}",
                    *odd,
                    *model,
                    f"trainer={trainer}",
                ),
            )
    metrics, protocol = {}, {}
    for key, (folder, job) in jobs.items():
        info = slurm_cluster.wait(job)
        assert info["JobState"] == "COMPLETED", (folder / f"slurm-{job}.out").read_text()[-3000:]
        entry = one_completed_entry(folder / "results")
        assert entry["metrics"]["world_size"] == key[1]
        metrics[key], protocol[key] = entry["metrics"], entry["protocol"]
    log = (jobs["classify", 2][0] / f"slurm-{jobs['classify', 2][1]}.out").read_text()
    assert "GLOBAL_RANK: 1" in log  # the second rank, started by srun, joined the group
    for key in ("top1", "top5", "val_top1"):
        assert metrics["classify", 2][key] == metrics["classify", 1][key], key
        assert metrics["knn", 2][key] == metrics["knn", 1][key], key
    for key in ("test_loss", "val_loss"):
        assert metrics["classify", 2][key] == pytest.approx(metrics["classify", 1][key], rel=1e-6, abs=0), key
    assert 20 < metrics["knn", 1]["top1"] < 100  # duplicates in the bank would change its votes
    assert_same_bank(protocol["knn", 2]["knn_bank"], protocol["knn", 1]["knn_bank"], 301)


def test_the_sbatch_template_as_written(slurm_cluster, tmp_path):
    """The guide's two sbatch commands, as written: one task, then DDP on two."""
    results = tmp_path / "results"
    env = slurm_cluster.env(results)
    (tmp_path / "scripts").symlink_to(
        ROOT / "scripts"
    )  # the guide's paths are the checkout's; the jobs' files stay here
    submitted = [
        run_doc(
            "sbatch scripts/slurm/vitexp.sbatch experiment=demo recipe.epochs=3",
            env=env,
            cwd=tmp_path,
            timeout=60,
        ),
        run_doc(
            "sbatch --ntasks-per-node=2 scripts/slurm/vitexp.sbatch experiment=demo recipe.epochs=3 "
            "trainer=ddp_cpu",
            env=env,
            cwd=tmp_path,
            timeout=60,
        ),
    ]
    assert all(done.returncode == 0 for done in submitted), [done.stderr for done in submitted]
    ids = [re.search(r"Submitted batch job (\d+)", done.stdout).group(1) for done in submitted]
    for job in ids:
        info = slurm_cluster.wait(job)
        assert info["JobState"] == "COMPLETED", (tmp_path / f"slurm-{job}.out").read_text()[-3000:]
    entries = sorted(ledger_entries(results), key=lambda e: e["metrics"]["world_size"])
    assert [(e["status"], e["metrics"]["world_size"]) for e in entries] == [
        ("completed", 1),
        ("completed", 2),
    ]
