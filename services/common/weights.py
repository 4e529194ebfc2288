"""Weights on the wire: a full weight set as a stream of `UpdateWeightsRequest` messages, and the
receiver that checks and assembles it.

An NVFP4 weight travels packed, exactly as both engines hold it: the parts "data" (uint8, two e2m1
codes per byte), "scale" (float8_e4m3fn, one per 16 values) and "global_scale" (float32), about
4.5 bits per value; a plain tensor travels as its bf16/fp32 bytes. A part larger than one message is
split into chunks (1-4 MiB); every chunk carries the CRC-32 of its payload, checked on arrival. The stream is UpdateBegin, the chunks, UpdateEnd; the receiver builds the new weight set
beside the serving one and hands it over only after UpdateEnd with every tensor present and verified,
so a bad or cut stream leaves nothing half applied.

The checks on what arrives (`check_begin`, `check_tensor`, `check_part`, `check_complete`) and the final
assembly with its value checks (`assemble`) are shared with the same-host path (shared_weights.py): one
implementation for both. `SharedFrames` lets N streams of one version send the same framed chunks
(framed once, a bounded window of them held).
"""
from __future__ import annotations

import collections
import math
import threading
import time
import zlib

import torch

from minite.v1 import rollout_pb2 as pb
from minite_core.nvfp4 import NVFP4Tensor

# A weight version is 1..MAX_VERSION. 2^53: every version is exact as a float64 (the weight_version gauge
# in /metrics, JSON numbers in REST answers and their JavaScript clients), and at one push per millisecond
# it lasts 285,000 years. A bound relative to the serving version would refuse the legitimate re-push of
# a long-running learner's version to a replica that restarted at 0, so the bound is absolute. Above it a
# push is malformed (INVALID_ARGUMENT): accepted, it would leave no room for a later, newer push (2^64-1
# makes every later one "stale"; a learner that re-syncs above it would overflow uint64).
MAX_VERSION = 2 ** 53
# The largest |value| a pushed weight may dequantize to. Trained LLM weights stay far below it (linear
# weights ~1, norm weights ~1e2 at most); a global scale like 3e38 dequantizes to inf (3e38 * 448 * 6) and
# turns every logprob into NaN, so such a push is refused before the swap, naming the tensor.
MAX_ABS_WEIGHT = 1e4
# A push stream that sends no message for this many seconds is abandoned by the receiver (idle_guarded),
# so a stalled pusher does not hold the one-push-at-a-time update lock until its own deadline.
PUSH_IDLE_TIMEOUT_S = 30.0

FORMATS = {"nvfp4": None, "bfloat16": torch.bfloat16, "float32": torch.float32}
PART_DTYPES = {"data": torch.uint8, "scale": torch.float8_e4m3fn, "global_scale": torch.float32}


class WeightError(ValueError):
    """A weight push that cannot be applied; the message says which tensor and why."""


class StalePush(WeightError):
    """A push of a version not newer than the one serving (FAILED_PRECONDITION, not a malformed push)."""


def describe(t) -> tuple[str, tuple[int, ...]]:
    """(format, logical shape) of a weight as the wire names it."""
    if isinstance(t, NVFP4Tensor):
        return "nvfp4", tuple(t.shape)
    for name, dt in FORMATS.items():
        if dt is not None and t.dtype == dt:
            return name, tuple(t.shape)
    raise WeightError(f"cannot send a {t.dtype} tensor (formats: nvfp4, bfloat16, float32)")


def _parts(t) -> list[tuple[str, torch.Tensor]]:
    if isinstance(t, NVFP4Tensor):
        return [("data", t.data), ("scale", t.scale), ("global_scale", t.global_scale)]
    return [("data", t)]


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (a copy only when it is not contiguous or not on the CPU)."""
    t = t.detach().contiguous().cpu()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


_CHUNK_FIELD = b"\x12"  # UpdateWeightsRequest.chunk: field 2, length-delimited
_PAYLOAD_FIELD = b"\x42"  # TensorChunk.payload: field 8, length-delimited


def encode_update(weights: dict, version: int, *, abort_in_flight: bool = False, chunk_bytes: int = 2 << 20,
                  raw: bool = False):
    """Yield the messages of one full weight push (tensors in name order); with `raw`, already serialized.

    A chunk is serialized by hand around its payload: protobuf encodes the small fields, and the payload
    field (a tag, a length, the bytes) is appended to them, so the tensor's bytes are copied once, into
    the wire message, instead of three times (slice, message, serialization). The bytes are a valid
    UpdateWeightsRequest (fields may come in any order on the wire)."""
    begin = pb.UpdateWeightsRequest(begin=pb.UpdateBegin(
        version=version, num_tensors=len(weights),
        mode=pb.UPDATE_MODE_ABORT_IN_FLIGHT if abort_in_flight else pb.UPDATE_MODE_FINISH_IN_FLIGHT))
    frames = _frames(weights, chunk_bytes)
    for msg in [begin.SerializeToString()] if raw else [begin]:
        yield msg
    for frame in frames:
        yield frame if raw else pb.UpdateWeightsRequest.FromString(frame)
    end = pb.UpdateWeightsRequest(end=pb.UpdateEnd())
    yield end.SerializeToString() if raw else end


def _frames(weights: dict, chunk_bytes: int):
    for name in sorted(weights):
        t = weights[name]
        fmt, shape = describe(t)
        for part, tensor in _parts(t):
            data = _as_bytes(tensor)
            for off in range(0, max(len(data), 1), chunk_bytes):
                payload = data[off:off + chunk_bytes]  # a view: no copy yet
                head = pb.TensorChunk(name=name, format=fmt, shape=shape, part=part, part_shape=tuple(tensor.shape),
                                      offset=off, part_bytes=len(data), crc32=zlib.crc32(payload)).SerializeToString()
                inner = len(head) + 1 + len(_varint(len(payload))) + len(payload)
                yield b"".join((_CHUNK_FIELD, _varint(inner), head, _PAYLOAD_FIELD, _varint(len(payload)), payload))


class SharedFrames:
    """The messages of one push, framed once and read by `n` streams at once (one per replica).

    `stream(i)` iterates them for stream i. A message is framed the first time a stream needs it (by that
    stream's thread) and dropped once every stream has passed it; a stream more than `window` messages
    ahead of the slowest waits for it, so at most about `window` chunks are held whatever N is. A stream
    whose call ended, successful or not, must `leave(i)`, so it holds nobody back."""

    def __init__(self, messages, n: int, window: int = 32):
        self.src, self.window = iter(messages), window
        self.buf: collections.deque = collections.deque()
        self.base = 0  # index of buf[0]
        self.pos = [0] * n
        self.active = set(range(n))
        self.exhausted = False
        self.cond = threading.Condition()

    def stream(self, i: int):
        try:
            while True:
                with self.cond:
                    frame = self._next(i)
                if frame is None:
                    return
                yield frame
        finally:
            self.leave(i)

    def _next(self, i: int):
        while i in self.active:
            p = self.pos[i]
            if p < self.base + len(self.buf):
                frame = self.buf[p - self.base]
                self.pos[i] = p + 1
                self._trim()
                return frame
            if self.exhausted:
                return None
            if p - min(self.pos[j] for j in self.active) < self.window:
                try:
                    self.buf.append(next(self.src))
                except StopIteration:
                    self.exhausted = True
                self.cond.notify_all()
            else:
                self.cond.wait(1.0)
        return None

    def _trim(self) -> None:
        low = min((self.pos[j] for j in self.active), default=self.base + len(self.buf))
        while self.base < low and self.buf:
            self.buf.popleft()
            self.base += 1
        self.cond.notify_all()

    def leave(self, i: int) -> None:
        with self.cond:
            self.active.discard(i)
            self._trim()


UPDATE_METHOD = "/minite.v1.RolloutService/UpdateWeights"


def raw_update_call(channel):
    """UpdateWeights on `channel` taking the already serialized messages of encode_update(raw=True)."""
    return channel.stream_unary(UPDATE_METHOD, request_serializer=None,
                                response_deserializer=pb.UpdateWeightsResponse.FromString)


def push_bytes(weights: dict) -> int:
    """Bytes of tensor payload one push carries."""
    return sum(p.numel() * p.element_size() for t in weights.values() for _, p in _parts(t))


def _expected_parts(fmt: str, shape: tuple) -> dict[str, list[tuple]]:
    """Allowed part shapes of a tensor of this format and shape."""
    if fmt != "nvfp4":
        return {"data": [shape]}
    lead, k = shape[:-1], shape[-1]
    return {"data": [lead + (k // 2,)], "scale": [lead + (k // 16,)], "global_scale": [(), lead + (1,)]}


def _part_dtype(fmt: str, part: str) -> torch.dtype:
    return FORMATS[fmt] if part == "data" and fmt != "nvfp4" else PART_DTYPES[part]


def _nbytes(fmt: str, part: str, shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * _part_dtype(fmt, part).itemsize


def _aligned(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


def arena_bytes(expected: dict[str, tuple[str, tuple]]) -> int:
    """Bytes of one arena holding every part of `expected`, each at a 64-byte aligned offset (the largest
    allowed shape of a part is reserved)."""
    return sum(_aligned(max(_nbytes(fmt, part, ps) for ps in shapes))
               for fmt, shape in expected.values() for part, shapes in _expected_parts(fmt, tuple(shape)).items())


# -- the checks both receive paths share (the stream here, the shared-memory arena in shared_weights.py) --
def check_begin(version: int, num_tensors: int, expected: dict, serving: int) -> None:
    """A push's header against the serving version and the model."""
    if version > MAX_VERSION:
        raise WeightError(f"weight version {version} is above the largest accepted version 2^53 = {MAX_VERSION} "
                          "(versions count pushes: a larger one is a bug or a forged push)")
    if version <= serving:
        raise StalePush(f"stale weight version {version}: serving version {serving}")
    if num_tensors != len(expected):
        raise WeightError(f"the update announces {num_tensors} tensors; the model has {len(expected)}")


def check_tensor(expected: dict, name: str, fmt: str, shape: tuple) -> dict[str, list[tuple]]:
    """A tensor's name, format and logical shape against the model -> its allowed parts and part shapes."""
    if name not in expected:
        raise WeightError(f"unknown tensor {name!r}")
    want_fmt, want_shape = expected[name]
    if fmt != want_fmt:
        raise WeightError(f"{name}: format {fmt!r}, the model holds {want_fmt!r}")
    if tuple(shape) != tuple(want_shape):
        raise WeightError(f"{name}: shape {tuple(shape)}, the model holds {tuple(want_shape)}")
    return _expected_parts(fmt, tuple(shape))


def check_part(name: str, fmt: str, allowed: dict, part: str, part_shape: tuple, nbytes: int) -> torch.dtype:
    """One part's name, shape and byte size -> its dtype."""
    if part not in allowed:
        raise WeightError(f"{name}: unknown part {part!r} for format {fmt} (parts: {sorted(allowed)})")
    if tuple(part_shape) not in allowed[part]:
        raise WeightError(f"{name}.{part}: shape {tuple(part_shape)}, expected one of {allowed[part]}")
    size = _nbytes(fmt, part, tuple(part_shape))
    if nbytes != size:
        raise WeightError(f"{name}.{part}: {nbytes} bytes announced, {size} expected")
    return _part_dtype(fmt, part)


def _scale_codes(scale: torch.Tensor) -> tuple[bool, int]:
    """(any e4m3fn NaN (S.1111.111)?, the largest magnitude code) of block scales, in one pass over the
    magnitude bits (e4m3 magnitudes order as their codes). On the CPU in numpy on one thread (torch's
    elementwise ops wake its thread pool for every small tensor, which dominates a push on a busy small host)."""
    if not scale.numel():
        return False, 0
    if scale.device.type == "cpu":
        mag = scale.reshape(-1).view(torch.uint8).numpy() & 0x7F
        return bool((mag == 0x7F).any()), int(mag.max())
    mag = scale.reshape(-1).view(torch.uint8) & 0x7F
    return bool((mag == 0x7F).any()), int(mag.max())


def _e4m3(code: int) -> float:
    return float(torch.tensor([code], dtype=torch.uint8).view(torch.float8_e4m3fn).float())


def _too_large(name: str, amax: float, what: str) -> WeightError:
    return WeightError(f"{name}: values up to {amax:.3g} {what}, above the limit {MAX_ABS_WEIGHT:g} "
                       "(a corrupt or runaway weight; the serving weights are kept)")


def assemble(name: str, fmt: str, shape: tuple, got: dict[str, torch.Tensor]):
    """The received parts (typed and shaped, views into the receiver's own memory) -> the weight, after
    the value checks: NVFP4 global scales finite and > 0, no NaN block scale, and the largest value the
    tensor can dequantize to (6 * largest block scale * largest global scale) at most MAX_ABS_WEIGHT;
    plain tensors finite and within +-MAX_ABS_WEIGHT."""
    if fmt == "nvfp4":
        gs = got["global_scale"]
        if not bool(torch.isfinite(gs).all()) or not bool((gs > 0).all()):
            raise WeightError(f"{name}: global scale must be finite and > 0")
        nan, top = _scale_codes(got["scale"])
        if nan:
            raise WeightError(f"{name}: NaN block scale")
        gmax = float(gs.max()) if gs.numel() else 0.0
        amax = 6.0 * _e4m3(top) * gmax  # (a Python float: no overflow where float32 would give inf)
        if not math.isfinite(amax) or amax > MAX_ABS_WEIGHT:
            raise _too_large(name, amax, f"(global scale {gmax:.3g} x block scale {_e4m3(top):g} x 6)")
        try:
            return NVFP4Tensor(got["data"], got["scale"], gs, shape)
        except ValueError as e:
            raise WeightError(f"{name}: {e}") from None
    t = got["data"]
    if t.numel():
        lo, hi = (float(v) for v in torch.aminmax(t))  # NaN/Inf reach min or max
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise WeightError(f"{name}: contains NaN or Inf")
        if max(-lo, hi) > MAX_ABS_WEIGHT:
            raise _too_large(name, max(-lo, hi), "in magnitude")
    return t


def check_complete(expected: dict, tensors: dict) -> None:
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise WeightError(f"{len(missing)} tensor(s) missing or incomplete, e.g. {missing[0]!r}")


def idle_guarded(request_iterator, context, idle_s: float = PUSH_IDLE_TIMEOUT_S):
    """The messages of a server-side request stream; when none arrives for `idle_s` seconds, the call is
    cancelled (a watchdog thread: a blocked read cannot be interrupted otherwise) and the iteration raises
    WeightError("no message for N s ..."), so the handler refuses the push and releases what it holds (the
    update lock, the arena). The watchdog ends with the stream or the call."""
    last = [time.monotonic()]
    fired = threading.Event()
    done = threading.Event()

    def watch():
        while not done.wait(min(1.0, idle_s / 4)):
            if not context.is_active():
                return
            if time.monotonic() - last[0] > idle_s:
                fired.set()
                context.cancel()
                return

    threading.Thread(target=watch, name="push-idle-watchdog", daemon=True).start()
    stalled = f"no message for {idle_s:g} s: the push stalled and was abandoned"
    try:
        for msg in request_iterator:
            last[0] = time.monotonic()
            yield msg
    except Exception:  # grpc.RpcError: the call was cancelled (by the watchdog, or the client went away)
        if fired.is_set():
            raise WeightError(stalled) from None
        raise
    finally:
        done.set()
    if fired.is_set():  # (a cancelled call's stream may also just end, which would read as a truncated push)
        raise WeightError(stalled)


class WeightAssembler:
    """Receives one push against `expected` = {name: (format, shape)} (the serving model's weights) and
    the serving version; `feed` each message, then `result()` -> (version, abort_in_flight, weights).
    Raises WeightError naming the problem at the first bad message."""

    def __init__(self, expected: dict[str, tuple[str, tuple]], serving_version: int, *, arena_pool=None):
        self.expected, self.serving = expected, serving_version
        self.arena_pool = arena_pool  # nbytes -> a uint8 tensor to write into (reused memory), or None
        self.begin = None
        self.ended = False
        self.bytes = 0
        self.parts: dict[tuple[str, str], dict] = {}  # (name, part) -> {"buf", "filled", "crc", "shape"}
        self.tensors: dict[str, object] = {}

    def feed(self, msg) -> None:
        kind = msg.WhichOneof("kind")
        if kind is None:
            raise WeightError("empty UpdateWeightsRequest (no begin, chunk or end)")
        if self.ended:
            raise WeightError("message after UpdateEnd")
        if kind == "begin":
            if self.begin is not None:
                raise WeightError("a second UpdateBegin in one stream")
            b = msg.begin
            check_begin(b.version, b.num_tensors, self.expected, self.serving)
            self.begin = b
            # one arena for the whole push, each part a slice of it: the receiver can hand in the memory of a
            # retired version (first touches of fresh pages cost more than the copy itself)
            cap = arena_bytes(self.expected)
            self.arena = self.arena_pool(cap) if self.arena_pool is not None else torch.empty(cap, dtype=torch.uint8)
            self.arena_view = memoryview(self.arena.numpy())
            self.top = 0
            return
        if self.begin is None:
            raise WeightError("the stream must start with UpdateBegin")
        if kind == "end":
            self.ended = True
            return
        self._chunk(msg.chunk)

    def _chunk(self, c) -> None:
        allowed = check_tensor(self.expected, c.name, c.format, tuple(c.shape))
        fmt, shape = self.expected[c.name]
        if c.part not in allowed:
            raise WeightError(f"{c.name}: unknown part {c.part!r} for format {fmt} (parts: {sorted(allowed)})")
        if c.name in self.tensors:
            raise WeightError(f"{c.name}: sent twice")
        key = (c.name, c.part)
        st = self.parts.get(key)
        if st is None:
            dtype = check_part(c.name, fmt, allowed, c.part, tuple(c.part_shape), c.part_bytes)
            size = c.part_bytes
            lo, self.top = self.top, self.top + _aligned(size)  # never past the arena: each part comes once
            st = self.parts[key] = {"tensor": self.arena[lo:lo + size], "buf": self.arena_view[lo:lo + size],
                                    "filled": 0, "shape": tuple(c.part_shape), "dtype": dtype}
        if c.part_bytes != len(st["buf"]) or tuple(c.part_shape) != st["shape"]:
            raise WeightError(f"{c.name}.{c.part}: chunks disagree on the part's size or shape")
        if c.offset != st["filled"]:
            raise WeightError(f"{c.name}.{c.part}: chunk at offset {c.offset}, expected {st['filled']} (chunks in order)")
        payload = c.payload
        end = c.offset + len(payload)
        if end > len(st["buf"]):
            raise WeightError(f"{c.name}.{c.part}: chunk runs past the part's {len(st['buf'])} bytes")
        if zlib.crc32(payload) != c.crc32:
            raise WeightError(f"{c.name}.{c.part}: checksum mismatch at offset {c.offset} (corrupted in transit)")
        st["buf"][c.offset:end] = payload
        st["filled"] = end
        self.bytes += len(payload)
        if end == len(st["buf"]):
            self._maybe_complete(c.name, fmt, tuple(shape))

    def _maybe_complete(self, name: str, fmt: str, shape: tuple) -> None:
        names = _expected_parts(fmt, shape)
        got = {}
        for part in names:
            st = self.parts.get((name, part))
            if st is None or st["filled"] != len(st["buf"]):
                return
            got[part] = st["tensor"].view(st["dtype"]).reshape(st["shape"])
        for part in names:
            del self.parts[(name, part)]
        self.tensors[name] = assemble(name, fmt, shape, got)

    def result(self) -> tuple[int, bool, dict]:
        if self.begin is None:
            raise WeightError("empty stream: no UpdateBegin")
        if not self.ended:
            raise WeightError("stream ended without UpdateEnd (truncated push)")
        check_complete(self.expected, self.tensors)
        return self.begin.version, self.begin.mode == pb.UPDATE_MODE_ABORT_IN_FLIGHT, self.tensors
