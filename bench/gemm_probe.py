"""Look inside the W4A4 GEMM kernel on the GPU: registers, spills, shared memory, TTGIR/PTX/SASS.

    python bench/gemm_probe.py OUTDIR            # writes <cfg>.ttgir/.ptx/.sass and prints resources
    ncu --clock-control none -k regex:_gemm_kernel python bench/gemm_probe.py OUTDIR --once

The files are for reading off the device (docs/benchmarks.md explains what they showed).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minite_core import nvfp4  # noqa: E402
from minite_core.kernels import gemm as gemm_mod  # noqa: E402
from minite_core.kernels.quantize import quantize_triton  # noqa: E402


def launch(xq, wq, m, n, k):
    cfg = gemm_mod.gemm_config(m, n, k, True)
    c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    kern = gemm_mod._gemm_kernel[grid](
        xq.data, xq.scale.view(torch.uint8), xq.global_scale.reshape(-1), wq.data, wq.scale.view(torch.uint8),
        wq.global_scale.reshape(-1), c, c, m, n, k, xq.data.stride(0), xq.scale.stride(0), 1,
        wq.data.stride(0), wq.scale.stride(0), 0, c.stride(0),
        FP4=True, DOT_FP32=False, DOT_BY_SUM=False, HAS_BIAS=False, **cfg,
    )
    return cfg, kern


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    once = "--once" in sys.argv
    n, k = 12288, 4096
    wq = nvfp4.quantize(torch.randn(n, k, device="cuda") * 0.02, scale_mode="tensor")
    for m in (16, 4096):
        xq = quantize_triton(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), None)
        cfg, kern = launch(xq, wq, m, n, k)
        torch.cuda.synchronize()
        if once:
            continue
        name = f"M{m}_{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}_w{cfg['num_warps']}"
        (out / f"{name}.ttgir").write_text(kern.asm["ttgir"])
        (out / f"{name}.ptx").write_text(kern.asm["ptx"])
        cubin = out / f"{name}.cubin"
        cubin.write_bytes(kern.asm["cubin"])
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True).stdout
        (out / f"{name}.sass").write_text(sass)
        cubin.unlink()
        ops = {op: sass.count(op) for op in ("HGMMA", "HMMA", "LDG", "LDS", "STS", "LDSM", "SHFL", "PRMT", "BAR")}
        print(f"{name}: regs={kern.n_regs} spills={kern.n_spills} smem={kern.metadata.shared} sass_ops={ops}", flush=True)


if __name__ == "__main__":
    main()
