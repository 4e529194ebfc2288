"""`minite train` stopped by a signal (minite_core/cli.py `_stop_on_signals`, the loop's `stop`), as real processes.

A script's background job (`minite train ... &`) starts with SIGINT ignored; the run still answers Ctrl-C / kill
-INT: the first SIGINT or SIGTERM ends the run after the step in progress, checkpoints it (exit 128 + signal, a
message naming the step and the checkpoint, no traceback), and `--resume` continues from there; a second SIGINT
stops at once (exit 130).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--prompts-per-step", "2", "--num-generations", "2", "--checkpoint-every", "1000"]


def _train(model, run_dir, *extra) -> list[str]:
    return [sys.executable, "-m", "minite_core.cli", "train", "--model-dir", str(model), "--run-dir", str(run_dir),
            *ARGS, *extra]


def _start_in_background(cmd, log) -> subprocess.Popen:
    """As `sh` starts a background job: SIGINT ignored, then exec (the pid stays the run's)."""
    return subprocess.Popen(["/bin/sh", "-c", 'trap "" INT; exec "$0" "$@"', *cmd], stdout=subprocess.DEVNULL,
                            stderr=log.open("w"), env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)


def _wait_for_steps(p, metrics, n: int, log) -> None:
    t0 = time.monotonic()
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
        assert p.poll() is None and time.monotonic() - t0 < 240, log.read_text()[-3000:]
        time.sleep(0.1)


def _steps(metrics) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_a_signal_ends_train_after_its_step_with_a_checkpoint_to_resume_from(service_model, tmp_path, sig):
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    p = _start_in_background(_train(service_model, run_dir, "--steps", "1000"), log)
    _wait_for_steps(p, run_dir / "metrics.jsonl", 1, log)
    p.send_signal(sig)
    assert p.wait(120) == 128 + sig, log.read_text()[-3000:]
    err = log.read_text()
    assert "Traceback" not in err and "stopping after the step in progress" in err, err[-3000:]
    done = _steps(run_dir / "metrics.jsonl")
    assert done == list(range(1, len(done) + 1)) and len(done) < 1000
    assert f"stopped after step {done[-1]} of 1000" in err
    meta = json.loads((run_dir / "checkpoint" / "trainer.json").read_text())
    assert meta["step"] == done[-1]  # checkpointed at the stop, though --checkpoint-every is 1000

    r = subprocess.run(_train(service_model, run_dir, "--steps", str(done[-1] + 1), "--resume"), capture_output=True,
                       text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _steps(run_dir / "metrics.jsonl") == done + [done[-1] + 1]  # continued after the stop, nothing replayed


def test_a_second_sigint_stops_train_at_once(service_model, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    # (larger steps than above: the second signal must come while a step runs, after the first was handled —
    # two SIGINTs sent back to back merge into one pending signal)
    p = _start_in_background(_train(service_model, run_dir, "--steps", "1000", "--prompts-per-step", "32",
                                    "--num-generations", "8"), log)
    _wait_for_steps(p, run_dir / "metrics.jsonl", 1, log)
    p.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    while "stopping after the step in progress" not in log.read_text():
        assert time.monotonic() - t0 < 60, log.read_text()[-3000:]
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    assert p.wait(120) == 130, log.read_text()[-3000:]
    err = log.read_text()
    assert "Traceback" not in err and "interrupted" in err, err[-3000:]
