"""Starting the services in-process for tests: the real gRPC server and the real uvicorn HTTP server on
loopback ports picked by the OS, around the same runtimes `minite rollout|learner` run."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn

from minite_core import ops
from minite_core.model import load_model
from minite_core.nvfp4 import NVFP4Tensor


ROOT = Path(__file__).resolve().parents[1]
# The token of the services tests/serve/conftest.py shares between the refusal suites.
TOKEN = "bad-input-token-5b1e"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
MAX_WAITING = 8  # that rollout's queue bound
TOOL_PACKAGE = {"docker-compose": "docker-compose", "promtool": "prometheus", "prometheus": "prometheus"}


def system_tool(name: str) -> str:
    """Path of a system binary; skip the test when it is missing, or fail under MINITE_REQUIRE_SYSTEM_TOOLS=1
    (CI sets it: there these tests must run)."""
    path = shutil.which(name)
    if path:
        return path
    msg = f"{name} is not installed (Debian: apt-get install {TOOL_PACKAGE.get(name, name)})"
    if os.environ.get("MINITE_REQUIRE_SYSTEM_TOOLS") == "1":
        pytest.fail(f"{msg}; MINITE_REQUIRE_SYSTEM_TOOLS=1 requires it")
    pytest.skip(msg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def http_server(app):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(10)


@contextlib.contextmanager
def _serving(rt, start_grpc, build_app):
    """Run a service's gRPC server and HTTP app around its runtime -> (runtime, grpc address, http url)."""
    server, port, _ = start_grpc(rt.settings, rt)
    try:
        with http_server(build_app(rt)) as url:
            yield rt, f"127.0.0.1:{port}", url
    finally:
        server.stop(0).wait()
        rt.stop()


@contextlib.contextmanager
def rollout_service(model_dir, **overrides):
    """(runtime, grpc address, http base url) of a rollout service on loopback."""
    from services.common.settings import RolloutSettings
    from services.rollout.main import start_grpc
    from services.rollout.rest import build_app
    from services.rollout.runtime import RolloutRuntime

    with _serving(RolloutRuntime(RolloutSettings(model_dir=model_dir, grpc_port=0, **overrides)), start_grpc, build_app) as s:
        yield s


def new_weights(model_dir, seed: int, precision: str = "nvfp4") -> dict:
    """A different weight set for the same model (masters perturbed, then quantized as the learner does)."""
    fp32 = load_model(model_dir, precision="fp32")
    ref = load_model(model_dir, precision=precision)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, w in fp32.w.items():
        m = w + 0.02 * torch.randn(w.shape, generator=g)
        out[n] = ops.quantize(m, scale_mode="tensor") if isinstance(ref.w[n], NVFP4Tensor) else m.to(ref.dtype)
    return out


def learner_on(model_dir, weights: dict | None = None, precision: str = "nvfp4"):
    from minite_core.engine import Learner

    model = load_model(model_dir, precision=precision)
    if weights is not None:
        model.w = dict(weights)
    return Learner(model)


@contextlib.contextmanager
def learner_service(model_dir, rollout_address: str, **overrides):
    """(runtime, grpc address, http base url) of a learner service on loopback (its loop not started)."""
    from services.common.settings import LearnerSettings
    from services.learner.main import start_grpc
    from services.learner.rest import build_app
    from services.learner.runtime import LearnerRuntime

    settings = LearnerSettings(model_dir=model_dir, grpc_port=0, rollout=[rollout_address], **overrides)
    with _serving(LearnerRuntime(settings), start_grpc, build_app) as s:
        yield s


def error_message(response) -> str:
    """The message of an OpenAI-style JSON error body (`{"error": {"message": ...}}`), or "" when there is none."""
    try:
        body = response.json()
    except ValueError:
        return ""
    err = body.get("error") if isinstance(body, dict) else None
    return err.get("message", "") if isinstance(err, dict) else ""


def report(scenario: str, **figures) -> None:
    print("RELIABILITY: " + scenario + " " + " ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


class Proc:
    """One `python -m minite_core.cli ...` process, its output in a log file."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        self.log_path = log
        self.log = log.open("w")
        self.p = subprocess.Popen([sys.executable, "-m", "minite_core.cli", *args], stdout=self.log,
                                  stderr=subprocess.STDOUT, env=dict(os.environ, **(env or {})), cwd=ROOT)
        self.pid = self.p.pid

    def text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_http(self, url: str, timeout: float = 120.0, verify=True) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.p.poll() is not None:
                raise AssertionError(f"{url}: process exited {self.p.returncode}:\n{self.text()[-3000:]}")
            try:
                if httpx.get(url, timeout=2, verify=verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{url} not up after {timeout} s:\n{self.text()[-3000:]}")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def terminate(self, timeout: float) -> tuple[int | None, float]:
        """SIGTERM; -> (exit code or None if still running after `timeout` s, seconds to exit)."""
        t0 = time.monotonic()
        self.p.send_signal(signal.SIGTERM)
        try:
            return self.p.wait(timeout), time.monotonic() - t0
        except subprocess.TimeoutExpired:
            return None, time.monotonic() - t0

    def kill(self) -> None:
        if self.p.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)  # (a test may have stopped it)
            except ProcessLookupError:
                pass
            self.p.kill()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.log.close()


def wait_for(cond, timeout: float, what: str, procs=(), every: float = 0.02):
    """Poll cond() until it returns something true (returned); AssertionError naming `what` after `timeout`
    s, or at once, with its log, when one of `procs` (Proc) exits meanwhile."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for p in procs:
            if p.p.poll() is not None:
                raise AssertionError(f"process exited {p.p.returncode} while waiting for {what}:\n{p.text()[-3000:]}")
        v = cond()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
