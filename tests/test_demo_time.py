"""The demo's time (issue 49): torch's threads fitted to the CPUs a process may use, and
``vitexp-bench bench.mode=demo``, which times ``vitexp-train`` as a newcomer runs it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import QUIET, ledger_entries


@pytest.fixture
def threads():
    """torch's thread count restored after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _cgroup(tmp_path, v2: str | None = None, v1: tuple[str, str] | None = None):
    v2_path = tmp_path / "cpu.max"
    v1_paths = (tmp_path / "cpu.cfs_quota_us", tmp_path / "cpu.cfs_period_us")
    if v2 is not None:
        v2_path.write_text(v2 + "\n")
    if v1 is not None:
        v1_paths[0].write_text(v1[0] + "\n")
        v1_paths[1].write_text(v1[1] + "\n")
    return v2_path, v1_paths


@pytest.mark.parametrize(
    "v2, v1, expected",
    [
        ("150000 100000", None, 2),  # 1.5 CPUs of quota: 2 threads
        ("100000 100000", None, 1),
        ("max 100000", None, None),  # no quota
        (None, ("200000", "100000"), 2),
        (None, ("-1", "100000"), None),  # cgroup v1 without a quota
        (None, None, None),
    ],
)
def test_the_cgroup_quota_is_read_in_whole_cpus(tmp_path, v2, v1, expected):
    from vitexp.runs.cpus import _quota

    assert _quota(*_cgroup(tmp_path, v2, v1)) == expected


def test_torch_threads_are_lowered_to_the_quota_and_never_raised(tmp_path, monkeypatch, threads):
    from vitexp.runs.cpus import available_cpus, fit_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    one_cpu = _cgroup(tmp_path, "100000 100000")
    torch.set_num_threads(2)
    assert available_cpus(*one_cpu) == 1
    assert fit_threads(*one_cpu) == 1 and torch.get_num_threads() == 1
    (tmp_path / "many").mkdir()
    many = _cgroup(tmp_path / "many", "6400000 100000")
    assert fit_threads(*many) == 1  # a quota of 64 CPUs does not raise a lower count


def test_a_users_omp_num_threads_is_left_alone(tmp_path, monkeypatch, threads):
    from vitexp.runs.cpus import fit_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    assert fit_threads(*_cgroup(tmp_path, "100000 100000")) == 2


def test_bench_demo_times_vitexp_train_in_a_fresh_process_and_records_fit_and_the_rest(
    make_cfg, results_dir, capsys
):
    """One bench entry, the demo's own results gone with its scratch folder; fit + the rest = wall."""
    from vitexp.commands.bench import run_bench

    demo = [
        "recipe.epochs=1",
        "recipe.warmup_epochs=0",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1",
        "eval.throughput=false",
        "logger=none",
    ]
    result = run_bench(
        make_cfg(QUIET + ["bench.mode=demo", f"bench.demo_args=[{','.join(repr(a) for a in demo)}]"])
    )
    m = result["metrics"]
    print(json.dumps(m))
    assert m["demo_fit_s"] > 0 and m["demo_overhead_s"] > 0
    assert m["demo_fit_s"] + m["demo_overhead_s"] == pytest.approx(m["demo_wall_s"], rel=1e-9)
    assert m["demo_epochs"] == 1 and "top1" not in m  # a demo timing never fills the demo's top-1 cell
    entries = ledger_entries(results_dir)
    assert [(e["kind"], e["status"]) for e in entries] == [
        ("bench", "completed")
    ]  # the demo's own train entry stayed in its scratch folder
    protocol = entries[0]["protocol"]
    assert protocol["mode"] == "demo" and "recipe.epochs=1" in protocol["command"]
    assert protocol["load_before"]["cpus"] >= 1 and protocol["demo_threads"] >= 1


def test_bench_demo_fails_cleanly_when_the_demo_does(make_cfg, results_dir):
    from vitexp.commands.bench import run_bench

    with pytest.raises(RuntimeError, match="the demo did not complete"):
        run_bench(make_cfg(QUIET + ["bench.mode=demo", "bench.demo_args=['recipe.nope=1']"]))
    assert [e["status"] for e in ledger_entries(results_dir)] == ["failed"]
