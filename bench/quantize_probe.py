"""The activation-quantize kernel against copy bandwidth on the 0.6B / 1.7B / 12288x4096 widths (GPU)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gemm import bench  # noqa: E402
from minite_core.kernels import quantize as q  # noqa: E402

for rows, k in ((8192, 1024), (8192, 2048), (8192, 3072), (8192, 4096), (8192, 6144), (4096, 12288)):
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(x)
    t_copy = bench(lambda: dst.copy_(x))
    row = {}
    for nb in (64, 512):
        q.MAX_NB = nb
        t = bench(lambda: q.quantize_triton(x, None))
        useful = x.numel() * 2 + x.numel() // 2 + x.numel() // 16 + 4 * rows  # bytes read once + written
        row[nb] = (useful / t) / (4 * x.numel() / t_copy)
    print(f"quantize {rows}x{k}: copy {4 * x.numel() / t_copy / 1e9:.0f} GB/s; vs copy: tile 64 blocks {row[64]:.2f}, "
          f"up to 512 blocks (one read) {row[512]:.2f}", flush=True)
