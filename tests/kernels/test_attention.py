"""The Triton attention and log-sum-exp kernels (on the CPU under TRITON_INTERPRET=1, on the GPU when
there is one): decode over a KV cache == prefill, bit for bit, at every chunk boundary, for any cache
capacity, through either launch (split-KV or one program per tile); independent of batch mates; close
to the torch reference, SDPA and torch.log_softmax; gradients close to the fp32 autograd ones."""
import pytest
import torch

from minite_core import ops

pytestmark = pytest.mark.skipif(pytest.importorskip("triton") is None, reason="triton")


def _rand(*shape, seed, device, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 1.5).to(device=device, dtype=dtype)


def _cfg():
    """(BLOCK_M, BLOCK_N, SPLIT_N): tiny tiles and chunks of 2 blocks under the interpreter."""
    from minite_core.kernels.attention import attention_config

    return attention_config()


def _fwd(q, k, v, pos, lens, split=None):
    from minite_core.kernels.attention import attention_forward

    return attention_forward(q, k, v, pos, lens, q.shape[-1] ** -0.5, split=split)


def _qkv(b, hq, hkv, t, d, device, seed=1):
    return (_rand(b, hq, t, d, seed=seed, device=device), _rand(b, hkv, t, d, seed=seed + 1, device=device),
            _rand(b, hkv, t, d, seed=seed + 2, device=device))


def _cache(k, v, cap, seed, stale=None):
    """k, v written at the front of a cache of `cap` positions; the rest random (or `stale`)."""
    b, hkv, t, d = k.shape
    kc, vc = _rand(b, hkv, cap, d, seed=seed, device=k.device), _rand(b, hkv, cap, d, seed=seed + 1, device=k.device)
    if stale is not None:
        kc[:, :, t:], vc[:, :, t:] = stale, stale
    kc[:, :, :t], vc[:, :, :t] = k, v
    return kc, vc


@pytest.mark.interpreter
@pytest.mark.parametrize("heads,extra", [((4, 2), "ragged"), ((4, 1), "chunks"), ((2, 2), "exact")],
                         ids=["gqa2-ragged", "gqa4-chunks", "mha-exact"])
def test_decode_equals_prefill_bitwise(device, heads, extra):
    """One query over a KV cache (split launch: one program per chunk, then the combine) gives the bits
    of the same query inside a causal prefill (one program per tile, chunks combined in registers), at
    positions on both sides of every chunk boundary, for caches of several capacities."""
    bm, bn, sn = _cfg()
    hq, hkv = heads
    b, d, t = 1, 16, 3 * sn + 5
    q, k, v = _qkv(b, hq, hkv, t, d, device)
    pos = torch.arange(t, device=device).expand(b, t).contiguous()
    full = ops.attention(q, k, v, pos, torch.full((b,), t, device=device), backend="triton")
    cap = {"exact": t, "ragged": t + 2 * bn + 3, "chunks": 5 * sn}[extra]
    kc, vc = _cache(k, v, cap, seed=4)
    for p in sorted({0, 1, sn - 1, sn, sn + 1, 2 * sn, 2 * sn + 1, t - 2, t - 1}):
        one = ops.attention(q[:, :, p:p + 1], kc, vc, torch.full((b, 1), p, device=device),
                            torch.full((b,), p + 1, device=device), backend="triton")
        assert torch.equal(one, full[:, :, p:p + 1]), p
        if p in (sn, 2 * sn + 1, t - 1):  # a step of two queries (p - 1, p) over the cache: the same bits
            two = ops.attention(q[:, :, p - 1:p + 1], kc, vc, torch.stack([pos[:, p - 1], pos[:, p]], 1),
                                torch.full((b,), p + 1, device=device), backend="triton")
            assert torch.equal(two, full[:, :, p - 1:p + 1]), p


@pytest.mark.interpreter
def test_decode_small_cache_single_chunk(device):
    """A cache of one chunk runs the one-program launch (no split): still the prefill's bits."""
    bm, bn, sn = _cfg()
    b, hq, hkv, d, t = 1, 4, 2, 16, sn
    q, k, v = _qkv(b, hq, hkv, t, d, device, seed=20)
    pos = torch.arange(t, device=device).expand(b, t).contiguous()
    full = ops.attention(q, k, v, pos, torch.full((b,), t, device=device), backend="triton")
    for p in (0, bn - 1, bn, t - 1):
        one = ops.attention(q[:, :, p:p + 1], k, v, torch.full((b, 1), p, device=device),
                            torch.full((b,), p + 1, device=device), backend="triton")
        assert torch.equal(one, full[:, :, p:p + 1]), p


@pytest.mark.interpreter
def test_split_and_tile_launches_agree(device):
    """The same call through both launches, forced: a whole prefill split into per-chunk programs, and a
    decode step walked by one program, give identical bits (the tile rows straddle query heads: t is not
    a multiple of BLOCK_M)."""
    bm, bn, sn = _cfg()
    b, hq, hkv, d, t = 2, 4, 2, 16, 2 * sn + 3
    q, k, v = _qkv(b, hq, hkv, t, d, device, seed=30)
    pos = torch.arange(t, device=device).expand(b, t).contiguous()
    lens = torch.tensor([t, sn + 2], device=device)
    tile = _fwd(q, k, v, pos, lens, split=False)
    assert torch.equal(_fwd(q, k, v, pos, lens, split=True), tile)
    p = t - 1
    one = [_fwd(q[:, :, p:p + 1], k, v, pos[:, p:p + 1], lens, split=s) for s in (False, True)]
    assert torch.equal(one[0], one[1])
    assert torch.equal(one[0], tile[:, :, p:p + 1])


@pytest.mark.interpreter
def test_decode_batch_invariant(device):
    """A decode step of a batch of sequences at different lengths: each row's bits equal that sequence
    decoded alone, and the prefill's."""
    bm, bn, sn = _cfg()
    b, hq, hkv, d, t = 3, 4, 2, 16, 2 * sn + 9
    q, k, v = _qkv(b, hq, hkv, t, d, device, seed=40)
    kc, vc = _cache(k, v, t + sn + 1, seed=44)
    at = torch.tensor([t - 1, sn, 3], device=device)  # each sequence's current position
    qd = q[torch.arange(b), :, at].unsqueeze(2)  # [B, Hq, 1, D]
    batch = ops.attention(qd, kc, vc, at.view(b, 1), at + 1, backend="triton")
    pos = torch.arange(t, device=device).expand(b, t).contiguous()
    full = ops.attention(q, k, v, pos, torch.full((b,), t, device=device), backend="triton")
    for i in range(b):
        alone = ops.attention(qd[i:i + 1], kc[i:i + 1], vc[i:i + 1], at[i:i + 1].view(1, 1), at[i:i + 1] + 1,
                              backend="triton")
        assert torch.equal(alone, batch[i:i + 1]), i
        assert torch.equal(batch[i, :, 0], full[i, :, at[i]]), i


@pytest.mark.interpreter
def test_batch_invariant_and_close_to_reference(device):
    b, hq, hkv, d = 3, 4, 1, 16
    t = 2 * _cfg()[2] + 7  # several chunks
    q, k, v = (_rand(b, h, t, d, seed=s, device=device) for s, h in ((6, hq), (7, hkv), (8, hkv)))
    pos = torch.arange(t, device=device).expand(b, t).contiguous()
    lens = torch.tensor([t, 9, t - 5], device=device)  # right-padded batch mates
    got = ops.attention(q, k, v, pos, lens, backend="triton")
    alone = ops.attention(q[1:2, :, :9], k[1:2, :, :9], v[1:2, :, :9], pos[1:2, :9], lens[1:2], backend="triton")
    assert torch.equal(alone, got[1:2, :, :9])
    ref = ops.attention(q.float(), k.float(), v.float(), pos, lens, backend="torch")
    # bf16 probabilities in p@v on the GPU; fp32 throughout under the interpreter
    tol = 2e-2 if device == "cuda" else 1e-5
    for i, n in enumerate(lens.tolist()):
        assert torch.allclose(got[i, :, :n], ref[i, :, :n], rtol=tol, atol=tol), (got[i, :, :n] - ref[i, :, :n]).abs().max()
    one = ops.attention(q[:, :, t - 1:], k, v, pos[:, t - 1:], lens, backend="triton")  # the split launch
    ref1 = ops.attention(q[:, :, t - 1:].float(), k.float(), v.float(), pos[:, t - 1:], lens, backend="torch")
    assert torch.allclose(one, ref1, rtol=tol, atol=tol), (one - ref1).abs().max()


@pytest.mark.interpreter
def test_kv_len_clamped_stale_ignored_and_empty_rows(device):
    """kv_len beyond the cache reads only the cache; NaN beyond kv_len never enters a sum; a query with
    no valid key (kv_len 0, or a padding position -1) gives 0, through both launches."""
    bm, bn, sn = _cfg()
    b, hq, hkv, d, t = 2, 4, 2, 16, 2 * sn + 3
    q, k, v = _qkv(b, hq, hkv, t, d, device, seed=50)
    q1 = q[:, :, -1:]
    p = torch.full((b, 1), t - 1, device=device)
    ref = ops.attention(q1, k, v, p, torch.full((b,), t, device=device), backend="triton")
    over = ops.attention(q1, k, v, p + 40, torch.full((b,), t + 40, device=device), backend="triton")
    assert torch.equal(over, ref)
    kc, vc = _cache(k, v, t + sn + 5, seed=54, stale=float("nan"))
    assert torch.equal(ops.attention(q1, kc, vc, p, torch.full((b,), t, device=device), backend="triton"), ref)
    for split in (False, True):
        empty = _fwd(q1, k, v, p, torch.tensor([0, t], device=device), split=split)
        assert torch.equal(empty[0], torch.zeros_like(empty[0])) and torch.equal(empty[1], ref[1])
        pad = _fwd(q1, k, v, torch.tensor([[-1], [t - 1]], device=device), torch.full((b,), t, device=device), split=split)
        assert torch.equal(pad[0], torch.zeros_like(pad[0])) and torch.equal(pad[1], ref[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_one_binary_and_model_shape():
    """On the GPU: Qwen3 attention shape (16/8 heads, head_dim 128, bf16), decode over a 2048-key cache ==
    prefill bitwise at the chunk boundaries; and the prefill and decode launches ran one compiled
    binary of the attention kernel (no value specialization between them)."""
    from minite_core.kernels import attention as A

    bm, bn, sn = _cfg()
    b, hq, hkv, d, t = 2, 16, 8, 128, 2 * sn + 77
    q, k, v = _qkv(b, hq, hkv, t, d, "cuda", seed=60)
    pos = torch.arange(t, device="cuda").expand(b, t).contiguous()
    full = ops.attention(q, k, v, pos, torch.full((b,), t, device="cuda"), backend="triton")
    kernels = A._attention_kernel.device_caches[torch.cuda.current_device()][0]
    compiled = set(kernels)
    kc, vc = _cache(k, v, 2048, seed=64)
    for p in (0, bn - 1, bn, sn - 1, sn, sn + 1, 2 * sn, t - 1):
        one = ops.attention(q[:, :, p:p + 1], kc, vc, torch.full((b, 1), p, device="cuda"),
                            torch.full((b,), p + 1, device="cuda"), backend="triton")
        assert torch.equal(one, full[:, :, p:p + 1]), p
    assert set(kernels) == compiled, "the decode launches compiled another binary than the prefill's"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stages", [1, 2])
def test_gpu_decode_stages_change_no_bit(monkeypatch, stages):
    """attention.DECODE_STAGES (the decode launch's pipelining depth, a binary of its own): at the model shape,
    decode over a cache == the prefill's bits, through both launches and with the fused quantize."""
    from minite_core.kernels import attention as A

    bm, bn, sn = _cfg()
    b, hq, hkv, d, t = 3, 16, 8, 128, sn + 77
    q, k, v = _qkv(b, hq, hkv, t, d, "cuda", seed=70)
    pos = torch.arange(t, device="cuda").expand(b, t).contiguous()
    full = ops.attention(q, k, v, pos, torch.full((b,), t, device="cuda"), backend="triton")
    kc, vc = _cache(k, v, 512, seed=74)
    quantized = {}
    for staged in (None, stages):
        monkeypatch.setattr(A, "DECODE_STAGES", staged)
        for p in (0, bn, sn - 1, sn, t - 1):
            qp, pp, lp = q[:, :, p:p + 1], torch.full((b, 1), p, device="cuda"), torch.full((b,), p + 1, device="cuda")
            for split in (True, False):  # (the tile launch quantizes in _attention_kernel, the split in the combine)
                assert torch.equal(_fwd(qp, kc, vc, pp, lp, split=split), full[:, :, p:p + 1]), (staged, p, split)
                out, parts = A.attention_forward(qp, kc, vc, pp, lp, d ** -0.5, split=split, out_dtype=torch.bfloat16,
                                                 quantize=True)
                ref = quantized.setdefault((p, split), (out, parts))
                assert torch.equal(out, ref[0]) and all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                                                        for x, y in zip(parts, ref[1])), (staged, p, split)


@pytest.mark.interpreter
def test_output_rounded_in_the_kernel_to_the_model_dtype(device):
    """out_dtype: the fp32 output rounded to nearest even in the kernel (both launches), laid out [B, Tq, H, D]
    (so the model's [B, Tq, H * D] is a view); the gradient flows as through the fp32 output."""
    from minite_core.kernels.attention import attention_forward

    _, _, sn = _cfg()
    b, hq, hkv, d, t = 2, 4, 2, 16, 2 * sn + 3
    q, k, v = _qkv(b, hq, hkv, t, d, device, seed=40)
    pos = torch.arange(t, device=device).expand(b, t).contiguous()
    lens = torch.tensor([t, sn + 2], device=device)
    for split in (False, True):
        ref = _fwd(q, k, v, pos, lens, split=split)
        got = attention_forward(q, k, v, pos, lens, d ** -0.5, split=split, out_dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and got.transpose(1, 2).is_contiguous()
        assert torch.equal(got, ref.to(torch.bfloat16))
    qf, kf, vf = (z.float().requires_grad_(True) for z in (q, k, v))
    g = _rand(b, hq, t, d, seed=44, device=device)
    grads = [torch.autograd.grad(ops.attention(qf, kf, vf, pos, lens, backend="triton", out_dtype=dt), (qf, kf, vf),
                                 g.to(dt or torch.float32)) for dt in (None, torch.bfloat16)]
    assert all(torch.allclose(a, r, rtol=1e-2, atol=1e-2) for a, r in zip(*grads))
    assert torch.equal(ops.attention(q, k, v, pos, lens, backend="torch", out_dtype=torch.bfloat16),
                       ops.attention(q, k, v, pos, lens, backend="torch").to(torch.bfloat16))


def _nvfp4_equal(a, b) -> bool:
    same = (torch.equal(a.data, b.data) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
            and torch.equal(a.global_scale.flatten(), b.global_scale.flatten()))
    return same and (a.decoded is None) == (b.decoded is None) and (a.decoded is None or torch.equal(a.decoded, b.decoded))


@pytest.mark.interpreter
@pytest.mark.parametrize("decoded", [False, True], ids=["codes", "decoded"])
def test_decode_step_quantizes_its_output_rows_in_the_kernel(device, decoded):
    """A decode step's attention also quantizes each sequence's output row (all its heads: the o_proj input) in
    the kernel that stores the row's last part, through both launches (one program per KV head, or the split
    launch's combine): the bits of `quantize_triton` on the stored rows, the output unchanged, the arrival
    counters back at zero (a second call, as a CUDA graph replays it, gives the same bits)."""
    from minite_core.kernels import gemm
    from minite_core.kernels.attention import attention_forward
    from minite_core.kernels.quantize import as_nvfp4, quantize_triton

    _, _, sn = _cfg()
    s, b, hq, hkv, d = 5, 3, 4, 2, 16  # 3 sequences in slots of a 5-row cache
    cap = 3 * sn + 2
    kc, vc = _rand(s, hkv, cap, d, seed=70, device=device), _rand(s, hkv, cap, d, seed=71, device=device)
    q = _rand(b, hq, 1, d, seed=72, device=device) * 3
    at = torch.tensor([[2 * sn + 1], [0], [sn - 1]], device=device)
    slots = torch.tensor([4, 0, 2], device=device)
    for split in (False, True):
        plain = attention_forward(q, kc, vc, at, at[:, 0] + 1, d ** -0.5, split=split, kv_rows=slots,
                                  out_dtype=torch.bfloat16)
        for _ in range(2):
            out, parts = attention_forward(q, kc, vc, at, at[:, 0] + 1, d ** -0.5, split=split, kv_rows=slots,
                                           out_dtype=torch.bfloat16, quantize=True, decoded=decoded)
            assert torch.equal(out, plain)
            rows = plain.transpose(1, 2).reshape(b, hq * d)
            assert rows.abs().amax(1).unique().numel() == b  # rows of distinct ranges: each its own global scale
            assert _nvfp4_equal(as_nvfp4(parts, (b, hq * d)), quantize_triton(rows, None, decoded=decoded)), split
            assert not gemm.tile_counters(q.device, b)[:b].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_step_quantize_at_the_model_shape():
    """On the GPU, Qwen3 heads (16 / 8, head_dim 128): the o_proj input quantized by the last of a row's 8
    programs (64 sequences: the one-program launch; 3: the split launch's combine) equals `quantize_triton` of
    the stored rows, over repeated calls (the arrival counters, the read-back of the other programs' parts)."""
    from minite_core.kernels import gemm
    from minite_core.kernels.attention import attention_forward
    from minite_core.kernels.quantize import as_nvfp4, quantize_triton

    hq, hkv, d, cap = 16, 8, 128, 2048
    kc, vc = _rand(66, hkv, cap, d, seed=90, device="cuda"), _rand(66, hkv, cap, d, seed=91, device="cuda")
    for b in (3, 64):
        gen = torch.Generator().manual_seed(b)
        at = torch.randint(0, cap, (b, 1), generator=gen).cuda()
        slots = torch.randperm(66, generator=gen)[:b].cuda()
        q = _rand(b, hq, 1, d, seed=92 + b, device="cuda")
        for _ in range(5):
            out, parts = attention_forward(q, kc, vc, at, at[:, 0] + 1, d ** -0.5, kv_rows=slots,
                                           out_dtype=torch.bfloat16, quantize=True)
            ref = quantize_triton(out.transpose(1, 2).reshape(b, hq * d), None)
            assert _nvfp4_equal(as_nvfp4(parts, (b, hq * d)), ref), b
        assert not gemm.tile_counters(q.device, b)[:b].any()


@pytest.mark.interpreter
def test_attention_quantize_op(device):
    """ops.attention(quantize=True): the fused decode step over a cache, and every other call (a prefill, the torch
    backend) by `quantize` of the output as the o_proj reads it [B, Tq, Hq * D], the same bits either way; it is
    for inference with out_dtype set, and the kernel refuses a call it cannot fuse."""
    from minite_core.kernels.attention import attention_forward

    _, _, sn = _cfg()
    b, hq, hkv, d, t = 2, 4, 2, 16, sn + 3
    q, k, v = _qkv(b, hq, hkv, t, d, device, seed=80)
    pos = torch.arange(t, device=device).expand(b, t).contiguous()
    lens = torch.full((b,), t, device=device)
    slots = torch.arange(b, device=device)
    full, full_q = ops.attention(q, k, v, pos, lens, backend="triton", out_dtype=torch.bfloat16, quantize=True)
    assert tuple(full_q.shape) == (b, t, hq * d)
    assert _nvfp4_equal(full_q, ops.quantize(full.transpose(1, 2).reshape(b, t, hq * d), backend="triton",
                                             decoded=full_q.decoded is not None))
    one, one_q = ops.attention(q[:, :, -1:], k, v, pos[:, -1:], lens, backend="triton", kv_rows=slots,
                               out_dtype=torch.bfloat16, quantize=True)  # fused
    assert torch.equal(one, full[:, :, -1:])
    assert _nvfp4_equal(one_q, ops.quantize(full[:, :, -1:].transpose(1, 2).reshape(b, 1, hq * d), backend="triton",
                                            decoded=one_q.decoded is not None))
    ref, ref_q = ops.attention(q.float(), k.float(), v.float(), pos, lens, backend="torch", out_dtype=torch.bfloat16,
                               quantize=True)
    assert _nvfp4_equal(ref_q, ops.quantize(ref.transpose(1, 2).reshape(b, t, hq * d), backend="torch"))
    with pytest.raises(ValueError, match="out_dtype"):
        ops.attention(q, k, v, pos, lens, backend="triton", quantize=True)
    with pytest.raises(ValueError, match="one query a sequence"):
        attention_forward(q, k, v, pos, lens, d ** -0.5, out_dtype=torch.bfloat16, quantize=True)


@pytest.mark.interpreter
def test_gradient_close_to_fp32_autograd(device):
    b, hq, hkv, t, d = 1, 2, 1, 11, 16
    q, k, v = (_rand(b, h, t, d, seed=s, device=device, dtype=torch.float32).requires_grad_(True)
               for s, h in ((9, hq), (10, hkv), (11, hkv)))
    pos = torch.arange(t, device=device).expand(b, t).contiguous()
    lens = torch.full((b,), t, device=device)
    g = _rand(b, hq, t, d, seed=12, device=device, dtype=torch.float32)
    got = torch.autograd.grad(ops.attention(q, k, v, pos, lens, backend="triton"), (q, k, v), g)
    ref = torch.autograd.grad(ops.attention(q, k, v, pos, lens, backend="torch"), (q, k, v), g)
    for a, r in zip(got, ref):
        assert torch.allclose(a, r, rtol=1e-4, atol=1e-4), (a - r).abs().max()


@pytest.mark.interpreter
def test_bad_head_dim(device):
    q = torch.zeros(1, 1, 2, 24, device=device)
    with pytest.raises(ValueError, match="head_dim"):
        ops.attention(q, q, q, torch.zeros(1, 2, dtype=torch.long, device=device), torch.ones(1, dtype=torch.long, device=device),
                      backend="triton")


@pytest.mark.interpreter
@pytest.mark.parametrize("t", [1.0, 0.7])
def test_logsoftmax_kernel_invariant_fused_equal_and_close(device, t):
    """The Triton log-sum-exp: one row alone == that row in a batch; the fused token logprob == the full
    log-softmax at the token (what rollout and learner compare); close to torch; gradient close."""
    v = 301  # not a multiple of the block
    x = _rand(9, v, seed=13, device=device, dtype=torch.float32) * 4
    tok = torch.randint(0, v, (9,), generator=torch.Generator().manual_seed(0)).to(device)
    full = ops.log_softmax(x, t, backend="triton")
    assert torch.equal(ops.log_softmax(x[4:5], t, backend="triton"), full[4:5])
    fused = ops.token_logprobs(x, tok, t, backend="triton")
    assert torch.equal(fused, full.gather(-1, tok.unsqueeze(-1)).squeeze(-1))
    assert torch.equal(ops.token_logprobs(x[2:3], tok[2:3], t, backend="triton"), fused[2:3])
    assert torch.allclose(full, torch.log_softmax(x / t, -1), rtol=1e-5, atol=1e-5)
    xr = x.clone().requires_grad_(True)
    g = _rand(9, seed=14, device=device, dtype=torch.float32)
    (got,) = torch.autograd.grad(ops.token_logprobs(xr, tok, t, backend="triton"), xr, g)
    (ref,) = torch.autograd.grad(torch.log_softmax(xr / t, -1).gather(-1, tok.unsqueeze(-1)).squeeze(-1), xr, g)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
