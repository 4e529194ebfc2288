"""Starting the services in-process for tests: the real gRPC server and the real uvicorn HTTP server on
loopback ports picked by the OS, around the same runtimes `minite rollout|learner` run."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
import time

import pytest
import torch
import uvicorn

from minite_core import ops
from minite_core.model import load_model
from minite_core.nvfp4 import NVFP4Tensor


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
