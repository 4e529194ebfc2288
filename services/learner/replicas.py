"""The learner's view of its rollout replicas: generation spread across them and weight versions
fanned out to all of them, over gRPC.

`generate` splits the prompts round-robin over the healthy replicas and calls Generate concurrently,
at most `MAX_IN_FLIGHT` requests per replica (a replica's queue is bounded: more would be refused), and
retries a call the replica refused as overloaded after a short back-off; `update` pushes a weight version to every replica at once. A
replica that is down is reported and retried on the next call; with no replica reachable, calls raise
ReplicaError and the learner loop waits and reports instead of crashing.

Weight sync (`weight_sync`): a replica on this host (auto: its address is loopback or one of this host's
addresses; shared: every replica) gets UpdateWeightsShared: the version is written once into the
learner's shared-memory arena (services/common/shared_weights.py: /dev/shm, or CUDA IPC when the weights
are on a GPU) and each such replica copies it out. A replica that answers "shared weight sync
unavailable" (another host, another container, a GPU it does not see) or does not know the RPC is
streamed to instead, from then on (logged once). The others get the gRPC stream; with several of them
the chunks are framed once per version and every stream sends the same frames (weights.SharedFrames:
memory bounded by a window of chunks, not by N).

Versions: the learner pushes above the highest version a replica serves (a restarted learner must not push
"stale" versions), but only from plausible ones: a replica that reports a version at or above MAX_VERSION
(2^53, the largest a replica accepts; only an older or forged replica can be there) could never take a newer
push, and following it would overflow the learner's version. Such a replica is reported broken (Status,
the log) and left out of generation, of the version floor and of pushes; the others go on, and with none
left the learner waits and reports (ReplicaError) rather than jumping its version. It is taken back once it
reports a sane version again (restarted).
"""
from __future__ import annotations

import collections
import ipaddress
import logging
import socket
import threading
import time
from concurrent import futures

import grpc
import torch

from minite.v1 import rollout_pb2 as pb
from minite.v1 import rollout_pb2_grpc as pb_grpc
from minite_core.engine import Completion, SamplingParams

from ..common import rpc
from ..common.shared_weights import UNAVAILABLE, Arena
from ..common.weights import MAX_VERSION, SharedFrames, encode_update, raw_update_call

log = logging.getLogger("minite.learner")
MAX_IN_FLIGHT = 8  # Generate calls per replica at once


def is_local(address: str) -> bool:
    """Is a host:port (or unix:path) address on this host? Loopback, or an address this host can bind."""
    if address.startswith("unix:"):
        return True
    host = address.rpartition(":")[0].strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            if ipaddress.ip_address(sockaddr[0]).is_loopback:
                return True
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.bind((sockaddr[0], 0))  # only an address of one of this host's interfaces binds
            return True
        except (OSError, ValueError):
            continue
    return False


def _shared_unavailable(e: grpc.RpcError) -> bool:
    return e.code() == grpc.StatusCode.UNIMPLEMENTED or (
        e.code() == grpc.StatusCode.FAILED_PRECONDITION and (e.details() or "").startswith(UNAVAILABLE))


class ReplicaError(RuntimeError):
    """No rollout replica could serve the call."""


class NewerVersion(ReplicaError):
    """Replicas serve a version above the learner's (it restarted): it must re-sync above them."""


class Replica:
    def __init__(self, address: str, settings):
        self.address = address
        self.channel = rpc.channel(address, settings)
        self.stub = pb_grpc.RolloutServiceStub(self.channel)
        self.update_weights = raw_update_call(self.channel)
        mode = getattr(settings, "weight_sync", "grpc")
        self.shared = mode == "shared" or (mode == "auto" and is_local(address))  # try the shared arena
        self.version = None  # the version this replica was last seen to serve
        self.healthy = True
        self.broken = None  # why the learner cannot use it (an absurd weight version), or None
        self.slots = threading.BoundedSemaphore(MAX_IN_FLIGHT)


class RemoteRollout:
    def __init__(self, addresses: list[str], settings, metrics, *, timeout: float = 120.0):
        if not addresses:
            raise ValueError("the learner needs at least one rollout replica (--rollout host:port)")
        self.settings, self.metrics, self.timeout = settings, metrics, timeout
        self.replicas = [Replica(a, settings) for a in addresses]
        self.pool = futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="replica")
        self.chunk_bytes = int(settings.chunk_mb * (1 << 20))
        self.weights = None  # the latest version, kept to re-push to a replica that comes back
        self.version = 0
        # recent versions (version -> weights), for scoring a completion sampled before the last push
        self.history: collections.OrderedDict[int, dict] = collections.OrderedDict()
        self.keep_versions = settings.keep_versions
        self.lock = threading.Lock()
        self.arena = Arena()  # one shared-memory arena for every replica on this host, reused across versions
        self.sync_lock = threading.Lock()  # one fan-out at a time: the arena holds one version

    # -- generation -----------------------------------------------------------------------------
    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Prompt r sampled with params[r] (the Trainer gives each prompt its own seed), or all with one
        SamplingParams (as RolloutEngine.generate), on the live replicas."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        live = self.live()
        calls = []
        for r, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            rep = live[r % len(live)]
            req = pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=prompt), params=pb.SamplingParams(
                max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                seed=p.seed, stop_token_ids=list(p.stop_token_ids), n=p.n))
            calls.append((r, rep, self.pool.submit(self._generate_one, rep, req)))
        out = []
        for r, rep, fut in calls:
            try:
                resp = fut.result()
            except grpc.RpcError as e:
                rep.healthy = False
                raise ReplicaError(f"rollout {rep.address}: Generate failed: {e.code().name} {e.details()}") from None
            for c in resp.choices:
                out.append(Completion(list(resp.prompt_ids), list(c.token_ids), torch.tensor(list(c.logprobs), dtype=torch.float32),
                                      c.finish_reason, c.weight_version, r, c.index))
        return out

    def _generate_one(self, rep: Replica, req) -> pb.GenerateResponse:
        deadline = time.monotonic() + self.timeout
        with rep.slots:
            while True:
                try:
                    return rep.stub.Generate(req, timeout=max(deadline - time.monotonic(), 0.001))
                except grpc.RpcError as e:  # overloaded is not down: wait, retry within the deadline
                    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline - 0.2:
                        raise
                    time.sleep(0.1)

    def _sane(self, rep: Replica, v: int) -> bool:
        """Is `v` a version this replica can serve and still take a newer one? Else mark it broken (logged once)."""
        if v < MAX_VERSION:
            if rep.broken:
                log.info("rollout %s reports version %d again: no longer broken", rep.address, v)
            rep.broken = None
            return True
        if rep.broken is None:
            log.error("rollout %s serves weight version %d, at or above the largest valid version %d: it can take no "
                      "newer push; left out until it is restarted", rep.address, v, MAX_VERSION)
        rep.broken = f"serves weight version {v}, at or above the largest valid {MAX_VERSION}: restart it"
        rep.healthy = False
        return False

    def version_floor(self) -> int:
        """The highest version any replica serves (0 when none answers); replicas serving an absurd version
        (>= MAX_VERSION) are left out (and reported broken): following them would overflow the version."""
        floor = 0
        for rep in self.replicas:
            try:
                v = rep.stub.GetWeightVersion(pb.GetWeightVersionRequest(), timeout=5).version
            except grpc.RpcError:
                continue
            if self._sane(rep, v):
                floor = max(floor, v)
        return floor

    def live(self) -> list[Replica]:
        """Replicas that answer, each brought to the current weight version first."""
        live, newer = [], False
        for rep in self.replicas:
            try:
                v = rep.stub.GetWeightVersion(pb.GetWeightVersionRequest(), timeout=5).version
            except grpc.RpcError as e:
                if rep.healthy:
                    log.warning("rollout %s is not answering (%s)", rep.address, e.code().name)
                rep.healthy = False
                continue
            if not self._sane(rep, v):
                continue
            if v > self.version:  # newer than ours: another learner pushed; sampling here would be off-policy
                log.warning("rollout %s serves version %d, newer than the learner's %d: skipped", rep.address, v, self.version)
                rep.healthy, newer = False, True
                continue
            if self.weights is not None and v != self.version:
                log.warning("rollout %s serves version %d, the learner is at %d: re-pushing", rep.address, v, self.version)
                try:
                    with self.sync_lock:
                        self._push(rep, self.weights, self.version)
                except grpc.RpcError as e:
                    log.warning("re-push to %s failed: %s", rep.address, e.details())
                    rep.healthy = False
                    continue
            if not rep.healthy:
                log.info("rollout %s is back", rep.address)
            rep.healthy = True
            live.append(rep)
        if not live and newer:
            raise NewerVersion(f"rollout replicas serve a newer weight version than the learner's {self.version}")
        if not live:
            raise ReplicaError("no rollout replica is reachable: " + ", ".join(
                r.address + (f" ({r.broken})" if r.broken else "") for r in self.replicas))
        return live

    # -- weights --------------------------------------------------------------------------------
    def _push(self, rep: Replica, weights: dict, version: int, frames=None) -> pb.UpdateWeightsResponse:
        """One version to one replica: through the shared arena when this replica takes it, else as a
        stream (of `frames`, the messages several streams share, or framed for this stream alone).
        Callers hold sync_lock."""
        t0 = time.perf_counter()
        resp = None
        if rep.shared and self._arena_ready(weights, version):
            try:
                resp = rep.stub.UpdateWeightsShared(self.arena.request(version), metadata=rpc.auth_metadata(self.settings),
                                                    timeout=self.timeout)
            except grpc.RpcError as e:
                if not _shared_unavailable(e):
                    raise
                rep.shared = False
                log.warning("rollout %s: shared weight sync refused (%s: %s); streaming weights over gRPC to it from now on",
                            rep.address, e.code().name, e.details())
        if resp is None:
            messages = frames if frames is not None else encode_update(weights, version, chunk_bytes=self.chunk_bytes, raw=True)
            resp = rep.update_weights(messages, metadata=rpc.auth_metadata(self.settings), timeout=self.timeout)
        self.metrics.sync_seconds.observe(time.perf_counter() - t0)
        self.metrics.sync_bytes.inc(resp.bytes)
        rep.version = version
        return resp

    def _arena_ready(self, weights: dict, version: int) -> bool:
        """Write `version` into the arena (once per version). False, and streams for every replica from
        then on, when this host cannot give one (e.g. /dev/shm full)."""
        try:
            self.arena.write(weights, version)
            return True
        except (RuntimeError, OSError) as e:
            log.warning("cannot write the shared weight arena (%s): streaming weights over gRPC to every replica", e)
            for rep in self.replicas:
                rep.shared = False
            return False

    def _push_streamed(self, rep: Replica, weights: dict, version: int, frames: SharedFrames | None, i: int):
        try:
            return self._push(rep, weights, version, frames.stream(i) if frames is not None else None)
        finally:
            if frames is not None:
                frames.leave(i)

    def update(self, weights: dict, version: int) -> None:
        """Push `version` to every replica concurrently. The tensors are snapshotted (the learner mutates
        its dict in place on the next step)."""
        snapshot = {n: t for n, t in weights.items()}  # (requantize replaces tensors, never writes into them)
        with self.lock:
            self.weights, self.version = snapshot, version
            self.history[version] = snapshot
            while len(self.history) > self.keep_versions:
                self.history.popitem(last=False)
        with self.sync_lock:
            targets = [rep for rep in self.replicas if not rep.broken]  # (a broken one would refuse it as stale)
            streamed = [rep for rep in targets if not rep.shared]
            frames = None
            if len(streamed) > 1:  # frame the chunks once; every stream sends the same bytes
                frames = SharedFrames(encode_update(snapshot, version, chunk_bytes=self.chunk_bytes, raw=True), len(streamed))
            futs = {}
            for rep in targets:
                i = streamed.index(rep) if rep in streamed else 0
                futs[self.pool.submit(self._push_streamed, rep, snapshot, version,
                                      frames if rep in streamed else None, i)] = rep
            ok = 0
            for fut, rep in futs.items():
                try:
                    fut.result()
                    ok += 1
                    rep.healthy = True
                except grpc.RpcError as e:
                    rep.healthy = False
                    log.warning("push of version %d to %s failed: %s %s", version, rep.address, e.code().name, e.details())
        if ok == 0:  # not fatal: a replica that comes back gets this version before it samples again
            log.warning("weight version %d reached no rollout replica; will re-push when one answers", version)

    def status(self) -> list[str]:
        return [f"{r.address} ({'broken: ' + r.broken if r.broken else 'up' if r.healthy else 'down'}, version {r.version})"
                for r in self.replicas]
