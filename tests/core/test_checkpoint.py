"""NVFP4 checkpoint interop: our files read by the peers' own code, and theirs by ours.

compressed-tensors (the package vLLM uses to load llm-compressor checkpoints) must parse our
config.json and unpack/dequantize our tensors to exactly our `dequantize` values.
"""
import json

import pytest
import torch

from minite_core import checkpoint, nvfp4

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (n, k) in {"layers.0.q_proj": (48, 64), "layers.0.down_proj": (33, 160)}.items():
        w = torch.randn(n, k, generator=g) * 0.05
        w[0, :5] = 0.9  # an outlier row
        out[f"{name}.weight"] = nvfp4.quantize(w, global_scale=checkpoint.pow2_global_scale(w.abs().amax()))
    out["embed.weight"] = torch.randn(10, 64, generator=g).to(torch.bfloat16)
    return out


def test_compressed_tensors_reads_our_files_exactly(tmp_path):
    tensors = _weights()
    checkpoint.save_checkpoint(tmp_path, tensors, fmt="compressed-tensors", ignore=["lm_head"],
                               input_global_scales={"layers.0.q_proj": 0.0123}, config={"model_type": "qwen3"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3"
    qcfg = QuantizationConfig.model_validate(cfg["quantization_config"])  # the peer's own schema
    scheme = qcfg.config_groups["group_0"]
    assert qcfg.format == "nvfp4-pack-quantized" and qcfg.ignore == ["lm_head"]
    assert scheme.weights.num_bits == 4 and scheme.weights.group_size == 16

    raw = checkpoint.read_safetensors(tmp_path)
    for name, t in tensors.items():
        if not isinstance(t, nvfp4.NVFP4Tensor):
            assert torch.equal(raw[name], t)
            continue
        p = name[: -len(".weight")]
        sd = {k.split(".")[-1]: v for k, v in raw.items() if k.startswith(p + ".weight")}
        out = NVFP4PackedCompressor.decompress(sd, scheme)["weight"]
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, t.dequantize(torch.bfloat16)), name
        # and in fp32, straight through the peer's dequantize formula code * (scale / global_scale)
        from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

        codes = unpack_fp4_from_uint8(sd["weight_packed"], *t.shape, dtype=torch.float32)
        ref = (codes.view(t.shape[0], -1, 16) * (sd["weight_scale"].float() / sd["weight_global_scale"]).unsqueeze(-1))
        assert torch.equal(ref.reshape(t.shape), t.dequantize())
    assert torch.allclose(1.0 / raw["layers.0.q_proj.input_global_scale"], torch.tensor([0.0123]))


def test_our_packing_matches_compressed_tensors_packing():
    x = torch.randn(24, 64)
    t = nvfp4.quantize(x, global_scale=1.0 / 64)
    values = nvfp4.E2M1_VALUES[nvfp4.unpack_codes(t.data).long()]
    assert torch.equal(pack_fp4_to_uint8(values), t.data)


@pytest.mark.parametrize("fmt", checkpoint.FORMATS)
def test_round_trip(tmp_path, fmt):
    tensors = _weights(1)
    w = torch.randn(16, 32)
    tensors["x.weight"] = nvfp4.quantize(w, scale_mode="tensor")  # a non-power-of-two global scale
    checkpoint.save_checkpoint(tmp_path, tensors, fmt=fmt, input_global_scales={"x": 0.5}, max_shard_bytes=2000)
    assert (tmp_path / "model.safetensors.index.json").exists()  # small shards force the index path
    assert checkpoint.detect_format(tmp_path) == fmt
    back, inputs = checkpoint.load_checkpoint(tmp_path)
    assert set(back) == set(tensors)
    assert inputs == {"x": 0.5}
    for name, t in tensors.items():
        if isinstance(t, nvfp4.NVFP4Tensor):
            b = back[name]
            assert torch.equal(b.data, t.data) and torch.equal(b.scale.view(torch.uint8), t.scale.view(torch.uint8))
            if fmt == "modelopt" or name != "x.weight":
                assert torch.equal(b.global_scale, t.global_scale)
            else:  # compressed-tensors stores 1/gs: exact to 1 ulp
                assert torch.allclose(b.global_scale, t.global_scale, rtol=2**-23, atol=0)
        else:
            assert torch.equal(back[name], t)


def test_modelopt_files_carry_the_config_vllm_reads(tmp_path):
    checkpoint.save_checkpoint(tmp_path, _weights(), fmt="modelopt", ignore=["lm_head"])
    hf = json.loads((tmp_path / "hf_quant_config.json").read_text())
    assert hf["producer"]["name"] == "modelopt"
    assert hf["quantization"] == {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                  "exclude_modules": ["lm_head"]}
    raw = checkpoint.read_safetensors(tmp_path)
    assert raw["layers.0.q_proj.weight"].dtype == torch.uint8
    assert raw["layers.0.q_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert raw["layers.0.q_proj.weight_scale_2"].shape == ()
    # ModelOpt's decode: (codes * weight_scale) * weight_scale_2
    t = _weights()["layers.0.q_proj.weight"]
    codes = nvfp4.E2M1_VALUES[nvfp4.unpack_codes(raw["layers.0.q_proj.weight"]).long()]
    ref = (codes.view(48, 4, 16) * raw["layers.0.q_proj.weight_scale"].float().unsqueeze(-1)) * raw["layers.0.q_proj.weight_scale_2"]
    assert torch.equal(ref.reshape(48, 64), t.dequantize())


def test_bad_input(tmp_path):
    w = nvfp4.quantize(torch.randn(8, 32))  # per-row global scale
    with pytest.raises(ValueError, match="per-tensor"):
        checkpoint.save_checkpoint(tmp_path, {"a.weight": w})
    with pytest.raises(ValueError, match="unknown checkpoint format"):
        checkpoint.save_checkpoint(tmp_path, {}, fmt="gguf")
    with pytest.raises(ValueError, match="without a quantized weight"):
        checkpoint.save_checkpoint(tmp_path, {}, input_global_scales={"nope": 1.0})
    wt = nvfp4.quantize(torch.randn(8, 32), scale_mode="tensor")
    with pytest.raises(ValueError, match="<module>.weight"):
        checkpoint.save_checkpoint(tmp_path, {"a.bias": wt})
    checkpoint.save_checkpoint(tmp_path, {"a.weight": wt})
    raw = checkpoint.read_safetensors(tmp_path)
    del raw["a.weight_scale"]
    from safetensors.torch import save_file

    save_file(raw, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks"):
        checkpoint.load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError):
        checkpoint.read_safetensors(tmp_path / "missing")
