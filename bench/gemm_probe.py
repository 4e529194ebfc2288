"""Look inside the W4A4 GEMM kernels: registers, spills, shared memory, TTGIR/PTX/SASS, instruction mix.

Two modes:

    python bench/gemm_probe.py OUTDIR --sm90     # no GPU needed: compile for sm_90 on this machine
    python bench/gemm_probe.py OUTDIR            # on the GPU: compile through the JIT, as the kernels run
    ncu --clock-control none -k regex:_gemm_kernel python bench/gemm_probe.py OUTDIR --once

`--sm90` builds each config with `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`,
giving the pointer and stride arguments the divisibility (16) the JIT infers for contiguous tensors with
K % 128 == 0, then runs Triton's own `ptxas -v` (registers, spills, shared memory) and `cuobjdump -sass`.
It writes <name>.ttgir/.ptx/.sass under OUTDIR and prints, per config, the resources and the
instruction mix of the K loop (the SASS block that ends in the backward branch): HGMMA, LDGSTS, and
the decode ALU ops, per packed byte of the tile. docs/gemm_sass.md reads these numbers.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)  # this script compiles; it never interprets

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from minite_core.kernels import attention as att_mod  # noqa: E402
from minite_core.kernels import gemm as gemm_mod  # noqa: E402
from minite_core.kernels import grouped_gemm as gg  # noqa: E402
from minite_core.kernels import qk_norm_rope as qkr_mod  # noqa: E402
from minite_core.kernels import quantize as qmod  # noqa: E402
from minite_core.kernels import rows as rows_mod  # noqa: E402

SHAPE = (12288, 4096)  # N, K of the dense projection in bench/gemm.py


def _bin(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


# --------------------------------------------------------------------------------------- sm_90, on the CPU

_PTRS = dict(a_ptr="*u8", as_ptr="*u8", ags_ptr="*fp32", b_ptr="*u8", bs_ptr="*u8", bgs_ptr="*fp32",
             bias_ptr="*bf16", c_ptr="*bf16", off_ptr="*i32", p_ptr="*fp32", cnt_ptr="*i32",
             # the row kernels (bf16 activations, NVFP4 outputs)
             X="*bf16", W="*bf16", Y="*bf16", RSTD="*fp32", Q="*u8", QS="*u8", QGS="*fp32", GATE="*bf16", UP="*bf16",
             OUT="*bf16", x_ptr="*bf16", data_ptr="*u8", scale_ptr="*u8", gs_ptr="*fp32", DELTA="*bf16", XS="*bf16",
             QD="*fp16", dec_ptr="*fp16")
# the q/k norm + RoPE kernel's pointers (its K and S are tensors, the GEMM's are sizes)
_QK_PTRS = dict(Q="*bf16", K="*bf16", V="*bf16", WQ="*bf16", WK="*bf16", C="*bf16", S="*bf16", QO="*bf16", KO="*bf16",
                VO="*bf16", QN="*bf16", KN="*bf16", RQ="*fp32", RK="*fp32", SLOT="*i32", POS="*i64")
_ATT_PTRS = dict(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", MS="*fp32", LS="*fp32", ACCS="*fp32", QPOS="*i32",
                 KVLEN="*i32", KVROW="*i32", CNT="*i32", QP="*u8", QS="*u8", QGS="*fp32", QD="*fp16")
for _i in range(3):  # the GEMM's weights of one launch (segments)
    _PTRS.update({f"b{_i}": "*u8", f"bs{_i}": "*u8", f"bgs{_i}": "*fp32", f"bias{_i}": "*bf16", f"c{_i}": "*bf16"})
_FLOATS = ("nf", "eps", "scale")
# int args that are not multiples of 16 (row counts, tile boundaries, strides that are 0 or 1)
_NOT_DIV16 = ("M", "E", "R", "t1", "t2", "grid_n", "sg0", "sg1", "sg2", "stride_ags", "stride_bgs", "S", "chunk_stride",
              "T", "HQ", "HKV", "scb", "ssb")


def _source(kernel, constexprs: dict, scalars_one: tuple, ptrs: dict | None = None):
    """ASTSource for `kernel` with pointer args (`ptrs`, default _PTRS) aligned to 16 and the int args
    divisible by 16, except those in `scalars_one` (strides that are 0 or 1). DECODED GEMMs read fp16 operands."""
    from triton.compiler import ASTSource

    ptrs = dict(ptrs or _PTRS)
    if constexprs.get("DECODED"):
        ptrs.update({a: "*fp16" for a in ("a_ptr", "as_ptr", "b0", "bs0", "b1", "bs1", "b2", "bs2")})
    elif constexprs.get("A_DECODED"):
        ptrs.update({a: "*fp16" for a in ("a_ptr", "as_ptr")})

    names = kernel.arg_names
    sig, attrs = {}, {}
    for i, a in enumerate(names):
        if a in constexprs:
            sig[a] = "constexpr"
        elif a in ptrs:
            sig[a] = ptrs[a]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif a in _FLOATS:
            sig[a] = "fp32"
        else:
            sig[a] = "i32"
            if a not in scalars_one and a not in _NOT_DIV16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(kernel, sig, constexprs, attrs)


def compile_sm90(kernel, constexprs: dict, num_warps: int, num_stages: int, scalars_one=(), ptrs=None):
    from triton.backends.compiler import GPUTarget

    src = _source(kernel, constexprs, scalars_one, ptrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))


def ptxas_report(ptx: str) -> dict:
    """`ptxas -v` on the PTX Triton generated: registers, spill bytes, stack."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.ptx"
        p.write_text(ptx)
        ptxas = _bin("ptxas-blackwell") if Path(_bin("ptxas-blackwell")).exists() else _bin("ptxas")  # Triton's PTX version
        r = subprocess.run([ptxas, "-v", "-arch=sm_90a", str(p), "-o", str(Path(d) / "k.cubin")],
                           capture_output=True, text=True)
    text = r.stderr + r.stdout
    get = lambda pat: int(m.group(1)) if (m := re.search(pat, text)) else 0  # noqa: E731
    return {"registers": get(r"Used (\d+) registers"), "spill_stores": get(r"(\d+) bytes spill stores"),
            "spill_loads": get(r"(\d+) bytes spill loads"), "smem_static": get(r"(\d+) bytes smem"),
            "stack": get(r"(\d+) bytes stack frame"), "ptxas": text.strip()}


def sass_of(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.cubin"
        p.write_bytes(cubin)
        return subprocess.run([_bin("cuobjdump"), "-sass", str(p)], capture_output=True, text=True).stdout


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?")


def loops(sass: str) -> list[list[tuple[int, str]]]:
    """Every span a backward `BRA 0x...` closes (cuobjdump prints branch targets as addresses), as lists of
    (address, opcode with suffixes), innermost (shortest) first."""
    instrs, spans = [], []
    for line in sass.splitlines():
        m = _INSTR.search(line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        instrs.append((addr, m.group(3) + (m.group(4) or "")))
        t = re.search(r"\bBRA\s+0x([0-9a-f]+)", line)
        if m.group(3) == "BRA" and t and int(t.group(1), 16) < addr:
            spans.append((int(t.group(1), 16), addr))
    return [[(a, op) for a, op in instrs if lo <= a <= hi] for lo, hi in sorted(spans, key=lambda s: s[1] - s[0])]


def main_loop(sass: str) -> list[tuple[int, str]]:
    """The K loop: the longest span a backward branch closes (a nested step loop is inside it)."""
    spans = loops(sass)
    return spans[-1] if spans else []


DECODE_OPS = ("LOP3", "SHF", "IMAD", "PRMT", "HMUL2", "HFMA2", "HADD2", "I2F", "F2F", "F2FP", "SEL", "IADD3", "LEA",
              "MOV", "SHL", "SHR", "BFE", "BMSK")


def mix(loop: list[tuple[int, str]]) -> Counter:
    return Counter(op.split(".")[0] for _, op in loop)


def _walk(k: int, cfg: dict) -> int:
    """`w4a4_tile`'s CHUNKED for a config of K: 0 (one chunk), 1 (chunks of several steps), 2 (one-step chunks)."""
    return gemm_mod.walk_mode(k, cfg["CHUNKS"], cfg["BLOCK_K"])


def sm90_cases() -> list[tuple]:
    """(name, kernel, constexprs, config, scalar args that are 0 or 1, M, [pointer types]) of every kernel
    probed; the kernels that take PDL get PDL=True, as they launch on sm_90."""
    n, k = SHAPE
    cases = []
    # SHAPE (S = 2), plus the Qwen3-0.6B decode shape 1024 x 1024 (S = 4) and N = 16384 (S = 1), 6144 x 2048
    # (the 1.7B gate/up, S = 4) and 2048 x 512 (S = 4): the chunk walks, long (12288 x 4096), of 2 and 4 steps,
    # of one step
    for (n_, k_), ms in ((SHAPE, (1, 16, 32, 64, 128, 4096)), ((1024, 1024), (16, 64, 4096)), ((16384, 4096), (4096,)),
                         ((6144, 2048), (4096,)), ((2048, 512), (4096,))):
        # a_dec: the activation decoded, the weight packed (DECODE_X_MIN_M at M = 64; WIDE_PACKED_MAX_M at 4096)
        extra = [(64, True), (4096, True)] if (n_, k_) == (1024, 1024) else [(4096, True)] if (n_, k_) == (6144, 2048) else []
        for m, a_dec in [(m, False) for m in ms] + extra:
            cfg = dict(_gpu_config(m, n_, k_), A_DECODED=a_dec)
            if a_dec:
                cfg["DECODED"] = False
            for nseg in ((1, 3) if (n_, k_) == (1024, 1024) and not a_dec else (1,)):  # 3: q/k/v in one launch
                const = dict(FP4=True, DOT_FP32=False, DOT_BY_SUM=False, EVEN_K=True, HAS_BIAS=False,
                             SWAP_AB=cfg["SWAP_AB"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                             GROUP_M=cfg["GROUP_M"], CHUNKED=_walk(k_, cfg), SPLIT=cfg["SPLIT"],
                             DECODED=cfg["DECODED"], A_DECODED=a_dec, NSEG=nseg,
                             FIXUP=cfg["SPLIT"] and gemm_mod.COMBINE_IN_KERNEL)
                kind = "split" if cfg["SPLIT"] else ("walk" if cfg["CHUNKS"] > 1 else "one")
                name = (f"dense_{n_}x{k_}_M{m}_S{cfg['CHUNKS']}{kind}_{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}_"
                        f"{'swap' if cfg['SWAP_AB'] else 'wide'}{'_decoded' if cfg['DECODED'] else ''}{'_xdecoded' if a_dec else ''}"
                        f"{f'_{nseg}weights' if nseg > 1 else ''}_w{cfg['num_warps']}s{cfg['num_stages']}")
                cases.append((name, gemm_mod._gemm_kernel, const, cfg, (), m))
    # the plain bf16 GEMM (BF16 models' linears, every model's lm_head): swapped at decode, 128x128 above
    plain_ptrs = dict(_PTRS, a_ptr="*bf16", as_ptr="*bf16", ags_ptr="*bf16",
                      **{f"{a}{i}": "*bf16" for i in range(3) for a in ("b", "bs", "bgs")})
    for m in (16, 64, 4096):
        cfg = _gpu_config(m, 151936, 1024, fp4=False)
        const = dict(FP4=False, DOT_FP32=False, DOT_BY_SUM=False, EVEN_K=True, HAS_BIAS=False, SWAP_AB=cfg["SWAP_AB"],
                     BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
                     CHUNKED=False, SPLIT=False, DECODED=False, A_DECODED=False, NSEG=1, FIXUP=False)
        name = (f"plain_bf16_151936x1024_M{m}_{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}_"
                f"{'swap' if cfg['SWAP_AB'] else 'wide'}_w{cfg['num_warps']}s{cfg['num_stages']}")
        cases.append((name, gemm_mod._gemm_kernel, const, cfg, (), m, plain_ptrs))
    cfg = dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=16, num_warps=4, num_stages=1)
    for nseg in (1, 3):
        cases.append((f"combine_32x128_{nseg}weights", gemm_mod._combine_kernel,
                      dict(HAS_BIAS=False, BLOCK_M=32, BLOCK_N=128, NSEG=nseg), cfg, (), 32))
    for bm in (16, 64):
        cfg = dict(gemm_mod.SWAP_CONFIGS[bm], BLOCK_M=bm, BLOCK_K=gemm_mod.FP4_BLOCK_K, SWAP_AB=True)
        const = dict(EVEN_K=True, SWAP_AB=True, BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], E_PAD=128,
                     CHUNKED=_walk(k, dict(cfg, CHUNKS=gemm_mod.k_chunks(n, k))))
        name = f"grouped_E128_S{gemm_mod.k_chunks(n, k)}_{bm}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}_w{cfg['num_warps']}s{cfg['num_stages']}"
        cases.append((name, gg._grouped_kernel, const, cfg, ("stride_ags", "stride_bgse", "stride_bgsn"), bm))
    # the row kernels that quantize their output (RMSNorm, SiLU * up) and the quantize kernel, 0.6B/1.7B widths
    for n_ in (1024, 2048):
        rows_, block, warps = rows_mod.rms_norm_config(n_)
        cases.append((f"add_rms_norm_quantize_N{n_}", rows_mod._rms_norm_fwd_kernel,
                      dict(ROWS=rows_, BLOCK=block, QUANT=True, RESIDUAL=True, DBK=128),  # (with the decoded form)
                      dict(BLOCK_M=rows_, BLOCK_N=block, BLOCK_K=16, num_warps=warps, num_stages=1), (), rows_))
    for n_ in (3072, 6144):  # with the decoded form, as the learner's wide tiles take it
        cases.append((f"silu_mul_quantize_N{n_}", rows_mod._silu_mul_quantize_kernel,
                      dict(NB=64, EVEN=True, DBK=128, ONE_TILE=0),
                      dict(BLOCK_M=1, BLOCK_N=1024, BLOCK_K=16, num_warps=4, num_stages=1), (), 1))
        tile = qmod.one_tile(16, n_)  # a decode step's rows: the whole row in one tile, no decoded form
        cases.append((f"silu_mul_quantize_one_tile_N{n_}", rows_mod._silu_mul_quantize_kernel,
                      dict(NB=64, EVEN=True, DBK=1, ONE_TILE=tile),
                      dict(BLOCK_M=1, BLOCK_N=tile, BLOCK_K=16, num_warps=qmod.one_tile_warps(tile), num_stages=1), (), 1))
    for to_cache in (False, True):  # Qwen3-0.6B heads: 16 q, 8 k/v, head_dim 128
        cases.append((f"qk_norm_rope_{'cache' if to_cache else 'buffers'}", qkr_mod._qk_norm_rope_kernel,
                      dict(BLOCK_H=16, D=128, TO_CACHE=to_cache, NORM_OUT=False),
                      dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=16, num_warps=4, num_stages=1), (), 1, _QK_PTRS))
    # the FP8 backward's per-row e4m3 operands (bf16 in)
    from minite_core.kernels import fp8 as fp8_mod
    cases.append(("e4m3_rows", fp8_mod._e4m3_rows_kernel, dict(HW_CVT=True, BLOCK_R=16, BLOCK_C=256),
                  dict(BLOCK_M=16, BLOCK_N=256, BLOCK_K=16, num_warps=4, num_stages=1), ("stride_c",), 16,
                  dict(a_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32")))
    cases.append(("quantize_row_gs", qmod._quantize_kernel, dict(ROW_GS=True, NB=64, EVEN_K=True, DBK=128, ONE_TILE=0),
                  dict(BLOCK_M=1, BLOCK_N=1024, BLOCK_K=16, num_warps=4, num_stages=1), ("stride_gs",), 1))
    for k_ in (2048, 8192):  # a decode step's rows (the o_proj input at K = 2048): the whole row in one tile
        tile = qmod.one_tile(16, k_)
        cases.append((f"quantize_row_gs_one_tile_K{k_}", qmod._quantize_kernel,
                      dict(ROW_GS=True, NB=64, EVEN_K=True, DBK=1, ONE_TILE=tile),
                      dict(BLOCK_M=1, BLOCK_N=tile, BLOCK_K=16, num_warps=qmod.one_tile_warps(tile), num_stages=1),
                      ("stride_gs",), 1))
    # the learner's re-quantize: every weight in one launch (fp32 masters), with the decoded form and the bf16 values
    cases.append(("quantize_many", qmod._quantize_many_kernel, dict(XDT=tl.float32, NB=64, DBK=128, DQ=True),
                  dict(BLOCK_M=1, BLOCK_N=1024, BLOCK_K=16, num_warps=4, num_stages=1), (), 1,
                  dict(meta_ptr="*i64", row_tensor_ptr="*i32", gs_ptr="*fp32")))
    br, bk = qmod.DEQUANTIZE_TILE
    for bits in (True, False):  # the backward's dequantize: bf16 rounded on the bits, or fp32
        cases.append((f"dequantize_{'bf16' if bits else 'fp32'}", qmod._dequantize_kernel,
                      dict(BF16_BITS=bits, BLOCK_R=br, BLOCK_K=bk),
                      dict(BLOCK_M=br, BLOCK_N=1, BLOCK_K=bk, num_warps=4, num_stages=1), ("stride_gs",), br,
                      dict(p_ptr="*u8", s_ptr="*u8", gs_ptr="*fp32", o_ptr="*i16" if bits else "*fp32")))
    cases.append(("silu_mul", rows_mod._silu_mul_fwd_kernel, dict(BLOCK=1024),
                  dict(BLOCK_M=1, BLOCK_N=1024, BLOCK_K=16, num_warps=4, num_stages=1), (), 1))
    bm, bn, sn = att_mod.attention_config()  # decode: a KV head's query heads in one tile, the cache rows by slot
    # and with the o_proj input's quantize of a 0.6B / 1.7B row (16 heads x 128) and of a 64-head one (8192)
    for qn in (0, 2048, 8192):
        quant = dict(QUANT=qn > 0, BLOCK_Q=qn or 16, DBK=1)
        sfx = f"_quantize_{qn}" if qn else ""
        cases.append((f"attention_decode{sfx}", att_mod._attention_kernel,
                      dict(D=128, BLOCK_M=bm, BLOCK_N=bn, SPLIT_N=sn, DOT_BY_SUM=False, IEEE=False, HAS_KVROW=True, **quant),
                      dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=16, num_warps=att_mod.NUM_WARPS, num_stages=1),
                      ("spb", "spr", "NGRP", "GPK", "ROWS", "TK", "NSPLIT", "CPS"), 1, _ATT_PTRS))
        cases.append((f"attention_combine{sfx}", att_mod._combine_kernel, dict(D=128, BLOCK_R=16, **quant),
                      dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=16, num_warps=4, num_stages=1),
                      ("sob", "sog", "sor", "NGRP", "ROWS", "NSPLIT"), 1, _ATT_PTRS))
    return [(name, kern, dict(const, PDL=True) if "PDL" in kern.arg_names else const, *rest)
            for name, kern, const, *rest in cases]


def probe_sm90(out: Path) -> list[dict]:
    rows = []
    for name, kern, const, cfg, ones, m, *ptrs in sm90_cases():
        ck = compile_sm90(kern, const, cfg["num_warps"], cfg["num_stages"], ones, *ptrs)
        ttgir, ptx = ck.asm["ttgir"], ck.asm["ptx"]
        sass = sass_of(ck.asm["cubin"])
        (out / f"{name}.ttgir").write_text(ttgir)
        (out / f"{name}.ptx").write_text(ptx)
        (out / f"{name}.sass").write_text(sass)
        rep = ptxas_report(ptx)
        mma = re.search(r"versionMajor = (\d+)", ttgir)
        loop = main_loop(sass)
        c = mix(loop)
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        bytes_step = (bm + bn) * bk // 2 + (bm + bn) * bk // 16  # packed bytes + scale bytes per K step per program
        decode = sum(c[o] for o in DECODE_OPS)
        row = dict(name=name, mma_version=int(mma.group(1)) if mma else None, registers=rep["registers"],
                   spill_bytes=rep["spill_stores"] + rep["spill_loads"], smem_dynamic=ck.metadata.shared,
                   loop_instructions=len(loop), HGMMA=c["HGMMA"], HMMA=c["HMMA"], LDGSTS=c["LDGSTS"], LDG=c["LDG"],
                   LDS=c["LDS"] + c["LDSM"], STS=c["STS"], BAR=c["BAR"] + c["WARPSYNC"], decode_alu=decode,
                   decode_alu_per_packed_byte=round(decode * 32 * cfg["num_warps"] / ((bm + bn) * bk // 2), 2),
                   bytes_per_k_step=bytes_step, flops_per_k_step=2 * bm * bn * bk,
                   mix=dict(c.most_common(24)))
        rows.append(row)
        (out / f"{name}.ptxas.txt").write_text(rep["ptxas"])
        print(row, flush=True)
    return rows


def _gpu_config(m, n, k, fp4=True):
    """gemm_config as on the GPU (this script may be imported where the interpreter is on: the tests)."""
    saved, gemm_mod._INTERPRET = gemm_mod._INTERPRET, False
    try:
        return gemm_mod.gemm_config(m, n, k, fp4)
    finally:
        gemm_mod._INTERPRET = saved


# --------------------------------------------------------------------------------------- on the GPU


def launch(xq, wq, m, n, k):
    """One launch of the W4A4 GEMM for (M, N, K) -> (its config, the compiled kernel)."""
    import torch

    cfg = dict(gemm_mod.gemm_config(m, n, k, True))
    c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    xd = gemm_mod.decode_nvfp4(xq, cfg["BLOCK_K"]) if cfg["DECODED"] or cfg["A_DECODED"] else None
    return cfg, gemm_mod._launch(xq, xd, [(wq, None, c)], cfg, True)


def probe_gpu(out: Path, once: bool):
    import torch

    from minite_core import nvfp4
    from minite_core.kernels.quantize import quantize_triton

    n, k = SHAPE
    wq = nvfp4.quantize(torch.randn(n, k, device="cuda") * 0.02, scale_mode="tensor")
    for m in (1, 16, 64, 128, 4096):
        xq = quantize_triton(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), None)
        cfg, kern = launch(xq, wq, m, n, k)
        torch.cuda.synchronize()
        if once:
            continue
        name = f"M{m}_S{cfg['CHUNKS']}{'split' if cfg['SPLIT'] else ''}_{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}_w{cfg['num_warps']}"
        (out / f"{name}.ttgir").write_text(kern.asm["ttgir"])
        (out / f"{name}.ptx").write_text(kern.asm["ptx"])
        sass = sass_of(kern.asm["cubin"])
        (out / f"{name}.sass").write_text(sass)
        print(f"{name}: regs={kern.n_regs} spills={kern.n_spills} smem={kern.metadata.shared} "
              f"loop={dict(mix(main_loop(sass)).most_common(16))}", flush=True)


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if "--sm90" in sys.argv:
        import json

        rows = probe_sm90(out)
        (out / "summary.json").write_text(json.dumps(rows, indent=1))
    else:
        probe_gpu(out, "--once" in sys.argv)


if __name__ == "__main__":
    main()
