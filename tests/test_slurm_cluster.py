"""vitexp's cluster path on a real scheduler: the two-node SLURM of scripts/local_slurm.sh
(tests/slurm_cluster.py), every command of docs/cluster.md run as written (tests/doc_commands.py).

Marker ``slurm`` (``pytest -m slurm``; CI runs it with VITEXP_REQUIRE_SLURM=1): a table swept through
``hydra/launcher=slurm`` with jobs on both nodes at once, DDP across the two nodes started by ``srun``,
preemption through both requeue paths (the sbatch template's SIGUSR1, on a job spanning both nodes, and
submitit's SIGUSR2), and the sbatch template submitted as written. The guide's two sbatch lines (one
process; one task on each node) are the uninterrupted runs the requeue tests compare with.
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
from slurm_cluster import ROOT, start, stop
from test_ddp import FROZEN_CLASSIFIER, assert_same_bank

pytestmark = pytest.mark.slurm

TEMPLATE = ROOT / "scripts" / "slurm" / "vitexp.sbatch"
ONE_PROCESS = "sbatch scripts/slurm/vitexp.sbatch experiment=demo recipe.epochs=3"
TWO_NODES = (
    "sbatch --nodes=2 --ntasks-per-node=1 scripts/slurm/vitexp.sbatch experiment=demo recipe.epochs=3"
    " trainer=ddp_cpu trainer.devices=1 trainer.num_nodes=2"
)
#: vitexp-train's overrides of the guide's two lines, for the requeued copies of them.
DEMO = ["experiment=demo", "recipe.epochs=3"]
DEMO_TWO_NODES = [*DEMO, "trainer=ddp_cpu", "trainer.devices=1", "trainer.num_nodes=2"]
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
def guide_jobs(slurm_cluster, tmp_path_factory):
    """The guide's two sbatch lines, submitted as written from one folder on first use: the SIGUSR1
    test's setup, so they run beside its job (the test waits for them only after its own) and are done
    by the time the SIGUSR2 test and the template's own test read them; ``wait(line)`` gives that job's
    one completed entry and its log."""
    folder = tmp_path_factory.mktemp("guide")
    results = folder / "results"
    (folder / "scripts").symlink_to(ROOT / "scripts")  # the guide's paths are the checkout's
    submitted = {  # literal lines, so that tests/test_cluster_docs.py sees them run
        ONE_PROCESS: run_doc(
            "sbatch scripts/slurm/vitexp.sbatch experiment=demo recipe.epochs=3",
            env=slurm_cluster.env(results / "one"),
            cwd=folder,
            timeout=60,
        ),
        TWO_NODES: run_doc(
            "sbatch --nodes=2 --ntasks-per-node=1 scripts/slurm/vitexp.sbatch experiment=demo recipe.epochs=3"
            " trainer=ddp_cpu trainer.devices=1 trainer.num_nodes=2",
            env=slurm_cluster.env(results / "two"),
            cwd=folder,
            timeout=60,
        ),
    }
    jobs = {}
    for line, done in submitted.items():
        assert done.returncode == 0, done.stderr
        job = re.search(r"Submitted batch job (\d+)", done.stdout).group(1)
        jobs[line] = (job, results / ("one" if line == ONE_PROCESS else "two"))
    seen: dict = {}

    def wait(line: str) -> tuple[dict, str]:
        """The line's completed entry and its job's log."""
        if line not in seen:
            job, where = jobs[line]
            info = slurm_cluster.wait(job)
            log = (folder / f"slurm-{job}.out").read_text()
            assert info["JobState"] == "COMPLETED", log[-3000:]
            seen[line] = (one_completed_entry(where), log)
        return seen[line]

    return wait


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
    steps_per_epoch = expected["steps"] // expected["epochs"]
    assert 0 < resumed["epoch"] <= 3 and resumed["global_step"] == steps_per_epoch * resumed["epoch"], resumed


def test_the_guides_local_cluster_runs_jobs(slurm_cluster, tmp_path):
    """The guide's one-node lines, on a cluster of their own: the ``export`` that ``start`` printed
    points SLURM's commands at it, whose one node is idle in partition ``local``, and ``stop`` ends it.
    Then its two-node lines on the session's cluster: ``srun`` runs one task on each node, each under
    its node's own hostname."""
    one = start(tmp_path / "one", nodes=1)  # a start that fails stops what it started (local_slurm.sh)
    try:
        env = slurm_cluster.env(tmp_path / "results")
        env.pop("SLURM_CONF")
        done = run_doc(
            "export SLURM_CONF=<folder>/slurm.conf",
            {"<folder>": str(one.folder)},
            env=env,
            then='srun --ntasks=1 hostname -s && sinfo && scontrol show config | grep -i "^SLURM_CONF"',
        )
        assert done.returncode == 0, done.stderr
        assert str(one.conf) in done.stdout
        assert re.search(r"local\*\s+up\s+infinite\s+1\s+idle", done.stdout), done.stdout
    finally:
        stop(one)
    assert not list(one.folder.glob("*.pid"))
    env = slurm_cluster.env(tmp_path / "results")
    done = run_doc("sinfo", env=env)
    assert re.search(r"local\*\s+up\s+infinite\s+2\s+\w+\s+node\[1-2\]", done.stdout), done.stdout
    done = run_doc("srun --nodes=2 --ntasks-per-node=1 hostname", env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == ["node1", "node2"], done.stdout


def test_stop_removes_the_two_node_clusters_namespaces_bridge_and_links(slurm_cluster, tmp_path):
    """A second two-node cluster beside the session's: ``stop`` ends its daemons and removes the network
    namespaces, the bridge and the veth links ``start`` made, and the machine's /etc/hosts is unchanged."""
    hosts = Path("/etc/hosts").read_text()
    other = start(tmp_path / "two", nodes=2)
    made = dict(re.findall(r'^(\w+)="?([^"\n]*)"?$', (other.folder / "network").read_text(), flags=re.M))
    names = [made["bridge"], *made["links"].split(), *made["namespaces"].split()]
    assert len(names) == 5 and all(n in _network_names() for n in names), (names, _network_names())
    assert Path("/etc/hosts").read_text() == hosts
    stop(other)
    assert not list(other.folder.glob("*.pid")) and not (other.folder / "network").exists()
    assert not set(names) & _network_names(), names
    assert Path("/etc/hosts").read_text() == hosts


def _network_names() -> set[str]:
    """The machine's links (without their ``@peer``) and network namespaces."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {m.split("@")[0] for m in re.findall(r"^\d+: ([^:]+):", links, flags=re.M)} | {
        line.split()[0] for line in spaces.splitlines() if line.strip()
    }


def test_first_command_of_the_guide_sweeps_the_demo_over_both_nodes_and_builds_its_table(
    slurm_cluster, tmp_path
):
    """The guide's first command as written: the demo table's rows queue as SLURM jobs (submitit,
    ``hydra/launcher=slurm``) that run on both nodes at the same time and write their ledger entries
    concurrently, none lost or torn; ``vitexp-tables`` builds the table from them; the same command
    again (how a sweep resumes) launches nothing."""
    results = tmp_path / "results"
    env = slurm_cluster.env(results)
    assert run_doc("sinfo", env=env).returncode == 0
    sweep = run_doc("vitexp-sweep demo hydra/launcher=slurm", env=env, cwd=tmp_path, background=True)
    seen, together = set(), []
    while sweep.poll() is None:
        queue = run_doc("squeue", env=env, timeout=60).stdout
        seen |= set(re.findall(r"\b(PD|R)\b", queue))
        # JOBID PARTITION NAME USER ST TIME NODES NODELIST: the nodes of the jobs running now
        running = {row.split()[-1] for row in queue.splitlines()[1:] if row.split()[4:5] == ["R"]}
        if len(running) > 1:
            together.append(sorted(running))
        time.sleep(1)
    out, err = sweep.communicate()
    assert sweep.returncode == 0, (out[-2000:], err[-3000:])
    assert "R" in seen, "no job was seen running in squeue"
    entries = ledger_entries(results)  # each entry whole JSON (none torn), no temp file left
    assert not list((results / "runs").glob(".*")), "a write left its temporary file"
    assert sorted((e["kind"], e["experiment"]) for e in entries) == [
        ("flops", "deit_small_baseline"),
        ("flops", "deit_tiny_baseline"),
        ("train", "demo"),
    ]
    assert all(e["status"] == "completed" for e in entries)
    nodes = {e["env"]["slurm"]["node"] for e in entries}
    assert nodes == {"node1", "node2"}, nodes
    assert all(e["env"]["hostname"] == e["env"]["slurm"]["node"] for e in entries)  # each node's own name
    assert ["node1", "node2"] in together, f"no two jobs seen running at once on different nodes: {together}"
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


def test_sbatch_template_requeue_across_two_nodes_on_sigusr1_ends_as_the_uninterrupted_run(
    slurm_cluster, tmp_path, guide_jobs
):
    """Lightning's SLURM path on a job spanning both nodes: the template's ``--signal=B:USR1@120`` and
    ``--requeue``, the signal sent as the guide says once the first epoch's checkpoint exists: srun
    passes it to both tasks, rank 0 requeues the job, which resumes on both nodes and ends with the
    guide's uninterrupted two-node run's metrics, in one entry that rank 0 alone wrote."""
    results = tmp_path / "results"
    job = sbatch(slurm_cluster, tmp_path, results, "--nodes=2", "--ntasks-per-node=1", *DEMO_TWO_NODES)
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
    for where in (entry["env"]["slurm"], entry["attempts"][0]["env"]["slurm"]):
        assert (where["job_id"], where["nodes"], where["procid"]) == (job, "node[1-2]", "0"), where
    assert entry["env"]["slurm"]["restart_count"] == "1"
    assert entry["metrics"]["world_size"] == 2
    assert_requeued_once(entry, "SIGUSR1", guide_jobs(TWO_NODES)[0]["metrics"])


def test_submitit_requeue_on_sigusr2_closes_the_attempt_interrupted(slurm_cluster, tmp_path, guide_jobs):
    """submitit's path (``hydra/launcher=slurm``): its SIGUSR2 handler checkpoints the job, runs
    ``scontrol requeue`` and exits; the attempt is recorded ``interrupted`` (SIGUSR2), not ``failed``,
    and the requeued job continues the same entry to the metrics of the guide's one-process line."""
    results = tmp_path / "results"
    env = slurm_cluster.env(results)
    launcher = subprocess.Popen(
        ["vitexp-train", "-m", *DEMO, "hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path / 'multirun'}"],
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
    assert_requeued_once(entry, "SIGUSR2", guide_jobs(ONE_PROCESS)[0]["metrics"])


def test_the_sbatch_template_as_written_on_one_process_and_across_two_nodes(guide_jobs):
    """The guide's two sbatch lines, as written: one process; then one task on each node, which
    Lightning's SLURM environment joins (rank 1 on node2 finds rank 0 on node1 by name) into one run
    with one ledger entry, written by rank 0."""
    one, _ = guide_jobs(ONE_PROCESS)
    two, log = guide_jobs(TWO_NODES)
    assert one["metrics"]["world_size"] == 1 and two["metrics"]["world_size"] == 2
    assert two["env"]["slurm"]["nodes"] == "node[1-2]" and two["env"]["slurm"]["procid"] == "0"
    assert two["env"]["slurm"]["node"] == "node1" == two["env"]["hostname"]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in log  # the second node's task joined the group


def test_ddp_across_two_nodes_equals_one_process_on_odd_splits(slurm_cluster, tmp_path):
    """``--nodes=2 --ntasks-per-node=1``: srun starts a rank on each node and Lightning's SLURM
    environment joins them (gloo, CPU). On 7 test and 5 validation images a frozen classifier's top-1,
    top-5 and losses, and k-NN on a bank of 301 images, equal one process's, and so does the bank itself
    (its size, its images per label and the sum of its features, from the runs' protocol ``knn_bank``)."""
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
    placements = {
        2: [
            "--nodes=2",
            "--ntasks-per-node=1",
            "trainer=ddp_cpu",
            "trainer.devices=1",
            "trainer.num_nodes=2",
        ],
        1: ["--nodes=1", "trainer=cpu"],
    }
    jobs = {}
    for what, model in runs.items():
        for ranks, placement in placements.items():
            folder = tmp_path / f"{what}_{ranks}"
            jobs[what, ranks] = (
                folder,
                sbatch(slurm_cluster, folder, folder / "results", *odd, *model, *placement),
            )
    metrics, protocol = {}, {}
    for key, (folder, job) in jobs.items():
        info = slurm_cluster.wait(job)
        assert info["JobState"] == "COMPLETED", (folder / f"slurm-{job}.out").read_text()[-3000:]
        entry = one_completed_entry(folder / "results")
        assert entry["metrics"]["world_size"] == key[1]
        if key[1] == 2:
            assert entry["env"]["slurm"]["nodes"] == "node[1-2]", entry["env"]["slurm"]
        metrics[key], protocol[key] = entry["metrics"], entry["protocol"]
    log = (jobs["classify", 2][0] / f"slurm-{jobs['classify', 2][1]}.out").read_text()
    assert "GLOBAL_RANK: 1" in log  # the second node's rank, started by srun, joined the group
    for key in ("top1", "top5", "val_top1"):
        assert metrics["classify", 2][key] == metrics["classify", 1][key], key
        assert metrics["knn", 2][key] == metrics["knn", 1][key], key
    for key in ("test_loss", "val_loss"):
        assert metrics["classify", 2][key] == pytest.approx(metrics["classify", 1][key], rel=1e-6, abs=0), key
    assert 20 < metrics["knn", 1]["top1"] < 100  # duplicates in the bank would change its votes
    assert_same_bank(protocol["knn", 2]["knn_bank"], protocol["knn", 1]["knn_bank"], 301)
