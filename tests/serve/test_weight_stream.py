"""The weight stream's checks (services/common/weights.py): a push round-trips bit for bit at any chunk size,
and each fault (wrong shape, dtype, count, order, truncation, version) is named."""
import pytest
import torch

from minite_core import nvfp4
from services.common.weights import WeightAssembler, WeightError, describe, encode_update, push_bytes


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": nvfp4.quantize(torch.randn(48, 64, generator=g), scale_mode="tensor"),
            "b.weight": torch.randn(7, 5, generator=g).bfloat16(),
            "c.weight": nvfp4.quantize(torch.randn(3, 32, generator=g))}  # per-row global scales


def _expected(w):
    return {n: describe(t) for n, t in w.items()}


def _assemble(msgs, expected, serving=0):
    asm = WeightAssembler(expected, serving)
    for m in msgs:
        asm.feed(m)
    return asm.result()


@pytest.mark.parametrize("chunk", [7, 100, 1 << 20])
def test_roundtrip_is_bitwise(chunk):
    w = _weights()
    version, abort, out = _assemble(encode_update(w, 3, chunk_bytes=chunk), _expected(w))
    assert version == 3 and not abort
    for n, t in w.items():
        if isinstance(t, nvfp4.NVFP4Tensor):
            assert torch.equal(out[n].data, t.data) and torch.equal(out[n].scale.view(torch.uint8), t.scale.view(torch.uint8))
            assert torch.equal(out[n].global_scale, t.global_scale)
        else:
            assert torch.equal(out[n], t)
    # NVFP4 travels packed: 4.5 bits per value (+ a float per tensor or row), not 16
    assert push_bytes({"a.weight": w["a.weight"]}) == 48 * 64 // 2 + 48 * 64 // 16 + 4


def _msgs(w, version=1):
    return list(encode_update(w, version, chunk_bytes=256))


def _fault(kind):
    w = _weights()
    msgs = _msgs(w)
    if kind == "no-begin":
        return msgs[1:]
    if kind == "two-begins":
        return msgs[:1] + msgs
    if kind == "missing":
        return [m for m in msgs if not (m.WhichOneof("kind") == "chunk" and m.chunk.name == "b.weight")]
    if kind == "out-of-order":
        chunks = [i for i, m in enumerate(msgs) if m.WhichOneof("kind") == "chunk" and m.chunk.name == "a.weight"]
        msgs[chunks[0]], msgs[chunks[1]] = msgs[chunks[1]], msgs[chunks[0]]
        return msgs
    if kind == "format":
        for m in msgs:
            if m.WhichOneof("kind") == "chunk" and m.chunk.name == "b.weight":
                m.chunk.format = "float32"
        return msgs
    if kind == "oversize":
        for m in msgs:
            if m.WhichOneof("kind") == "chunk" and m.chunk.name == "b.weight":
                m.chunk.payload += b"\0" * 8
        return msgs
    if kind == "nan-scale":
        bad = dict(w)
        t = w["a.weight"]
        s = t.scale.clone().view(torch.uint8)
        s[0, 0] = 0x7F  # e4m3 NaN
        bad["a.weight"] = nvfp4.NVFP4Tensor(t.data, s.view(torch.float8_e4m3fn), t.global_scale, t.shape)
        return _msgs(bad)
    if kind == "after-end":
        return msgs + msgs[-2:-1]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind, words", [
    ("no-begin", "start with UpdateBegin"), ("two-begins", "second UpdateBegin"), ("missing", "missing or incomplete"),
    ("out-of-order", "offset"), ("format", "format"), ("oversize", "runs past"), ("nan-scale", "NaN block scale"),
    ("after-end", "after UpdateEnd"),
])
def test_faults_are_named(kind, words):
    w = _weights()
    with pytest.raises(WeightError, match=words):
        _assemble(_fault(kind), _expected(w))


def test_stale_version_and_wrong_count():
    w = _weights()
    with pytest.raises(WeightError, match="stale weight version 2"):
        _assemble(_msgs(w, version=2), _expected(w), serving=2)
    with pytest.raises(WeightError, match="announces 3 tensors; the model has 2"):
        _assemble(_msgs(w), {n: d for n, d in _expected(w).items() if n != "c.weight"})
