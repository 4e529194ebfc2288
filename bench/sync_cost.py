"""Weight-sync cost per push, by model size: bytes of one full push in packed NVFP4 vs BF16, and seconds
per push at the measured gRPC push throughput. Pure arithmetic from the Qwen3 config.json shapes: no
GPU, no weights, nothing downloaded.

    python bench/sync_cost.py [--replicas 1,8,32] [--nic-gbit 100] [--nvfp4-gbps 1.02] [--bf16-gbps 0.68] [--markdown]

What one push carries is what `services/common/weights.py` streams: every tensor of
`Qwen3Config.expected_shapes()` (the per-expert MoE layout; no lm_head when the embeddings are tied).
In NVFP4 the linear layers (`minite_core.model.load.is_linear_weight`: q/k/v/o and the MLP / expert gate, up and
down projections) travel packed: two e2m1 codes per byte, one e4m3 block scale (1 byte) per 16 values,
one fp32 per-tensor global scale (4 bytes); everything else (embeddings, lm_head, norms, the MoE router)
travels as bf16. In BF16 every tensor is 2 bytes per value. MB and GB are 10^6 and 10^9 bytes.

Seconds per push = bytes / throughput of one push stream. The default throughputs are the steady-state
figures of `python bench/weight_sync.py --repeats 10` in docs/benchmarks.md ("The services"): 1.02 GB/s
for NVFP4 and 0.68 GB/s for BF16, one stream over loopback on a 2-core CPU machine where client and
server share the cores (serialize, stream in 2 MiB chunks, CRC-32 per chunk, assemble, validate, swap).

Fan-out to N replicas: the learner packs a version once and pushes it to all replicas concurrently, one
stream each, so N streams of B bytes take max(B / stream rate, N * B / NIC rate): the per-stream cost
while the learner's NIC has room, the NIC's egress once N * stream rate exceeds it. This is a model, not
a measurement: it assumes the learner has a core per stream for the framing and checksums.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minite_core.model.load import is_linear_weight  # noqa: E402  (the tensors load_model quantizes in NVFP4)
from minite_core.model.qwen3 import Qwen3Config  # noqa: E402

_COMMON = dict(vocab_size=151936, head_dim=128, attention_bias=False, rms_norm_eps=1e-6, rope_theta=1000000,
               max_position_embeddings=40960)
# The shape fields of the Qwen/<name> config.json files on the Hugging Face Hub.
QWEN3 = {
    "Qwen3-0.6B": dict(_COMMON, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       tie_word_embeddings=True),
    "Qwen3-1.7B": dict(_COMMON, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2048,
                       intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       tie_word_embeddings=True),
    "Qwen3-8B": dict(_COMMON, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     tie_word_embeddings=False),
    "Qwen3-30B-A3B": dict(_COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
}

NVFP4_GBPS = 1.02  # docs/benchmarks.md, "The services": steady NVFP4 push, one stream, loopback, 2 cores
BF16_GBPS = 0.68   # the same run, BF16


def tensor_bytes(shape: tuple, packed: bool) -> int:
    """Bytes one tensor puts on the wire: packed NVFP4 (codes + block scales + fp32 global scale) or bf16."""
    n = math.prod(shape)
    if not packed:
        return 2 * n
    if shape[-1] % 16:
        raise ValueError(f"NVFP4 needs the last dim to be a multiple of 16, got {shape}")
    return n // 2 + n // 16 + 4


def shapes(cfg: dict) -> dict[str, tuple]:
    """Every tensor one push carries, by name, for a HF config.json dict."""
    return Qwen3Config.from_hf(cfg).expected_shapes()


def push_cost(cfg: dict) -> dict:
    """Parameters and bytes per push of one model: nvfp4 (total, and its bf16 part) and bf16."""
    params = nvfp4 = nvfp4_plain = bf16 = 0
    for name, shape in shapes(cfg).items():
        params += math.prod(shape)
        bf16 += tensor_bytes(shape, False)
        if is_linear_weight(name):
            nvfp4 += tensor_bytes(shape, True)
        else:
            nvfp4_plain += tensor_bytes(shape, False)
    return {"params": params, "nvfp4": nvfp4 + nvfp4_plain, "nvfp4_bf16_part": nvfp4_plain, "bf16": bf16}


def fanout_seconds(nbytes: int, replicas: int, stream_gbps: float, nic_gbit: float) -> float:
    """Seconds to push `nbytes` to `replicas` replicas at once: per-stream bound or the learner's NIC bound."""
    return max(nbytes / (stream_gbps * 1e9), replicas * nbytes / (nic_gbit * 1e9 / 8))


def table(nvfp4_gbps: float = NVFP4_GBPS, bf16_gbps: float = BF16_GBPS) -> list[dict]:
    """One row per model: parameters, bytes per push and seconds per push (one stream)."""
    rows = []
    for name, cfg in QWEN3.items():
        c = push_cost(cfg)
        rows.append(dict(c, model=name, ratio=c["nvfp4"] / c["bf16"],
                         nvfp4_s=c["nvfp4"] / (nvfp4_gbps * 1e9), bf16_s=c["bf16"] / (bf16_gbps * 1e9)))
    return rows


def _print(head: list[str], body: list[list[str]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("| --- |" + " ---: |" * (len(head) - 1))
        for b in body:
            print("| " + " | ".join(b) + " |")
    else:
        widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
        print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
        for b in body:
            print("  ".join(c.rjust(w) for c, w in zip(b, widths)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", default="1,8,32", help="replica counts for the fan-out table, comma-separated")
    ap.add_argument("--nic-gbit", type=float, default=100.0, help="the learner's NIC egress, Gbit/s")
    ap.add_argument("--nvfp4-gbps", type=float, default=NVFP4_GBPS, help="one NVFP4 push stream, GB/s")
    ap.add_argument("--bf16-gbps", type=float, default=BF16_GBPS, help="one BF16 push stream, GB/s")
    ap.add_argument("--markdown", action="store_true", help="print Markdown tables")
    args = ap.parse_args(argv)
    try:
        replicas = [int(x) for x in args.replicas.split(",")]
    except ValueError:
        ap.error(f"--replicas must be comma-separated integers, not {args.replicas!r}")
    if min(replicas) < 1 or min(args.nic_gbit, args.nvfp4_gbps, args.bf16_gbps) <= 0:
        ap.error("--replicas, --nic-gbit and the throughputs must be positive")
    rows = table(args.nvfp4_gbps, args.bf16_gbps)
    print(f"Bytes and seconds per push, one stream (NVFP4 at {args.nvfp4_gbps:g} GB/s, BF16 at {args.bf16_gbps:g} GB/s):")
    _print(["model", "params (B)", "NVFP4 MB", "of which bf16 MB", "BF16 MB", "NVFP4 / BF16", "NVFP4 s/push",
            "BF16 s/push"],
           [[r["model"], f"{r['params'] / 1e9:.2f}", f"{r['nvfp4'] / 1e6:,.1f}", f"{r['nvfp4_bf16_part'] / 1e6:,.1f}",
             f"{r['bf16'] / 1e6:,.1f}", f"{r['ratio']:.3f}", f"{r['nvfp4_s']:.2f}", f"{r['bf16_s']:.2f}"] for r in rows],
           args.markdown)
    nic = args.nic_gbit * 1e9 / 8
    print(f"\nSeconds per push to N replicas at once, learner NIC {args.nic_gbit:g} Gbit/s ({nic / 1e9:g} GB/s): "
          f"per-stream bound up to {int(nic // (args.nvfp4_gbps * 1e9))} NVFP4 / {int(nic // (args.bf16_gbps * 1e9))} "
          f"BF16 streams, NIC-bound beyond:")
    _print(["model"] + [f"NVFP4 N={n}" for n in replicas] + [f"BF16 N={n}" for n in replicas],
           [[r["model"]] + [f"{fanout_seconds(r['nvfp4'], n, args.nvfp4_gbps, args.nic_gbit):.2f}" for n in replicas]
            + [f"{fanout_seconds(r['bf16'], n, args.bf16_gbps, args.nic_gbit):.2f}" for n in replicas] for r in rows],
           args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
