"""Same-host weight sync (UpdateWeightsShared, services/common/shared_weights.py) against real rollout
services on loopback: a `minite rollout` process on the CPU (one for the module), the learner's
RemoteRollout pushing through a /dev/shm arena; an in-process service where the served tensors can be
compared bit for bit; and a CUDA IPC push between two processes on one GPU (skipped without CUDA).

Checked: the served weights are bitwise the pushed ones (and never point into the learner's arena);
a generate after a shared push gives the same tokens and logprobs as after the same weights streamed
over gRPC, and as the learner's; a stale version is FAILED_PRECONDITION and the old version keeps
serving; a corrupted arena or manifest (checksum, shape, unknown name, bytes past the arena) is
INVALID_ARGUMENT naming the reason; an arena the replica cannot open is FAILED_PRECONDITION "shared weight
sync unavailable", after which the learner streams the version over gRPC (logged once); "auto" picks the
shared path for a loopback replica and gRPC for another host."""
from __future__ import annotations

import logging
import os
import threading

import grpc
import pytest
import torch

from minite.v1 import rollout_pb2 as pb
from minite.v1 import rollout_pb2_grpc as pb_grpc
from minite_core.engine import SamplingParams
from minite_core.nvfp4 import NVFP4Tensor
from services.common.metrics import LearnerMetrics
from services.common.settings import LearnerSettings
from services.common.shared_weights import Arena
from services.common.weights import SharedFrames, push_bytes
from services.learner.replicas import RemoteRollout, is_local
from tests.service_helpers import Proc, free_port, learner_on, new_weights, rollout_service

TOKEN = "shared-sync-token-5b1e"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
PROMPT = [1, 4, 5, 13, 6, 7, 14]  # <bos>12+34=
PARAMS = SamplingParams(max_tokens=6, seed=11, n=2)


def _remote(address: str, model_dir, mode: str) -> RemoteRollout:
    settings = LearnerSettings(model_dir=model_dir, rollout=[address], auth_token=TOKEN, weight_sync=mode)
    return RemoteRollout([address], settings, LearnerMetrics(), timeout=60)


def _close(rr: RemoteRollout) -> None:
    for rep in rr.replicas:
        rep.channel.close()
    rr.pool.shutdown(wait=False)


def _same(a, b) -> bool:
    if isinstance(a, NVFP4Tensor):
        return (isinstance(b, NVFP4Tensor) and a.shape == b.shape and torch.equal(a.data, b.data)
                and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
                and torch.equal(a.global_scale, b.global_scale))
    return a.dtype == b.dtype and torch.equal(a, b)


def _generate(rr: RemoteRollout):
    outs = rr.generate([PROMPT], PARAMS)
    return [(o.weight_version, o.token_ids, o.logprobs) for o in outs]


@pytest.fixture(scope="module")
def replica(service_model, tmp_path_factory):
    """A `minite rollout` process on the CPU (token required), its address and a stub."""
    tmp = tmp_path_factory.mktemp("shared-sync")
    g, h = free_port(), free_port()
    proc = Proc(["rollout", "--model-dir", str(service_model), "--grpc-port", str(g), "--http-port", str(h),
                 "--max-slots", "4"], tmp / "rollout.log", env={"MINITE_AUTH_TOKEN": TOKEN})
    ch = None
    try:
        proc.wait_http(f"http://127.0.0.1:{h}/health")
        ch = grpc.insecure_channel(f"127.0.0.1:{g}")
        yield {"proc": proc, "address": f"127.0.0.1:{g}", "stub": pb_grpc.RolloutServiceStub(ch)}
    finally:
        if ch is not None:
            ch.close()
        proc.kill()


def _version(replica) -> int:
    return replica["stub"].GetWeightVersion(pb.GetWeightVersionRequest(), timeout=10).version


def test_auto_picks_shared_on_loopback(service_model):
    assert is_local("127.0.0.1:50051") and is_local("localhost:50051") and is_local("[::1]:50051")
    assert not is_local("192.0.2.7:50051")  # TEST-NET-1: never an address of this host
    assert not is_local("no-such-host.invalid:50051")
    for mode, address, shared in [("auto", "127.0.0.1:1", True), ("auto", "192.0.2.7:1", False),
                                  ("grpc", "127.0.0.1:1", False), ("shared", "192.0.2.7:1", True)]:
        rr = _remote(address, service_model, mode)
        assert rr.replicas[0].shared is shared, (mode, address)
        _close(rr)


def test_served_weights_are_bitwise_the_pushed_ones(service_model):
    """In-process service (real gRPC on loopback) so the served tensors can be compared directly."""
    with rollout_service(service_model, auth_token=TOKEN) as (rt, address, _):
        rr = _remote(address, service_model, "auto")
        try:
            w = new_weights(service_model, seed=21)
            rr.update(w, 1)
            assert rr.replicas[0].shared and rt.version == 1
            served = rt.engine.model.w
            assert set(served) == set(w) and all(_same(w[n], served[n]) for n in w)
            lo = rr.arena.buf.data_ptr()
            hi = lo + rr.arena.buf.numel()
            for t in served.values():  # copies: nothing points into the learner's arena
                for p in ([t.data, t.scale, t.global_scale] if isinstance(t, NVFP4Tensor) else [t]):
                    assert not lo <= p.data_ptr() < hi
            assert rr.metrics.registry.get_sample_value("minite_weight_sync_bytes_total") == push_bytes(w)
        finally:
            _close(rr)


def test_shared_push_serves_what_the_stream_serves(replica, service_model):
    shared = _remote(replica["address"], service_model, "auto")
    streamed = _remote(replica["address"], service_model, "grpc")
    try:
        w, other = new_weights(service_model, seed=1), new_weights(service_model, seed=2)
        v = _version(replica)
        shared.update(w, v + 1)
        assert shared.replicas[0].shared and _version(replica) == v + 1
        got_shared = _generate(shared)
        streamed.update(other, v + 2)
        streamed.update(w, v + 3)
        got_stream = _generate(streamed)
        assert [g[0] for g in got_shared] == [v + 1] * 2 and [g[0] for g in got_stream] == [v + 3] * 2
        learner = learner_on(service_model, w)
        for (_, toks_a, lp_a), (_, toks_b, lp_b) in zip(got_shared, got_stream):
            assert toks_a == toks_b and torch.equal(lp_a, lp_b)
            assert torch.equal(lp_a, learner.logprobs(PROMPT, toks_a))
    finally:
        _close(shared)
        _close(streamed)


def test_stale_version_refused_old_keeps_serving(replica, service_model):
    rr = _remote(replica["address"], service_model, "auto")
    try:
        v = _version(replica)
        rr.update(new_weights(service_model, seed=3), v + 1)
        before = _generate(rr)
        stale = Arena()
        stale.write(new_weights(service_model, seed=4), v + 1)  # not newer than the serving v + 1
        with pytest.raises(grpc.RpcError) as e:
            replica["stub"].UpdateWeightsShared(stale.request(v + 1), metadata=AUTH, timeout=30)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"stale weight version {v + 1}: serving version {v + 1}" in e.value.details()
        assert _version(replica) == v + 1
        after = _generate(rr)
        assert [(a[0], a[1]) for a in after] == [(b[0], b[1]) for b in before]
        assert all(torch.equal(a[2], b[2]) for a, b in zip(after, before))
    finally:
        _close(rr)


def _corrupt(kind: str, req: pb.SharedUpdate, arena: Arena) -> None:
    t = next(t for t in req.tensors if t.format == "nvfp4")
    if kind == "checksum":  # the bytes in the arena, not what the manifest says
        arena.buf[t.parts[0].offset] ^= 0xFF
    elif kind == "shape":
        t.shape[0] += 1
    elif kind == "unknown":
        t.name = "model.layers.99.mlp.up_proj.weight"
    elif kind == "past_end":
        t.parts[0].offset = req.cpu.size
    elif kind == "missing_part":
        del t.parts[1]
    elif kind == "no_token":
        pass


@pytest.mark.parametrize("kind,code,words", [
    ("checksum", grpc.StatusCode.INVALID_ARGUMENT, "checksum mismatch"),
    ("shape", grpc.StatusCode.INVALID_ARGUMENT, "the model holds"),
    ("unknown", grpc.StatusCode.INVALID_ARGUMENT, "unknown tensor 'model.layers.99.mlp.up_proj.weight'"),
    ("past_end", grpc.StatusCode.INVALID_ARGUMENT, "run past the arena"),
    ("missing_part", grpc.StatusCode.INVALID_ARGUMENT, "missing"),
    ("no_token", grpc.StatusCode.UNAUTHENTICATED, "missing token"),
])
def test_corrupted_update_refused_with_reason(replica, service_model, kind, code, words):
    v = _version(replica)
    arena = Arena()
    arena.write(new_weights(service_model, seed=5), v + 1)
    req = arena.request(v + 1)
    _corrupt(kind, req, arena)
    with pytest.raises(grpc.RpcError) as e:
        replica["stub"].UpdateWeightsShared(req, metadata=() if kind == "no_token" else AUTH, timeout=30)
    assert e.value.code() == code, e.value.details()
    assert words in e.value.details()
    assert _version(replica) == v


def test_unopenable_arena_falls_back_to_grpc(replica, service_model, caplog):
    # the handle of a /dev/shm object that does not exist
    arena = Arena()
    arena.write(new_weights(service_model, seed=6), _version(replica) + 1)
    req = arena.request(arena.version)
    req.cpu.filename = b"/torch_minite_no_such_arena"
    with pytest.raises(grpc.RpcError) as e:
        replica["stub"].UpdateWeightsShared(req, metadata=AUTH, timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert e.value.details().startswith("shared weight sync unavailable: cannot map /torch_minite_no_such_arena")
    # the learner's own arena, its file gone from /dev/shm (moved aside; the learner's mapping stays valid):
    # the learner is refused, streams the version instead, and says so once
    rr = _remote(replica["address"], service_model, "shared")
    path = hidden = None
    try:
        v = _version(replica)
        w = new_weights(service_model, seed=7)
        rr.arena.write(w, v + 1)
        path = "/dev/shm" + rr.arena.cpu_handle[1].decode()
        hidden = path + ".moved"
        os.rename(path, hidden)
        with caplog.at_level(logging.WARNING, logger="minite.learner"):
            rr.update(w, v + 1)
            assert not rr.replicas[0].shared and _version(replica) == v + 1
            rr.update(new_weights(service_model, seed=8), v + 2)
        assert _version(replica) == v + 2 and rr.replicas[0].version == v + 2
        refusals = [r for r in caplog.records if "shared weight sync refused" in r.getMessage()]
        assert len(refusals) == 1 and "shared weight sync unavailable" in refusals[0].getMessage()
        assert "cannot map" in refusals[0].getMessage()
    finally:
        if hidden is not None and os.path.exists(hidden):
            os.rename(hidden, path)  # back, so that torch can unlink it when the arena is freed
        _close(rr)


def test_stream_fanout_frames_once_bounded():
    """SharedFrames: every stream gets every message, each framed once, held at most ~window at a time;
    a stream that leaves early holds nobody back."""
    made, peak = [], [0]
    frames = None

    def source():
        for i in range(200):
            made.append(i)
            peak[0] = max(peak[0], len(frames.buf))
            yield b"frame%d" % i

    frames = SharedFrames(source(), 3, window=4)
    got = [[], [], []]

    def consume(i, stop=None):
        for k, f in enumerate(frames.stream(i)):
            got[i].append(f)
            if k + 1 == stop:
                break
        frames.leave(i)

    threads = [threading.Thread(target=consume, args=(0,)), threading.Thread(target=consume, args=(1,)),
               threading.Thread(target=consume, args=(2, 10))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    want = [b"frame%d" % i for i in range(200)]
    assert got[0] == got[1] == want and got[2] == want[:10]
    assert made == list(range(200)) and peak[0] <= 5


def test_two_streamed_replicas_share_the_frames(service_model):
    with rollout_service(service_model, auth_token=TOKEN) as (rt_a, addr_a, _), \
            rollout_service(service_model, auth_token=TOKEN) as (rt_b, addr_b, _):
        settings = LearnerSettings(model_dir=service_model, auth_token=TOKEN, weight_sync="grpc")
        rr = RemoteRollout([addr_a, addr_b], settings, LearnerMetrics(), timeout=60)
        try:
            w = new_weights(service_model, seed=12)
            rr.update(w, 1)
            for rt in (rt_a, rt_b):
                assert rt.version == 1 and all(_same(w[n], rt.engine.model.w[n]) for n in w)
        finally:
            _close(rr)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_push_between_two_processes(service_model, tmp_path):
    g, h = free_port(), free_port()
    proc = Proc(["rollout", "--model-dir", str(service_model), "--grpc-port", str(g), "--http-port", str(h),
                 "--max-slots", "4", "--device", "cuda"], tmp_path / "rollout.log", env={"MINITE_AUTH_TOKEN": TOKEN})
    shared = streamed = None
    try:
        proc.wait_http(f"http://127.0.0.1:{h}/health", timeout=300)
        address = f"127.0.0.1:{g}"
        shared = _remote(address, service_model, "shared")
        streamed = _remote(address, service_model, "grpc")
        w = {n: t.to("cuda") for n, t in new_weights(service_model, seed=9).items()}
        shared.update(w, 1)
        assert shared.replicas[0].shared, proc.text()[-2000:]
        assert shared.arena.buf.is_cuda and shared.replicas[0].version == 1
        got_shared = _generate(shared)
        streamed.update({n: t.to("cuda") for n, t in new_weights(service_model, seed=10).items()}, 2)
        streamed.update(w, 3)
        got_stream = _generate(streamed)
        for (va, toks_a, lp_a), (vb, toks_b, lp_b) in zip(got_shared, got_stream):
            assert (va, vb) == (1, 3) and toks_a == toks_b and torch.equal(lp_a, lp_b)
        # a corrupted CUDA arena is refused by its checksum
        shared.arena.write(w, 4)
        shared.arena.buf[shared.arena.tensors[0].parts[0].offset] ^= 0xFF
        torch.cuda.synchronize()
        with pytest.raises(grpc.RpcError) as e:
            shared.replicas[0].stub.UpdateWeightsShared(shared.arena.request(4), metadata=AUTH, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "checksum mismatch" in e.value.details()
    finally:
        for rr in (shared, streamed):
            if rr is not None:
                _close(rr)
        proc.kill()
