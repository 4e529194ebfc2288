"""The weight-sync arithmetic of bench/sync_cost.py (docs/scale-out.md): against a hand count, the bytes a
real push carries, the published Qwen3 sizes, the rates measured in docs/benchmarks.md, and the lines
docs/scale-out.md quotes."""
import re
from pathlib import Path

import pytest

from bench import sync_cost

ROOT = Path(__file__).resolve().parents[2]
SCALE_OUT_DOC = ROOT / "docs" / "scale-out.md"


TINY = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=256, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            tie_word_embeddings=True)


def test_sync_cost_matches_a_hand_count():
    # Per layer, the 7 linear weights [out, in]: q 64x64, k 32x64, v 32x64, o 64x64, gate 128x64, up 128x64,
    # down 64x128 = 4096 + 2048 + 2048 + 4096 + 8192 + 8192 + 8192 = 36,864 values.
    # NVFP4 per tensor: n/2 (two codes a byte) + n/16 (an e4m3 scale per 16) + 4 (fp32 global scale):
    # per layer 36,864 * 9/16 + 7 * 4 = 20,736 + 28 = 20,764 bytes.
    # bf16 per layer: 2 layer norms (64) + q_norm, k_norm (16) = 160 values = 320 bytes.
    # Once: the (tied) embedding 256 x 64 = 16,384 values = 32,768 bytes, the final norm 64 values = 128 bytes.
    nvfp4 = 2 * (20_764 + 320) + 32_768 + 128
    params = 2 * (36_864 + 160) + 16_384 + 64
    assert (nvfp4, params) == (75_064, 90_496)
    assert sync_cost.push_cost(TINY) == {"params": params, "nvfp4": nvfp4, "nvfp4_bf16_part": 2 * 320 + 32_768 + 128,
                                         "bf16": 2 * params}
    untied = dict(TINY, tie_word_embeddings=False)  # + lm_head 256 x 64 in bf16
    assert sync_cost.push_cost(untied)["nvfp4"] == nvfp4 + 32_768
    assert sync_cost.fanout_seconds(10**9, 1, 1.0, 100) == pytest.approx(1.0)        # one stream: 1 GB at 1 GB/s
    assert sync_cost.fanout_seconds(10**9, 32, 1.0, 100) == pytest.approx(32 / 12.5)  # NIC-bound: 32 GB at 12.5 GB/s


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_sync_cost_equals_the_bytes_a_real_push_carries(tmp_path, moe):
    """The arithmetic against services.common.weights.push_bytes of a model really loaded in NVFP4 and BF16."""
    from minite_core.model import load_model
    from minite_core.model.qwen3 import Qwen3Config
    from minite_core.model.random_init import random_checkpoint
    from services.common.weights import push_bytes

    cfg = dict(TINY, tie_word_embeddings=moe)
    if moe:
        cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, norm_topk_prob=True)
    path = random_checkpoint(tmp_path / "m", Qwen3Config.from_hf(cfg))
    cost = sync_cost.push_cost(cfg)
    assert push_bytes(load_model(path, precision="nvfp4").w) == cost["nvfp4"]
    assert push_bytes(load_model(path, precision="bf16").w) == cost["bf16"]


def test_sync_cost_qwen3_configs_match_the_published_sizes_and_the_measured_payload():
    rows = {r["model"]: r for r in sync_cost.table()}
    embed = 151_936
    # the model cards' parameter counts, total and without the embedding (B)
    published = {"Qwen3-0.6B": (0.6, 0.44, 1024), "Qwen3-1.7B": (1.7, 1.4, 2048), "Qwen3-8B": (8.2, 6.95, 4096),
                 "Qwen3-30B-A3B": (30.5, 29.9, 2048)}
    for name, (total, non_embedding, hidden) in published.items():
        p = rows[name]["params"] / 1e9
        assert p == pytest.approx(total, rel=0.02), name
        untied = not sync_cost.QWEN3[name]["tie_word_embeddings"]
        assert p - (1 + untied) * embed * hidden / 1e9 == pytest.approx(non_embedding, rel=0.02), name
    # docs/benchmarks.md, "The services": bench/weight_sync.py pushed 559.0 MB (NVFP4) and 1,192.1 MB (BF16)
    assert round(rows["Qwen3-0.6B"]["nvfp4"] / 1e6, 1) == 559.0
    assert round(rows["Qwen3-0.6B"]["bf16"] / 1e6, 1) == 1192.1


def test_docs_quote_the_sync_cost_output(capsys):
    assert sync_cost.main(["--markdown"]) == 0
    tables = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    doc = SCALE_OUT_DOC.read_text()
    missing = [line for line in tables if line not in doc]
    assert not missing, f"docs/scale-out.md lacks these lines of `python bench/sync_cost.py --markdown`: {missing}"


def test_sync_cost_rates_are_the_measured_ones():
    """bench/sync_cost.py's default per-stream rates are docs/benchmarks.md's steady weight-sync figures."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(
        r"^\| (NVFP4|BF16)\b[^|]*\| ([\d,.]+) \| [\d.]+ \| ([\d.]+) \| ([\d.]+) \|$", text, re.M)}
    assert set(rows) == {"NVFP4", "BF16"}, "the weight-sync table of docs/benchmarks.md changed shape"
    assert float(rows["NVFP4"][2]) == sync_cost.NVFP4_GBPS and float(rows["BF16"][2]) == sync_cost.BF16_GBPS
    r06 = next(r for r in sync_cost.table() if r["model"] == "Qwen3-0.6B")
    assert f"{r06['nvfp4'] / 1e6:,.1f}" == rows["NVFP4"][0] and f"{r06['bf16'] / 1e6:,.1f}" == rows["BF16"][0]
    assert f"{r06['nvfp4_s']:.2f}" == rows["NVFP4"][1] and f"{r06['bf16_s']:.2f}" == rows["BF16"][1]
