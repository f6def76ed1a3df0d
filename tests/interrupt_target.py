"""Not collected by the suite (no ``test_`` prefix): the pytest session that
tests/test_run.py::test_a_signal_to_pytest_ends_the_session_and_the_run_is_interrupted interrupts.
The first test trains the digits demo in-process for far longer than the signal waits; the
second leaves a marker that must never appear."""

from __future__ import annotations

from conftest import QUIET


def test_train_until_interrupted(make_cfg, tmp_path):
    from vitexp.commands.train import train

    train(
        make_cfg([*QUIET, "recipe.epochs=500", "eval.throughput=false", "eval.flops=false"], tmp_path / "run")
    )
    raise AssertionError("the signal never came")


def test_second(tmp_path):
    (tmp_path.parent.parent / "marker_second_test_ran").write_text("the session went on")
