"""Where the demo's time goes: ``vitexp-train`` (the digits demo, results in a scratch folder)
sampled by py-spy (``pip install py-spy``) at 100 Hz, then every main-thread sample put in one
stage by the frames on its stack. Prints a Markdown table (seconds and share of the sampled main
thread) for docs/measurements.md.

    python scripts/profile_demo.py [overrides for vitexp-train]

Stages, first match wins: inside ``Trainer.fit``: checkpoint I/O (``save_checkpoint``), logging
(the logger's calls, W&B), validation (Lightning's evaluation loop), training steps (forward,
backward, optimiser: Lightning's automatic optimisation), data loading (the fetchers), the
progress bar, the rest of the loop; after it: the test, the FLOPs count, the throughput timing;
before it: imports, composition and building (``other``). Samples of W&B's and tqdm's own threads
are left out: they wait, or run beside the main thread.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

RATE = 100
#: (stage, substrings of the stack, any of which puts a sample in it), in order.
STAGES = [
    ("fit: checkpoint I/O", ("save_checkpoint", "ModelCheckpoint")),
    ("fit: logging", ("log_metrics", "wandb", "WandbLogger", "_LoggerConnector")),
    ("fit: validation", ("_EvaluationLoop",)),
    ("fit: training steps (forward, backward, optimiser)", ("_AutomaticOptimization.run",)),
    ("fit: data loading", ("_DataFetcher", "fetchers")),
    ("fit: progress bar", ("tqdm", "ProgressBar")),
]


def stage(stack: str) -> str:
    if "Trainer.fit" in stack:
        return next(
            (name for name, keys in STAGES if any(k in stack for k in keys)), "fit: the rest of the loop"
        )
    if "Trainer.test" in stack:
        return "test"
    if "count_macs" in stack or "flop" in stack.lower():
        return "FLOPs count"
    if "throughput" in stack.lower():
        return "throughput timing"
    if "import" in stack or "<frozen" in stack:
        return "imports"
    return "other (composition, building, ledger, logger start and end)"


def main(argv: list[str]) -> int:
    if shutil.which("py-spy") is None:
        print("profile_demo: py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="vitexp-demo-profile-"))
    try:
        raw = scratch / "demo.raw"
        command = [
            "py-spy",
            "record",
            "-r",
            str(RATE),
            "-f",
            "raw",
            "-o",
            str(raw),
            "--",
            sys.executable,
            "-m",
            "vitexp.commands.cli",
            "train",
            *argv,
            f"hydra.run.dir={scratch / 'outputs'}",
        ]
        env = {**os.environ, "VITEXP_RESULTS": str(scratch / "results")}
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return done.returncode
        seconds: collections.Counter[str] = collections.Counter()
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if stack.split(";", 1)[0].startswith(("<module> (", "_run_module_as_main (")):  # the main thread
                seconds[stage(stack)] += int(count) / RATE
        closing = next((line for line in reversed(done.stdout.splitlines()) if line.startswith("{")), "none")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    total = sum(seconds.values())
    print(f"main thread sampled: {total:.1f} s at {RATE} Hz; the demo's closing line: {closing}\n")
    print("| stage | seconds | share |\n|---|---|---|")
    for name, s in seconds.most_common():
        print(f"| {name} | {s:.1f} | {100 * s / total:.1f} % |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
