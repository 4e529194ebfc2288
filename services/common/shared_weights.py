"""Same-host weight sync: the learner writes a version's packed tensors into one shared-memory arena it
owns, and a replica on the same host copies them out (RPC UpdateWeightsShared), instead of receiving
them as a gRPC stream of chunks.

The arena holds exactly the bytes the stream would carry (NVFP4 parts "data" / "scale" / "global_scale",
plain tensors' bf16/fp32 bytes), each part at a 64-byte aligned offset. It is
- a CPU buffer in torch's file_system sharing when the weights are on the CPU: a /dev/shm object the
  handle names by file name (and torch_shm_manager socket), so any process on the host can map it;
- a CUDA buffer exported with CUDA IPC when the weights are on a GPU (the fields of
  `UntypedStorage._share_cuda_()`, plus the GPU's UUID so a replica with other CUDA_VISIBLE_DEVICES
  finds the same GPU). The learner shares it afresh for every push: each share gets its own torch IPC
  ref counter and an event recorded after the writes, which the replica waits on before reading.
The handle travels as plain protobuf fields (no pickle). The learner keeps one arena per replica set and
reuses it across versions: the RPC returns only after the replica has copied and checked everything, so
the learner may overwrite the arena for the next version.

The replica checks the manifest (names, formats, shapes, part shapes and sizes, byte ranges inside the
arena) with the very checks of the stream path (`weights.check_*`) before it opens the arena, copies each
part into memory of its own (never keeping a reference into the learner's arena: it closes the mapping
before it answers), verifies a checksum of its copy, and assembles the weights with `weights.assemble`;
the swap is the same `runtime.update_weights`. So a stale version, a bad manifest or a corrupted part is
refused exactly as on the stream path and the old version keeps serving.

Checksums: a CPU arena carries CRC-32 (zlib) per part, as the stream does. A CUDA arena carries a
position-weighted 64-bit sum of the part's bytes computed on the GPU (`checksum`): CRC-32 would need a
host copy of every part on both sides, which is what this path exists to avoid; the weighted sum catches
changed, swapped or shifted bytes (not adversarial ones: the token and the same-host boundary guard
that), and the replica computes it on its own copy, so it checks what it will serve.

An arena the replica cannot open (another host: boot ids differ; a file that is gone; a GPU it does not
see; no CUDA) raises SharedUnavailable, which the service answers FAILED_PRECONDITION "shared weight sync
unavailable: ..."; the learner then streams to that replica over gRPC from then on.
"""
from __future__ import annotations

import threading
import zlib
from pathlib import Path

import torch

from minite.v1 import rollout_pb2 as pb

from .weights import (WeightError, _aligned, _parts, arena_bytes, assemble, check_begin, check_complete, check_part,
                      check_tensor, describe)

MODES = set(pb.UpdateMode.values())
UNAVAILABLE = "shared weight sync unavailable"  # the FAILED_PRECONDITION message prefix the learner looks for
_CHECKSUM_CHUNK = 1 << 22  # bytes per step of the GPU checksum (its int64 temporaries are 16x that)


def boot_id() -> str:
    """This host's boot id: equal for processes of one host (containers included), different across hosts."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


BOOT_ID = boot_id()


class SharedUnavailable(RuntimeError):
    """The arena cannot be opened from this process (another host, a file that is gone, another GPU)."""


def checksum(b: torch.Tensor) -> int:
    """sum_i (i + 1) * byte_i modulo 2^64 over a 1-D uint8 tensor, on its own device (CPU or GPU); the
    modular sum does not depend on the reduction order, so both sides agree bit for bit."""
    total = torch.zeros((), dtype=torch.int64, device=b.device)
    for lo in range(0, b.numel(), _CHECKSUM_CHUNK):
        piece = b[lo:lo + _CHECKSUM_CHUNK].to(torch.int64)
        pos = torch.arange(lo + 1, lo + 1 + piece.numel(), dtype=torch.int64, device=b.device)
        total += (piece * pos).sum()
    return int(total.item()) & 0xFFFFFFFFFFFFFFFF


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src (1-D uint8). Host to host as one plain memcpy (numpy): torch's copy_ splits even a 1 MB
    copy over its thread pool, and on a busy small host the threads' wake-ups cost more than the copy."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        dst.numpy()[:] = src.numpy()
    else:
        dst.copy_(src)


def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class Arena:
    """The learner's side: one buffer, reused across versions (grown when a version needs more)."""

    def __init__(self):
        self.buf: torch.Tensor | None = None
        self.version = None
        self.tensors: list = []  # the manifest of the version in the buffer (pb.SharedTensor)
        self.cpu_handle = None
        self.lock = threading.Lock()

    def write(self, weights: dict, version: int) -> None:
        """Lay `weights` out in the arena (a no-op when it already holds `version`)."""
        with self.lock:
            if self.version == version:
                return
            self.version = None  # until the write completes
            layout, top = [], 0
            for name in sorted(weights):
                fmt, shape = describe(weights[name])
                parts = []
                for part, t in _parts(weights[name]):
                    n = t.numel() * t.element_size()
                    parts.append((part, t, top, n))
                    top += _aligned(n)
                layout.append((name, fmt, shape, parts))
            devices = {t.device for _, _, _, parts in layout for _, t, _, _ in parts}
            device = next((d for d in devices if d.type == "cuda"), torch.device("cpu"))
            if self.buf is None or self.buf.device != device or self.buf.numel() < top:
                self.buf = self.cpu_handle = None
                self.buf = torch.empty(max(top, 1), dtype=torch.uint8, device=device)
                if device.type == "cpu":
                    self.cpu_handle = self.buf.untyped_storage()._share_filename_cpu_()  # moves it to /dev/shm
            manifest = []
            for name, fmt, shape, parts in layout:
                entry = pb.SharedTensor(name=name, format=fmt, shape=shape)
                for part, t, off, n in parts:
                    dst = self.buf[off:off + n]
                    _copy(dst, _flat_bytes(t))
                    p = entry.parts.add(part=part, part_shape=tuple(t.shape), offset=off, nbytes=n)
                    if device.type == "cpu":
                        p.crc32 = zlib.crc32(memoryview(dst.numpy()))
                    else:
                        p.checksum = checksum(dst)
                manifest.append(entry)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.tensors, self.version = manifest, version

    def request(self, version: int, abort_in_flight: bool = False) -> pb.SharedUpdate:
        """The RPC message for the version in the arena (a fresh CUDA IPC share each time)."""
        with self.lock:
            if self.version != version:
                raise RuntimeError(f"the arena holds version {self.version}, not {version}")
            req = pb.SharedUpdate(version=version, boot_id=BOOT_ID, tensors=self.tensors,
                                  mode=pb.UPDATE_MODE_ABORT_IN_FLIGHT if abort_in_flight else pb.UPDATE_MODE_FINISH_IN_FLIGHT)
            if self.buf.device.type == "cpu":
                manager, filename, size = self.cpu_handle
                req.cpu.CopyFrom(pb.CpuArena(manager_handle=manager, filename=filename, size=size))
            else:
                (dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = self.buf.untyped_storage()._share_cuda_()
                req.cuda.CopyFrom(pb.CudaArena(
                    device=dev, handle=handle, storage_size_bytes=size, storage_offset_bytes=offset,
                    ref_counter_handle=rc_handle, ref_counter_offset=rc_offset, event_handle=ev_handle,
                    event_sync_required=ev_sync, device_uuid=_uuid(dev)))
            return req


# -- the replica's side ----------------------------------------------------------------------------
def _arena_size(req) -> int:
    return req.cpu.size if req.WhichOneof("arena") == "cpu" else req.cuda.storage_size_bytes


def check_manifest(req, expected: dict, serving: int) -> list:
    """The stream path's checks on a SharedUpdate, before anything is opened -> the plan
    [(name, fmt, shape, [(part, part_shape, dtype, SharedPart)])]. Raises WeightError."""
    if req.mode not in MODES:
        raise WeightError(f"unknown update mode {req.mode} (modes: {sorted(MODES)})")
    check_begin(req.version, len(req.tensors), expected, serving)
    if req.WhichOneof("arena") is None:
        raise WeightError("the update names no arena (cpu or cuda)")
    size = _arena_size(req)
    plan, seen = [], set()
    for t in req.tensors:
        allowed = check_tensor(expected, t.name, t.format, tuple(t.shape))
        if t.name in seen:
            raise WeightError(f"{t.name}: sent twice")
        seen.add(t.name)
        parts = {}
        for p in t.parts:
            dtype = check_part(t.name, t.format, allowed, p.part, tuple(p.part_shape), p.nbytes)
            if p.part in parts:
                raise WeightError(f"{t.name}.{p.part}: sent twice")
            if p.offset + p.nbytes > size:
                raise WeightError(f"{t.name}.{p.part}: bytes [{p.offset}, {p.offset + p.nbytes}) run past the "
                                  f"arena's {size} bytes")
            parts[p.part] = (p.part, tuple(p.part_shape), dtype, p)
        missing = sorted(set(allowed) - set(parts))
        if missing:
            raise WeightError(f"{t.name}: part(s) {missing} missing")
        plan.append((t.name, t.format, tuple(t.shape), [parts[k] for k in allowed]))
    check_complete(expected, seen)
    return plan


def open_arena(req) -> torch.Tensor:
    """The learner's arena as a uint8 tensor mapped into this process. Raises SharedUnavailable."""
    if req.boot_id and req.boot_id != BOOT_ID:
        raise SharedUnavailable("the learner runs on another host (boot ids differ)")
    if req.WhichOneof("arena") == "cpu":
        a = req.cpu
        try:
            storage = torch.UntypedStorage._new_shared_filename_cpu(a.manager_handle, a.filename, a.size)
        except RuntimeError as e:
            raise SharedUnavailable(f"cannot map {a.filename.decode(errors='replace')}: {e}") from None
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (a.size,), (1,))
    a = req.cuda
    if not torch.cuda.is_available():
        raise SharedUnavailable("this replica has no CUDA")
    index = next((i for i in range(torch.cuda.device_count()) if _uuid(i) == a.device_uuid), None)
    if index is None:
        raise SharedUnavailable(f"GPU {a.device_uuid} is not visible to this replica")
    try:
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            index, a.handle, a.storage_size_bytes, a.storage_offset_bytes, a.ref_counter_handle,
            a.ref_counter_offset, a.event_handle, a.event_sync_required)
    except RuntimeError as e:
        raise SharedUnavailable(f"cannot open the CUDA IPC handle: {e}") from None
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage, 0, (a.storage_size_bytes,), (1,))


def receive_shared(req, expected: dict, serving: int, *, device, arena_pool=None, give_back=None):
    """Check, open, copy, verify and assemble one SharedUpdate -> (version, abort_in_flight, weights,
    bytes, own arena (CPU; None on a GPU)). Raises WeightError (a bad update) or SharedUnavailable."""
    plan = check_manifest(req, expected, serving)
    src = open_arena(req)
    device = torch.device(device)
    cap = arena_bytes(expected)
    own = arena_pool(cap) if arena_pool is not None and device.type == "cpu" else \
        torch.empty(cap, dtype=torch.uint8, device=device)
    cuda_arena = req.WhichOneof("arena") == "cuda"
    weights, top, nbytes = {}, 0, 0
    try:
        for name, fmt, shape, parts in plan:
            got = {}
            for part, part_shape, dtype, p in parts:
                dst = own[top:top + p.nbytes]
                top += _aligned(p.nbytes)
                _copy(dst, src[p.offset:p.offset + p.nbytes])
                if cuda_arena:
                    ok = checksum(dst) == p.checksum
                else:  # CRC-32 on the CPU: of the copy when it is on the CPU, else of the arena's bytes
                    host = dst if dst.device.type == "cpu" else src[p.offset:p.offset + p.nbytes]
                    ok = zlib.crc32(memoryview(host.numpy())) == p.crc32
                if not ok:
                    raise WeightError(f"{name}.{part}: checksum mismatch (the arena's bytes are not what the learner wrote)")
                got[part] = dst.view(dtype).reshape(part_shape)
                nbytes += p.nbytes
            weights[name] = assemble(name, fmt, shape, got)
        if src.is_cuda or own.is_cuda:
            torch.cuda.synchronize()  # every copy done before the learner may overwrite its arena
    except BaseException:
        if give_back is not None and arena_pool is not None and device.type == "cpu":
            give_back(own)
        raise
    finally:
        del src  # close the mapping: nothing of ours points into the learner's arena
    return req.version, req.mode == pb.UPDATE_MODE_ABORT_IN_FLIGHT, weights, nbytes, own if device.type == "cpu" else None
