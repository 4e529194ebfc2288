"""What a careless operator runs into (issue 17, defects 2, 3, 6 and 8), on real processes over loopback:

- an empty or blank MINITE_AUTH_TOKEN is an error at start (exit 2, a message), not "no auth"; with no token
  at all a service warns at start and refuses a non-loopback address unless --insecure; the learner's
  /v1/control checks the token before it reads the body, /v1/score needs it too, and the Bearer scheme
  is case-insensitive (RFC 7235);
- a second rollout on a gRPC port in use fails to start ("port is in use") instead of sharing the port;
- SIGTERM, SIGINT or SIGKILL to `minite up` leaves no rollout, learner or Prometheus behind;
- two learners (or two `minite up`) on one run directory: the second refuses at start, naming the first's pid;
- a truncated or emptied latest checkpoint: the run warns, names the file, falls back to the previous
  checkpoint and ends with the same bits as an uninterrupted run; with no readable checkpoint it exits 2
  naming the files, no traceback.

Each scenario prints one line "RELIABILITY: <scenario> key=value ..." (`pytest -s` shows them).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from services.common.rpc import token_ok
from tests.service_helpers import free_port, report

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "operator-safety-token-1f3a"


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MINITE_AUTH_TOKEN"}
    return {**env, "OMP_NUM_THREADS": "1", **kw}


def _cli(*args, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minite_core.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env or _env(), cwd=ROOT)


def _start(args, log, env, timeout=60) -> subprocess.Popen:
    """A service process; returns once it printed its ready line (or exited)."""
    p = subprocess.Popen([sys.executable, "-m", "minite_core.cli", *map(str, args)], stdout=log.open("w"),
                         stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout and p.poll() is None and "ready" not in log.read_text():
        time.sleep(0.1)
    return p


def _stop(*procs) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


# -- auth -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("service", ["rollout", "learner", "up"])
@pytest.mark.parametrize("token", ["", "  "], ids=["empty", "blank"])
def test_an_empty_token_is_an_error_at_start(service_model, tmp_path, service, token):
    t0 = time.monotonic()
    r = _cli(service, "--model-dir", service_model, "--run-dir" if service != "rollout" else "--log-level",
             tmp_path / "run" if service != "rollout" else "info", env=_env(MINITE_AUTH_TOKEN=token), timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 2 and "empty or blank" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    report("empty_token", service=service, token=repr(token), exit_code=r.returncode, seconds=f"{took:.1f}")


def test_no_token_warns_and_refuses_a_public_address_unless_insecure(service_model, tmp_path):
    g, h = free_port(), free_port()
    r = _cli("rollout", "--model-dir", service_model, "--host", "0.0.0.0", "--grpc-port", g, "--http-port", h)
    assert r.returncode == 2 and "not a loopback address" in r.stderr and "--insecure" in r.stderr, r.stderr[-2000:]
    p = _start(["rollout", "--model-dir", service_model, "--host", "0.0.0.0", "--insecure", "--grpc-port", g,
                "--http-port", h], tmp_path / "open.log", _env())
    try:
        text = (tmp_path / "open.log").read_text()
        assert p.poll() is None and "ready" in text, text[-2000:]
        assert "WARNING" in text and "no auth token" in text and "(--insecure)" in text
    finally:
        _stop(p)
    report("no_token", public_without_insecure="exit 2", public_with_insecure="serves, warns")


def test_bearer_scheme_is_case_insensitive():
    for header in ("Bearer t0k", "bearer t0k", "BEARER t0k", "  Bearer   t0k "):
        assert token_ok("t0k", header), header
    for header in (None, "", "Basic t0k", "Bearer", "Bearer t0kx", "t0k"):
        assert not token_ok("t0k", header), header


@pytest.fixture(scope="module")
def learner(service_model, tmp_path_factory):
    """A rollout and a learner with a token (the learner trains nothing: --steps 0)."""
    tmp = tmp_path_factory.mktemp("learner")
    rg, rh, lg, lh = (free_port() for _ in range(4))
    env = _env(MINITE_AUTH_TOKEN=TOKEN)
    rollout = _start(["rollout", "--model-dir", service_model, "--grpc-port", rg, "--http-port", rh],
                     tmp / "rollout.log", env)
    learner = _start(["learner", "--model-dir", service_model, "--rollout", f"127.0.0.1:{rg}", "--grpc-port", lg,
                      "--http-port", lh, "--run-dir", tmp / "run", "--steps", "0"], tmp / "learner.log", env,
                     timeout=120)
    assert learner.poll() is None, (tmp / "learner.log").read_text()[-3000:]
    yield f"http://127.0.0.1:{lh}"
    _stop(learner, rollout)


def test_control_checks_the_token_before_the_body(learner):
    garbage = {"content": b"\x00not json" * 100, "headers": {"content-type": "text/plain"}}
    r = httpx.post(f"{learner}/v1/control", timeout=10, **garbage)
    assert r.status_code == 401, r.text  # not 415 / 400: nothing was parsed for a client without the token
    r = httpx.post(f"{learner}/v1/control", timeout=10, **{**garbage, "headers": {
        "content-type": "text/plain", "authorization": f"bearer {TOKEN}"}})
    assert r.status_code == 415, r.text  # the token (lower-case scheme) passes; then the body is checked
    r = httpx.post(f"{learner}/v1/control", json={"action": "pause"}, headers={"Authorization": f"BEARER {TOKEN}"},
                   timeout=10)
    assert r.status_code == 200 and r.json()["paused"] is True, r.text
    r = httpx.post(f"{learner}/v1/control", json={"action": "jump"}, headers={"Authorization": f"Bearer {TOKEN}"},
                   timeout=10)
    assert r.status_code == 400 and "action" in r.json()["error"]["message"], r.text


def test_score_needs_the_token(learner):
    body = {"prompt_ids": [1, 4, 13, 5, 14], "completion_ids": [6, 2]}
    assert httpx.post(f"{learner}/v1/score", json=body, timeout=30).status_code == 401
    r = httpx.post(f"{learner}/v1/score", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 200 and len(r.json()["logprobs"]) == 2, r.text
    garbage = {"content": b"\x00not json" * 100, "headers": {"content-type": "text/plain"}}
    r = httpx.post(f"{learner}/v1/score", timeout=10, **garbage)
    assert r.status_code == 401, r.text  # checked before the body is read: not 415


def test_learner_bodies_over_the_limit_are_413_before_they_are_read(learner):
    big = b'{"prompt_ids": [' + b"1, " * (3 << 20) + b'1], "completion_ids": [2]}'  # ~9 MiB > --max-body-mb 8
    for path in ("/v1/score", "/v1/control"):
        r = httpx.post(f"{learner}{path}", content=big, headers={"content-type": "application/json",
                                                                  "authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert r.status_code == 413 and "max-body-mb" in r.json()["error"]["message"], r.text
        r = httpx.post(f"{learner}{path}", content=big, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 401, r.text  # without the token: refused before the size matters


# -- ports ----------------------------------------------------------------------------------------------------

def test_a_second_rollout_on_a_used_grpc_port_fails_to_start(service_model, tmp_path):
    g = free_port()
    first = _start(["rollout", "--model-dir", service_model, "--grpc-port", g, "--http-port", free_port()],
                   tmp_path / "first.log", _env())
    try:
        assert first.poll() is None
        t0 = time.monotonic()
        r = _cli("rollout", "--model-dir", service_model, "--grpc-port", g, "--http-port", free_port(), timeout=60)
        assert r.returncode != 0 and "port is in use" in (r.stdout + r.stderr), (r.stdout + r.stderr)[-2000:]
        assert "Traceback" not in r.stderr
        report("port_in_use", second_rollout_exit=r.returncode, seconds=f"{time.monotonic() - t0:.1f}",
               first_still_serving=first.poll() is None)
    finally:
        _stop(first)


# -- minite up and the run directory ---------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in (Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0])
    except (OSError, IndexError):
        return False


def _up(service_model, run_dir, log) -> subprocess.Popen:
    """`minite up` started as a script's background job (`minite up &`) starts: with SIGINT ignored, which
    Python leaves ignored unless the program installs a handler (`sh`'s trap, then exec: the pid stays up's)."""
    ports = [free_port() for _ in range(4)]
    p = subprocess.Popen(["/bin/sh", "-c", 'trap "" INT; exec "$0" "$@"',
                          sys.executable, "-m", "minite_core.cli", "up", "--model-dir", str(service_model),
                          "--run-dir", str(run_dir), "--steps", "10000", "--no-prometheus", "--rollout-grpc-port",
                          str(ports[0]), "--rollout-http-port", str(ports[1]), "--learner-grpc-port", str(ports[2]),
                          "--learner-http-port", str(ports[3])], stdout=log.open("w"), stderr=subprocess.STDOUT,
                         env=_env(), cwd=ROOT)
    t0 = time.monotonic()
    while "training 10000 GRPO steps" not in log.read_text():
        assert p.poll() is None and time.monotonic() - t0 < 120, log.read_text()[-3000:]
        time.sleep(0.2)
    return p


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["TERM", "INT", "KILL"])
def test_signals_to_up_stop_its_whole_tree(service_model, tmp_path, sig):
    up = _up(service_model, tmp_path / "up", tmp_path / "up.log")
    children = _children(up.pid)
    assert len(children) == 2, children  # the rollout and the learner
    t0 = time.monotonic()
    up.send_signal(sig)
    try:
        up.wait(60)
        while any(_alive(c) for c in children) and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        gone = time.monotonic() - t0
        left = [c for c in children if _alive(c)]
    finally:
        for c in children:
            if _alive(c):
                os.kill(c, signal.SIGKILL)
    assert not left, f"{signal.Signals(sig).name} to minite up left {left} running"
    report("up_signal", signal=signal.Signals(sig).name, up_exit=up.returncode, children=len(children),
           all_gone_s=f"{gone:.1f}")


def test_a_second_run_on_the_same_run_dir_refuses_at_start(service_model, tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "minite_core.cli", "train", "--model-dir", str(service_model),
                              "--run-dir", str(run_dir), "--steps", "10000"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=_env(), cwd=ROOT)
    try:
        t0 = time.monotonic()
        while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text():
            assert first.poll() is None and time.monotonic() - t0 < 120
            time.sleep(0.2)
        r = _cli("train", "--model-dir", service_model, "--run-dir", run_dir, "--steps", "1")
        assert r.returncode == 2 and f"in use by another run (pid {first.pid})" in r.stderr, r.stderr[-2000:]
        ports = [free_port() for _ in range(4)]
        learner = _cli("learner", "--model-dir", service_model, "--run-dir", run_dir, "--rollout", "127.0.0.1:1",
                       "--grpc-port", ports[0], "--http-port", ports[1])
        assert learner.returncode == 2 and "in use by another run" in learner.stderr, learner.stderr[-2000:]
        assert first.poll() is None  # the first run goes on
    finally:
        _stop(first)
    up_dir = tmp_path / "up"
    up = _up(service_model, up_dir, tmp_path / "up.log")
    try:
        r = _cli("up", "--model-dir", service_model, "--run-dir", up_dir, "--steps", "1", "--no-prometheus")
        assert r.returncode == 2 and "in use by another run" in r.stderr, r.stderr[-2000:]
        assert (up_dir / "learner" / "metrics.jsonl").exists()  # the second `up` did not delete the first's run
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)
    report("run_dir_lock", second_train="exit 2", second_learner="exit 2", second_up="exit 2")


# -- checkpoints ----------------------------------------------------------------------------------------------

def _train(model, run_dir, *extra):
    r = _cli("train", "--model-dir", model, "--run-dir", run_dir, "--checkpoint-every", "2", "--prompts-per-step", "4",
             "--num-generations", "4", *extra, timeout=300)
    return r


@pytest.mark.parametrize("damage", ["truncated", "empty-json"])
def test_an_unreadable_latest_checkpoint_falls_back_to_the_previous_one(service_model, tmp_path, damage):
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert _train(service_model, ref, "--steps", "6").returncode == 0
    assert _train(service_model, run, "--steps", "4").returncode == 0  # checkpoints at steps 2 (prev) and 4
    assert json.loads((run / "checkpoint.prev" / "trainer.json").read_text())["step"] == 2
    if damage == "truncated":
        bad = run / "checkpoint" / "trainer.safetensors"
        bad.write_bytes(bad.read_bytes()[:1000])
    else:
        bad = run / "checkpoint" / "trainer.json"
        bad.write_text("")
    r = _train(service_model, run, "--steps", "6", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert str(bad) in r.stderr and "trying the checkpoint before it" in r.stderr and "Traceback" not in r.stderr
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5, 6] and [m["replayed"] for m in rows[2:4]] == [True, True]
    a, b = (load_file(str(d / "checkpoint" / "trainer.safetensors")) for d in (ref, run))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    report("checkpoint_fallback", damage=damage, resumed_from_step=2, replayed_steps="3,4", same_bits=True)


def test_no_readable_checkpoint_is_one_message(service_model, tmp_path):
    run = tmp_path / "run"
    assert _train(service_model, run, "--steps", "4").returncode == 0
    for d in ("checkpoint", "checkpoint.prev"):
        (run / d / "trainer.json").write_text("{")
    r = _train(service_model, run, "--steps", "6", "--resume")
    assert r.returncode == 2 and "no checkpoint of this run can be read" in r.stderr, r.stderr[-2000:]
    assert str(run / "checkpoint" / "trainer.json") in r.stderr and "Traceback" not in r.stderr
