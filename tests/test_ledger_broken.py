"""Broken sources of the ledger (issue 47), reproduced on a small results root: a truncated or
non-gzip pack, a pack's bad line, a truncated loose copy of a row's run under another name, an
entry without ``started`` or started in the future. Each is named with what is wrong, never as a
W&B failure; ``--skip-broken`` leaves it out and lists it; a run refuses to start on an unreadable
pack before Hydra writes anything; two ``--pack`` at once leave one consistent set of packs."""

from __future__ import annotations

import datetime as dt
import gzip
import json
import sys
import threading
from pathlib import Path

import pytest
from conftest import config_of, run_config

from vitexp.ledger import Ledger, LedgerEntry, LedgerError, packs
from vitexp.report import tables

DEMO = {
    "name": "demo",
    "title": "t",
    "columns": [{"key": "top1", "label": "Top-1", "digits": 1}],
    "rows": [{"label": "demo", "experiment": "demo"}],
}


def _entry(results_dir: Path, name: str, top1: float, started: str, config: dict | None = None) -> str:
    entry = LedgerEntry(
        name, "train", config if config is not None else config_of("demo"), results_dir
    ).start()
    entry.record["started"] = started
    entry.finish({"top1": top1})
    return entry.run_id


def _packed(results_dir: Path, monkeypatch) -> Path:
    """Fold every completed entry into one pack (no settling time); its path."""
    monkeypatch.setattr(packs, "SETTLED_S", 0)
    return Path(packs.pack(results_dir)["pack"])


def _tables(results_dir: Path, tmp_path: Path, capsys, *extra: str) -> tuple[int, dict]:
    spec = tmp_path / "demo.yaml"
    spec.write_text(json.dumps(DEMO))
    code = tables.main([str(spec), "--results-dir", str(results_dir), "--out", str(tmp_path / "t"), *extra])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_truncated_pack_is_named_and_skip_broken_leaves_it_out(results_dir, tmp_path, capsys, monkeypatch):
    """Reproduction 1: a pack cut in half. The table is refused naming the pack and what is wrong
    (not "W&B None: EOFError"); --skip-broken writes it without the pack's entries and lists it."""
    _entry(results_dir, "demo", 94.4, "2026-01-01T00:00:00+00:00")
    pack = _packed(results_dir, monkeypatch)
    data = pack.read_bytes()
    pack.write_bytes(data[: len(data) // 2])
    code, closing = _tables(results_dir, tmp_path, capsys)
    assert code == 1 and closing["status"] == "failed"
    assert f"ledger/{pack.name}: truncated (EOFError: Compressed file ended" in closing["error"]
    assert "W&B" not in closing["error"] and "--skip-broken" in closing["error"]
    code, closing = _tables(results_dir, tmp_path, capsys, "--skip-broken")
    assert code == 0 and [b.split(":")[0] for b in closing["skipped_broken"]] == [f"ledger/{pack.name}"]
    md = (tmp_path / "t" / "demo.md").read_text()
    assert "not run" in md and f"Left out by --skip-broken: ledger/{pack.name}: truncated" in md


def test_a_pack_that_is_not_gzip_and_a_bad_line_are_named(results_dir, monkeypatch):
    """Every unreadable source names its file: a pack that is not gzip at all; a pack with one bad
    line (its other lines are read)."""
    real = _entry(results_dir, "demo", 94.4, "2026-01-01T00:00:00+00:00")
    pack = _packed(results_dir, monkeypatch)
    good = gzip.decompress(pack.read_bytes())
    pack.write_bytes(gzip.compress(good + b'{"run_id": "cut\n'))
    other = pack.parent / "20270101-000000.jsonl.gz"
    other.write_bytes(b"not a gzip file")
    ledger = Ledger.load(results_dir)
    assert [r["run_id"] for r in ledger] == [real]
    assert [(b.path, b.problem.split(" (")[0]) for b in ledger.broken] == [
        (f"ledger/{pack.name}:2", "not JSON"),
        (f"ledger/{other.name}", "unreadable"),
    ]
    assert "BadGzipFile" in ledger.broken[1].problem


def test_a_lookup_by_run_id_names_an_unreadable_pack_and_reads_each_pack_once(results_dir, monkeypatch):
    """``load_entry`` of a run in no readable pack raises naming the unreadable one (the run could
    be in it); the packs are parsed once per process, not once per lookup."""
    from vitexp.ledger import load_entry, sources

    first = _entry(results_dir, "demo", 94.4, "2026-01-01T00:00:00+00:00")
    _packed(results_dir, monkeypatch)
    parsed = []
    real_read = sources.read_snapshot
    monkeypatch.setattr(packs, "read_snapshot", lambda *a, **k: parsed.append(a[0]) or real_read(*a, **k))
    packs._PARSED.clear()
    for _ in range(5):
        assert load_entry(first, results_dir)["run_id"] == first
        assert load_entry("no-such-run", results_dir) is None
    assert len(parsed) == 1
    broken = results_dir / "ledger" / "20270101-000000.jsonl.gz"
    broken.write_bytes(gzip.compress(b"{}\n")[:12])
    assert load_entry(first, results_dir)["run_id"] == first  # found in a readable pack
    with pytest.raises(LedgerError, match=f"ledger/{broken.name}: truncated"):
        load_entry("no-such-run", results_dir)


def test_a_run_refuses_to_start_on_an_unreadable_pack_before_hydra_writes(
    results_dir, tmp_path, monkeypatch, capsys
):
    """``vitexp-train`` on a results root whose pack is truncated: exit 1 naming the pack, and no
    run folder (Hydra's ``.hydra``) left behind."""
    from vitexp.commands import cli

    (results_dir / "ledger").mkdir(parents=True)
    pack = results_dir / "ledger" / "20260101-000000.jsonl.gz"
    pack.write_bytes(gzip.compress(json.dumps({"run_id": "x"}).encode() * 50)[:30])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        sys, "argv", ["vitexp-train", "experiment=demo", "logger=none", "backbone.pretrained=run:demo"]
    )
    with pytest.raises(SystemExit) as stopped:
        cli.train_main()
    assert stopped.value.code == 1
    closing = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert closing["status"] == "failed" and f"ledger/{pack.name}: truncated" in closing["error"]
    assert not (tmp_path / "outputs").exists()


def test_a_resumed_run_whose_own_entry_is_unreadable_is_refused(results_dir, tmp_path):
    """The run folder names its entry (run.json); that file truncated, resume=auto stops naming it
    instead of starting a new entry in its place."""
    from vitexp.runs.owner import RUN_MARKER, owned_run

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    entry = LedgerEntry("demo", "train", run_config(0), results_dir).start()
    entry.path.write_text(entry.path.read_text()[:100])
    (run_dir / RUN_MARKER).write_text(json.dumps({"run_id": entry.run_id, "wandb_id": "abc"}))
    with pytest.raises(LedgerError, match=f"runs/{entry.run_id}.json: unreadable"):
        with owned_run("demo", "train", results_dir, run_dir, None, "auto", resumable=True) as run:
            run.start({"seed": 0})
    assert [p.name for p in (results_dir / "runs").glob("*.json")] == [f"{entry.run_id}.json"]


def test_a_broken_copy_of_a_rows_run_under_another_name_is_reported_for_that_row(
    results_dir, tmp_path, capsys
):
    """Reproduction 2: a loose copy of the demo run under the name ``myexp`` is a run of the demo's
    configuration (50.0 fills the cell: rows match by config, whatever the name); truncated, it is
    named for the demo table (it used to vanish: rc 0, ``skipped_broken: []``, 94.4)."""
    _entry(results_dir, "demo", 94.4, "2026-01-01T00:00:00+00:00")
    copy = _entry(results_dir, "myexp", 50.0, "2026-01-02T00:00:00+00:00")
    (row,) = tables.fill(DEMO, Ledger.load(results_dir))
    assert row["cells"]["top1"]["value"] == 50.0
    path = results_dir / "runs" / f"{copy}.json"
    path.write_text(path.read_text()[:-200])  # the config is whole, the file is not
    code, closing = _tables(results_dir, tmp_path, capsys)
    assert code == 1 and f"runs/{copy}.json: not JSON" in closing["error"]
    code, closing = _tables(results_dir, tmp_path, capsys, "--skip-broken")
    assert code == 0 and [b.split(":")[0] for b in closing["skipped_broken"]] == [f"runs/{copy}.json"]
    assert "94.4" in (tmp_path / "t" / "demo.md").read_text()


def test_a_broken_entry_is_reported_for_the_rows_its_config_could_be(results_dir):
    """By config: a broken entry holding another configuration is not the demo row's; one holding
    no readable config could be any row's."""
    other = config_of("demo", None, {"recipe": {"lr": 0.5}})
    runs = results_dir / "runs"
    runs.mkdir(parents=True)
    for name, config in (("mine", config_of("demo")), ("theirs", other)):
        (runs / f"{name}.json").write_text(
            json.dumps(
                {
                    "run_id": name,
                    "experiment": "myexp",
                    "status": "done",
                    "kind": "train",
                    "started": "2026-01-01T00:00:00+00:00",
                    "config": config,
                }
            )
        )
    ledger = Ledger.load(results_dir)
    assert sorted(b.path for b in ledger.broken) == ["runs/mine.json", "runs/theirs.json"]
    assert [b.path for b in tables.broken_for(DEMO, ledger)] == ["runs/mine.json"]
    (runs / "20260101-000000-train-other-abc123.json").write_text("{")
    assert [b.path for b in tables.broken_for(DEMO, Ledger.load(results_dir))] == [
        "runs/20260101-000000-train-other-abc123.json",
        "runs/mine.json",
    ]
    named = {**DEMO, "rows": [{"label": "pre", "experiment": "pre"}]}  # composes nothing: matched by name
    assert tables.broken_for(named, Ledger.load(results_dir)) == []


@pytest.mark.parametrize(
    "started, problem",
    [(None, "no 'started'"), ("in a day", "is in the future"), ("yesterday-ish", "is not an ISO 8601 time")],
)
def test_an_entry_without_a_start_or_started_in_the_future_is_broken(
    results_dir, tmp_path, capsys, started, problem
):
    """Reproduction 6: an entry without ``started`` counted as the oldest without a word; one that
    started in the future would be the newest forever. Both are broken, and named."""
    real = _entry(results_dir, "demo", 94.4, "2026-01-01T00:00:00+00:00")
    stray = _entry(results_dir, "demo", 12.3, "2026-01-02T00:00:00+00:00")
    path = results_dir / "runs" / f"{stray}.json"
    record = json.loads(path.read_text())
    if started is None:
        record.pop("started")
    else:
        later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1)
        record["started"] = later.isoformat(timespec="seconds") if started == "in a day" else started
    path.write_text(json.dumps(record))
    ledger = Ledger.load(results_dir)
    assert [r["run_id"] for r in ledger] == [real] and len(ledger.broken) == 1
    assert ledger.broken[0].path == f"runs/{stray}.json" and problem in ledger.broken[0].problem
    code, closing = _tables(results_dir, tmp_path, capsys)
    assert code == 1 and f"runs/{stray}.json" in closing["error"]


def test_two_packs_at_once_leave_one_consistent_set_of_packs(results_dir, monkeypatch):
    """Reproduction 7: a second ``--pack`` starts while the first is writing its pack. It waits for
    the ledger's lock, then finds nothing left to pack: no traceback, every entry in exactly one
    pack, none left in runs/ (without the lock both packed the same files and the second failed
    removing them)."""
    ids = [
        _entry(results_dir, f"demo+seed={s}", 90.0 + s, f"2026-01-0{s + 1}T00:00:00+00:00") for s in range(3)
    ]
    monkeypatch.setattr(packs, "SETTLED_S", 0)
    names = iter(["20270101-000000", "20270101-000001"])
    monkeypatch.setattr(packs.time, "strftime", lambda *a: next(names))
    real_write = packs.write_snapshot
    second: dict = {}

    def pack_again():
        try:
            second["result"] = packs.pack(results_dir)
        except BaseException as err:  # noqa: BLE001 - what the second pack raised is the test's finding
            second["error"] = err

    def write_then_let_a_second_pack_in(records, path):
        written = real_write(records, path)
        if "thread" not in second:
            second["thread"] = threading.Thread(target=pack_again)
            second["thread"].start()
            second["thread"].join(timeout=2)  # under the lock it waits for this pack to end
        return written

    monkeypatch.setattr(packs, "write_snapshot", write_then_let_a_second_pack_in)
    first = packs.pack(results_dir)
    second["thread"].join()
    assert "error" not in second, second.get("error")
    assert first["packed"] == 3 and second["result"]["packed"] == 0
    packed_ids = [r["run_id"] for p in packs.pack_files(results_dir) for r in packs.read_snapshot(p)[0]]
    assert sorted(packed_ids) == sorted(ids) and not list((results_dir / "runs").glob("*.json"))
    assert packs.pack(results_dir)["packed"] == 0  # and once more, in a row


@pytest.mark.parametrize("how", ["empty", "gunzipped", "other name", "orphan temp"])
def test_nothing_in_the_ledger_folder_goes_unread_without_a_word(
    how, results_dir, tmp_path, capsys, monkeypatch
):
    """Issue 58, edge 1: a 0-byte pack, a pack decompressed in place, a file of another name and a killed
    write's temporary file are each named (the table is refused), and --skip-broken leaves them out."""
    _entry(results_dir, "demo", 94.4, "2026-01-01T00:00:00+00:00")
    pack = _packed(results_dir, monkeypatch)
    _entry(results_dir, "demo", 11.1, "2025-01-01T00:00:00+00:00")  # an older run, loose
    if how == "empty":
        pack.write_bytes(b"")
        name, why = pack.name, "an empty pack (0 bytes"
    elif how == "gunzipped":
        target = pack.with_suffix("")  # <time>.jsonl
        target.write_bytes(gzip.decompress(pack.read_bytes()))
        pack.unlink()
        name, why = target.name, "not a pack"
    elif how == "other name":
        (pack.parent / "notes.txt").write_text("x")
        name, why = "notes.txt", "not a pack"
    else:
        (pack.parent / f".{pack.name}.abc123.gz").write_bytes(b"\x1f")
        name, why = f".{pack.name}.abc123.gz", "a temporary file of a pack write that was killed"
    code, closing = _tables(results_dir, tmp_path, capsys)
    assert code == 1 and f"ledger/{name}: {why}" in closing["error"], closing
    code, closing = _tables(results_dir, tmp_path, capsys, "--skip-broken")
    assert code == 0 and any(b.startswith(f"ledger/{name}") for b in closing["skipped_broken"])
    if how == "orphan temp":  # the next pack cleans it (a pack's name is its second: wait for the next)
        import time

        time.sleep(1.05)
        packs.pack(results_dir)
        assert not (pack.parent / name).exists() and not Ledger.load(results_dir).broken


def test_a_pack_write_that_fails_leaves_no_pack_and_every_loose_entry(results_dir, monkeypatch):
    """Issue 58, edge 1: a pack write that fails for want of space removes its reserved file; the
    entries stay loose and the ledger reads them all."""
    import errno

    ids = {_entry(results_dir, "demo", 90.0 + i, f"2026-01-0{i + 1}T00:00:00+00:00") for i in range(3)}
    monkeypatch.setattr(packs, "SETTLED_S", 0)

    def full(records, path):
        Path(path).write_bytes(b"\x1f\x8b")  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(packs, "write_snapshot", full)
    with pytest.raises(OSError, match="No space left"):
        packs.pack(results_dir)
    assert packs.pack_files(results_dir) == [] and not list((results_dir / packs.PACKS).glob("*.gz"))
    ledger = Ledger.load(results_dir)
    assert not ledger.broken and {r["run_id"] for r in ledger.records} == ids


def test_newest_is_by_time_not_by_the_text_of_started(results_dir, tmp_path, capsys):
    """Issue 58, edge 2: 17:00+03:00 is 14:00 UTC, an hour older than 15:00+00:00, though its text sorts
    after it; the run that started later fills the cell."""
    _entry(results_dir, "demo", 94.7, "2026-12-05T15:00:00+00:00")
    _entry(results_dir, "demo", 44.4, "2026-12-05T17:00:00+03:00")
    code, _ = _tables(results_dir, tmp_path, capsys)
    assert code == 0 and "| 94.7 " in (tmp_path / "t" / "demo.md").read_text()


def test_a_tie_in_time_goes_to_the_run_id_wherever_the_entries_live(
    results_dir, tmp_path, capsys, monkeypatch
):
    """Issue 58, edge 2: two runs started in the same second; the higher run id is the newer, before and
    after one of them is packed (packing used to flip the cell)."""
    same = "2026-12-05T15:00:00+00:00"
    ids = {_entry(results_dir, "demo", top1, same): top1 for top1 in (11.1, 22.2)}
    newest = ids[max(ids)]
    code, _ = _tables(results_dir, tmp_path, capsys)
    assert code == 0 and f"| {newest} " in (tmp_path / "t" / "demo.md").read_text()
    monkeypatch.setattr(packs, "SETTLED_S", 0)
    older = min(ids)
    (results_dir / "runs" / f"{max(ids)}.json").rename(tmp_path / "held.json")  # pack only the older
    packs.pack(results_dir)
    (tmp_path / "held.json").rename(results_dir / "runs" / f"{max(ids)}.json")
    assert not (results_dir / "runs" / f"{older}.json").exists()
    code, _ = _tables(results_dir, tmp_path, capsys)
    assert code == 0 and f"| {newest} " in (tmp_path / "t" / "demo.md").read_text()


def test_a_nan_metric_fails_the_run_naming_it_and_a_file_holding_one_is_named(results_dir):
    """Issue 58: NaN or Infinity is no metric. A run closing with one is refused naming the metric (its
    entry stays open, then fails); an entry file that holds one, written by hand, is a named broken entry
    instead of a cell that reads "nan"."""
    entry = LedgerEntry("demo", "train", config_of("demo"), results_dir).start()
    with pytest.raises(
        ValueError, match=r"is not completed: metric 'val_loss' holds nan: not a finite number$"
    ):
        entry.finish({"top1": 90.0, "val_loss": float("nan")})
    assert entry.record["status"] == "running"
    entry.fail(ValueError("metric 'val_loss' = nan"))
    assert json.loads(entry.path.read_text())["status"] == "failed"
    done = LedgerEntry("demo", "train", config_of("demo"), results_dir).start()
    done.finish({"top1": 90.0, "per_class": [1.0, 2.0]})
    record = json.loads(done.path.read_text())
    record["metrics"]["per_class"] = [1.0, float("inf")]
    done.path.write_text(json.dumps(record))  # Python writes Infinity, which no JSON reader should take
    broken = Ledger.load(results_dir).broken
    assert [str(b) for b in broken] == [
        f"runs/{done.path.name}: metric 'per_class' holds [1.0, inf]: not a finite number"
    ]
