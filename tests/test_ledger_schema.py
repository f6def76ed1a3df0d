"""Issue 58, what remained: entries checked by pydantic models (enumerations, UTC times, a train entry's
run config, paths of one machine), a run-id lookup naming its own broken file, W&B names from the run
id (a refused artifact named in the entry), a full disk at the close (the closing line says where the
metrics are, resume reads them back), one vitexp-tables writer per output folder."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import textwrap

import pytest
from conftest import QUIET, TINY_TRAIN, run_config

from vitexp.ledger import Ledger, LedgerEntry, LedgerError
from vitexp.ledger.schema import problems

SMALL = TINY_TRAIN


def _record(**changes) -> dict:
    return {
        "run_id": "r1",
        "experiment": "demo",
        "status": "completed",
        "kind": "train",
        "started": "2026-01-01T00:00:00+00:00",
        "config": run_config(0),
        "metrics": {"top1": 1.0},
        **changes,
    }


@pytest.mark.parametrize(
    "changes, problem",
    [
        ({"status": "done"}, "status 'done' is not one of"),
        ({"kind": "training"}, "kind 'training' is not one of"),
        ({"started": "2026-01-01T00:00:00"}, "started '2026-01-01T00:00:00' names no time zone"),
        ({"finished": 1767225600}, "finished 1767225600 is not an ISO 8601 time"),
        ({"config": {"seed": 0}}, "config has no backbone, method, budget, data, recipe, trainer"),
        ({"config": run_config(0, {"data": {"root": "/usr/share/x"}})}, "config.data.root '/usr/share/x'"),
        ({"differences": ["path=file:///tmp/x/conf"]}, "differences[0] 'path=file:///tmp/x/conf'"),
        ({"metrics": {"top1": {"per_class": [1.0, float("nan")]}}}, "metric 'top1' holds"),
        ({"metrics": {"top1": 1, "at": b"x"}}, "metric 'at' is bytes"),
    ],
)
def test_the_schema_names_what_is_wrong(changes, problem):
    """Each rule of the models, one broken field at a time (seen passing the old hand-written checks
    for the zone, the Unix time, the config's groups, the paths and the bytes: none of them was
    checked)."""
    assert problems(_record()) == []
    found = problems(_record(**changes))
    assert any(problem in p for p in found), found


def test_a_path_named_with_its_machine_keeps_the_schema_and_reads_as_a_path_here(results_dir):
    from vitexp.ledger import local_path, portable_path

    assert problems(_record(config=run_config(0, {"data": {"root": "file://vm/usr/share/x"}}))) == []
    assert str(local_path("file://vm/usr/share/x")) == "/usr/share/x"
    assert portable_path("/usr/share/x", results_dir, host="vm") == "file://vm/usr/share/x"
    depth = len(results_dir.resolve().parts) - 1  # ../ up to / from the results root: bound to this depth
    assert portable_path("../" * depth + "usr/share/x", results_dir, host="vm") == "file://vm/usr/share/x"
    assert portable_path(results_dir.parent / "run1", results_dir) == "../run1"  # moves with the results
    assert portable_path(results_dir / "weights" / "a.pth", results_dir) == "weights/a.pth"


def test_times_are_written_in_utc_and_a_naive_or_future_start_is_refused(results_dir):
    """A run's times are aware datetimes written in UTC: a start handed in at +03:00 is stored as the
    same instant at +00:00 (seen stored as given before); a time without a zone is refused."""
    entry = LedgerEntry("demo", "train", run_config(0), results_dir)
    entry.record["started"] = "2026-01-01T03:00:00+03:00"
    entry.start()
    assert json.loads(entry.path.read_text())["started"] == "2026-01-01T00:00:00+00:00"
    entry.record["heartbeat"] = "2026-01-01T01:00:00"
    with pytest.raises(ValueError, match="heartbeat '2026-01-01T01:00:00' names no time zone"):
        entry._write()


def test_a_train_entry_without_a_run_config_is_refused_when_written(results_dir):
    with pytest.raises(ValueError, match="config has no backbone"):
        LedgerEntry("demo", "train", {"seed": 0}, results_dir).start()
    LedgerEntry("demo", "flops", {"seed": 0}, results_dir).start()  # a FLOPs count: any config


def test_a_run_id_lookup_whose_own_file_is_broken_names_the_file(results_dir):
    """``run:<run_id>`` (and vitexp-eval's run id) whose entry is there but does not parse: the error
    names that file (it said "no completed train run ... run `vitexp-train ...` first")."""
    from vitexp.commands.evaluate import find_run
    from vitexp.ledger import weights_run

    entry = LedgerEntry("teacher", "train", run_config(0), results_dir).start()
    entry.finish({"top1": 1.0})
    entry.path.write_text(entry.path.read_text()[:120])
    for lookup in (
        lambda: weights_run(f"run:{entry.run_id}", results_dir),
        lambda: weights_run(f"run:{entry.run_id}", results_dir, Ledger.load(results_dir)),
        lambda: find_run(entry.run_id, results_dir),
    ):
        with pytest.raises(LedgerError, match=f"runs/{entry.run_id}.json: (unreadable|not JSON)"):
            lookup()


def test_a_unicode_run_logs_its_model_under_a_sanitised_name_and_a_refused_artifact_is_named(
    make_cfg, results_dir, tmp_path, capsys, monkeypatch
):
    """W&B (offline) takes the model artifact of a run named ``démo-ü`` as ``weights-<the run id
    sanitised>``, the mapping in the entry (before: W&B refused the name, a warning in the log, no
    ``artifacts.wandb_model``). An artifact W&B refuses fails the upload step in the entry and on
    stderr, not as a logged warning."""
    from vitexp.commands.train import train
    from vitexp.runs.loggers import wandb_name

    assert wandb_name("20260101-000000-train-démo-ü+x=1-abc123") == "20260101-000000-train-demo-u-x-1-abc123"
    monkeypatch.setenv("WANDB_MODE", "offline")
    over = [*SMALL, "logger=wandb", "name='démo-ü'", QUIET[1]]
    result = train(make_cfg(over, tmp_path / "uni"))
    (entry,) = [e for e in Ledger.load(results_dir) if e["run_id"] == result["run_id"]]
    assert "é" in entry["run_id"] and entry["wandb_name"] == wandb_name(entry["run_id"])
    assert entry["artifacts"]["wandb_model"].endswith(f"weights-{entry['wandb_name']}:latest")

    from vitexp.runs import loggers

    monkeypatch.setattr(loggers, "model_artifact_name", lambda run_id: f"weights-{run_id}:é/x")  # unsanitised
    result = train(make_cfg([*SMALL, "logger=wandb", QUIET[1]], tmp_path / "refused"))
    entry = Ledger.load(results_dir).get(result["run_id"])
    assert entry["status"] == "completed" and entry["artifacts"]["wandb_model"] is None
    assert "W&B refused the model artifact weights-" in entry["wandb_error"]
    assert "ValueError" in entry["wandb_error"] and result["wandb_error"] == entry["wandb_error"]
    assert "vitexp: W&B refused the model artifact" in capsys.readouterr().err


def test_no_space_at_the_close_says_where_the_metrics_are_and_resume_closes_the_entry_with_them(
    make_cfg, results_dir, tmp_path, capsys, monkeypatch
):
    """The entry's closing write fails for want of space (ENOSPC): the run fails, its closing line
    carries the metrics and names the file in the run folder that keeps them, and resume=auto in that
    folder closes the entry ``completed`` with them without training again (before: the line said
    only the error, and the metrics were lost)."""
    from vitexp.commands.train import train
    from vitexp.ledger import entry as entry_module
    from vitexp.runs.owner import PENDING_CLOSE

    real = entry_module.atomic_write_json

    def full_disk(path, payload):
        if payload.get("status") == "completed":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, payload)

    monkeypatch.setattr(entry_module, "atomic_write_json", full_disk)
    over = [*SMALL, "logger=none", QUIET[1], "resume=auto"]
    with pytest.raises(OSError, match="no space to close the ledger entry"):
        train(make_cfg(over, tmp_path / "run"))
    closing = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert closing["status"] == "failed" and closing["metrics"]["top1"] >= 0
    assert closing["pending"].endswith(f"run/{PENDING_CLOSE}") and closing["pending"] in closing["error"]
    (entry,) = list(Ledger.load(results_dir))
    assert entry["status"] == "failed" and "no space to close" in entry["error"]
    monkeypatch.setattr(entry_module, "atomic_write_json", real)
    resumed = train(make_cfg(over, tmp_path / "run"))
    (entry,) = list(Ledger.load(results_dir))
    assert entry["status"] == "completed" and entry["metrics"] == closing["metrics"]
    assert resumed["recovered_from"] == entry["recovered_from"] == closing["pending"]
    assert entry["attempts"][0]["status"] == "failed" and not (tmp_path / "run" / PENDING_CLOSE).exists()


def test_a_second_tables_writer_of_one_folder_is_refused_naming_the_first(results_dir, tmp_path, capsys):
    """vitexp-tables holds ``<out>/.tables.lock`` while it writes: a second writer of that folder is
    refused (exit 1) naming the first's process (seen writing alongside it before)."""
    from vitexp.report import tables

    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys
                from vitexp.report.tables import TABLES_LOCK, TABLES_REFUSAL
                from vitexp.runs.lock import RunFolderLock
                RunFolderLock({str(out)!r}, TABLES_LOCK, TABLES_REFUSAL).acquire()
                print("held", flush=True)
                sys.stdin.read()
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert tables.main(["demo", "--results-dir", str(results_dir), "--out", str(out)]) == 1
        closing = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (
            f"process {holder.pid} on" in closing["error"]
            and "one writer per output folder" in closing["error"]
        )
        assert not (out / "demo.md").exists()
    finally:
        holder.communicate("", timeout=30)
    assert tables.main(["demo", "--results-dir", str(results_dir), "--out", str(out)]) == 0


def test_the_migration_rewrites_a_ledger_once_through_the_schema(results_dir, capsys):
    """scripts/migrate_ledger.py: a loose entry and a pack written before the schema (an absolute
    dataset path, a depth-bound ``..`` run folder, a NaN token, a start at +03:00, a ``file:///`` URL
    in a text) come out keeping it; a second run changes nothing."""
    import gzip
    import importlib.util

    from vitexp import PROJECT_ROOT

    spec = importlib.util.spec_from_file_location(
        "migrate_ledger", PROJECT_ROOT / "scripts" / "migrate_ledger.py"
    )
    migrate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(migrate)
    depth = "../" * (len(results_dir.resolve().parts) - 1)
    old = _record(
        started="2026-01-01T03:00:00+03:00",
        config=run_config(0, {"data": {"root": "/usr/share/x"}}),
        output_dir=f"{depth}srv/reh/run1",
        env={"hostname": "node7"},
        differences=["path=file:///tmp/scratch/conf"],
    )
    (results_dir / "runs").mkdir(parents=True)
    (results_dir / "runs" / "r1.json").write_text(json.dumps(old))
    (results_dir / "ledger").mkdir()
    packed = {**old, "run_id": "r2", "metrics": {"top1": float("nan")}}
    with gzip.open(results_dir / "ledger" / "20260101-000000.jsonl.gz", "wt") as fh:
        fh.write(json.dumps(packed) + "\n")  # a NaN token, as Python writes it
    assert problems(old, "r1") and migrate.main([str(results_dir)]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 2
    ledger = Ledger.load(results_dir)
    assert not ledger.broken and len(ledger) == 2
    new = ledger.get("r1")
    assert (
        new["started"] == "2026-01-01T00:00:00+00:00"
        and new["config"]["data"]["root"] == "file://node7/usr/share/x"
    )
    assert new["output_dir"] == "file://node7/srv/reh/run1" and new["differences"] == [
        "path=file://node7/tmp/scratch/conf"
    ]
    assert ledger.get("r2")["metrics"]["top1"] is None
    assert migrate.main([str(results_dir)]) == 0 and json.loads(capsys.readouterr().out)["entries"] == 0
