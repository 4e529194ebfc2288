"""NVFP4 checkpoints in the two formats that serving stacks (vLLM, SGLang, TensorRT-LLM) read.

Both store, for each quantized linear layer `P` (e.g. `model.layers.0.mlp.up_proj`), the packed E2M1
bytes [N, K/2] (element 2i in the low nibble), the E4M3 block scales [N, K/16] and one fp32
per-tensor global scale; they differ in names and in the convention of the global scale:

    compressed-tensors ("nvfp4-pack-quantized", llm-compressor):
        P.weight_packed, P.weight_scale, P.weight_global_scale, P.input_global_scale
        global scales stored in the *encode* convention 2688 / amax = 1 / decode_scale
        config.json: quantization_config {quant_method: "compressed-tensors", format, config_groups, ignore}
    ModelOpt (NVIDIA TensorRT Model Optimizer):
        P.weight (uint8), P.weight_scale, P.weight_scale_2, P.input_scale
        global scales stored in the *decode* convention amax / 2688, as miniTE holds them
        hf_quant_config.json {producer, quantization: {quant_algo: "NVFP4", group_size: 16,
        exclude_modules}}, mirrored in config.json's quantization_config {quant_method: "modelopt"}

In memory a quantized weight is an `NVFP4Tensor` under the key `P.weight`; input (activation) global
scales, when given, are decode-convention floats keyed by `P`. `fmt=None` writes a plain (unquantized)
HF checkpoint with the same sharding and no quantization_config. Only per-tensor global scales exist in
these formats. ModelOpt files round-trip bit for bit. Compressed-tensors files store 1/gs, so they
round-trip exactly when 1/(1/gs) == gs in fp32, always for a power-of-two gs; compressed-tensors'
own dequantize, code * (scale / (1/gs)), equals ours, (code * scale) * gs, whenever gs is a power of
two (`pow2_global_scale` makes one at no cost in accuracy) and to 1 ulp otherwise.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .nvfp4 import BLOCK, E2M1_MAX, E4M3_MAX, NVFP4Tensor

FORMATS = ("compressed-tensors", "modelopt")
_CT_ARGS = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": BLOCK, "strategy": "tensor_group"}


def pow2_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """The smallest power of two >= amax / 2688: a per-tensor global scale whose reciprocal is exact."""
    a = float(amax) / (E2M1_MAX * E4M3_MAX)
    return torch.tensor(2.0 ** math.ceil(math.log2(a)) if a > 0 else 1.0, dtype=torch.float32)


def quantization_config(fmt: str, ignore: list[str]) -> dict:
    """The `quantization_config` entry of config.json that vLLM reads for each format."""
    if fmt == "compressed-tensors":
        group = {
            "targets": ["Linear"],
            "weights": dict(_CT_ARGS, dynamic=False, scale_dtype="torch.float8_e4m3fn"),
            "input_activations": dict(_CT_ARGS, dynamic="local", scale_dtype="torch.float8_e4m3fn", observer="static_minmax"),
            "output_activations": None,
            "format": "nvfp4-pack-quantized",
        }
        return {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": list(ignore),
            "kv_cache_scheme": None,
        }
    if fmt == "modelopt":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": BLOCK, "exclude_modules": list(ignore)}
    raise ValueError(f"unknown checkpoint format {fmt!r}: expected one of {FORMATS}")


def _prefix(name: str) -> str:
    if not name.endswith(".weight"):
        raise ValueError(f"quantized tensor {name!r} must be a layer weight named '<module>.weight'")
    return name[: -len(".weight")]


def _check_weight(name: str, t: NVFP4Tensor) -> None:
    if len(t.shape) != 2:
        raise ValueError(f"{name}: NVFP4 checkpoints hold 2-D weights, got shape {tuple(t.shape)}")
    if t.per_row:
        raise ValueError(f"{name}: checkpoint formats need a per-tensor global scale (quantize with scale_mode='tensor')")


def save_checkpoint(
    path: str | Path,
    tensors: dict[str, torch.Tensor | NVFP4Tensor],
    *,
    fmt: str | None = "compressed-tensors",
    input_global_scales: dict[str, float] | None = None,
    config: dict | None = None,
    ignore: list[str] | None = None,
    max_shard_bytes: int = 4 << 30,
) -> None:
    """Write `tensors` (NVFP4Tensor weights and plain tensors) to a HF-style checkpoint directory.

    `config` (a model's config.json dict) gets the format's quantization_config; `ignore` lists the
    linear modules left unquantized (e.g. ["lm_head"]); `input_global_scales` maps module prefix to
    a static activation global scale (decode convention), which serving stacks need for W4A4.
    `fmt=None`: an unquantized checkpoint (plain tensors only; config.json without quantization_config).
    """
    if fmt is not None:
        quantization_config(fmt, [])  # validates fmt
    elif input_global_scales:
        raise ValueError("input_global_scales need a quantized format (fmt='compressed-tensors' or 'modelopt')")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    inputs = dict(input_global_scales or {})
    flat: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not isinstance(t, NVFP4Tensor):
            flat[name] = t.detach().contiguous().cpu()
            continue
        if fmt is None:
            raise ValueError(f"{name}: an unquantized checkpoint (fmt=None) holds plain tensors, not NVFP4")
        _check_weight(name, t)
        p = _prefix(name)
        gs = t.global_scale.reshape(1).float().cpu()
        if fmt == "compressed-tensors":
            flat[f"{p}.weight_packed"] = t.data.cpu().contiguous()
            flat[f"{p}.weight_scale"] = t.scale.cpu().contiguous()
            flat[f"{p}.weight_global_scale"] = 1.0 / gs
        else:
            flat[f"{p}.weight"] = t.data.cpu().contiguous()
            flat[f"{p}.weight_scale"] = t.scale.cpu().contiguous()
            flat[f"{p}.weight_scale_2"] = gs.reshape(())
        if p in inputs:
            s = torch.tensor([float(inputs.pop(p))], dtype=torch.float32)
            if not (s > 0).all() or not torch.isfinite(s).all():
                raise ValueError(f"input global scale of {p} must be finite and positive")
            if fmt == "compressed-tensors":
                flat[f"{p}.input_global_scale"] = 1.0 / s
            else:
                flat[f"{p}.input_scale"] = s.reshape(())
    if inputs:
        raise ValueError(f"input_global_scales name modules without a quantized weight: {sorted(inputs)}")

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in flat.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in flat.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )

    cfg = dict(config or {})
    cfg.pop("quantization_config", None)
    if fmt is not None:
        cfg["quantization_config"] = quantization_config(fmt, ignore or [])
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    if fmt == "modelopt":
        hf = {"producer": {"name": "modelopt", "version": "minite"},
              "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": BLOCK,
                               "exclude_modules": list(ignore or [])}}
        (path / "hf_quant_config.json").write_text(json.dumps(hf, indent=1))


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: model.safetensors, or the shards its index names."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if not (path / f).is_file():  # (a FIFO or a device would block or stream forever: refuse it)
            raise ValueError(f"{path / f} is not a regular file")
        out.update(load_file(str(path / f)))
    return out


def detect_format(path: str | Path) -> str | None:
    """'compressed-tensors', 'modelopt' or None (unquantized), from config.json / hf_quant_config.json."""
    path = Path(path)
    cfg_file = path / "config.json"
    qcfg = json.loads(cfg_file.read_text()).get("quantization_config", {}) if cfg_file.exists() else {}
    method = qcfg.get("quant_method")
    if method == "compressed-tensors":
        if qcfg.get("format") != "nvfp4-pack-quantized":
            raise ValueError(f"{path}: compressed-tensors format {qcfg.get('format')!r} is not nvfp4-pack-quantized")
        return "compressed-tensors"
    if method == "modelopt" or (path / "hf_quant_config.json").exists():
        hq = json.loads((path / "hf_quant_config.json").read_text()).get("quantization", qcfg) if (path / "hf_quant_config.json").exists() else qcfg
        if hq.get("quant_algo") != "NVFP4":
            raise ValueError(f"{path}: ModelOpt quant_algo {hq.get('quant_algo')!r} is not NVFP4")
        return "modelopt"
    if method is not None:
        raise ValueError(f"{path}: unsupported quant_method {method!r}")
    return None


def _as_nvfp4(name: str, packed: torch.Tensor, scale: torch.Tensor, gs_decode: torch.Tensor) -> NVFP4Tensor:
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"{name}: packed weight must be uint8 [N, K/2], got {packed.dtype} {tuple(packed.shape)}")
    if scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: block scales must be float8_e4m3fn, got {scale.dtype}")
    shape = (packed.shape[0], packed.shape[1] * 2)
    if tuple(scale.shape) != (shape[0], shape[1] // BLOCK):
        raise ValueError(f"{name}: block scales have shape {tuple(scale.shape)}, expected {(shape[0], shape[1] // BLOCK)}")
    if gs_decode.numel() != 1:
        raise ValueError(f"{name}: expected one global scale, got shape {tuple(gs_decode.shape)}")
    return NVFP4Tensor(packed, scale, gs_decode.float().reshape(()), torch.Size(shape))


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor | NVFP4Tensor], dict[str, float]]:
    """Read a checkpoint directory: (tensors with NVFP4Tensor weights under 'P.weight', input global scales)."""
    fmt = detect_format(path)
    raw = read_safetensors(path)
    if fmt is None:
        return raw, {}
    tensors: dict[str, torch.Tensor | NVFP4Tensor] = {}
    inputs: dict[str, float] = {}
    used: set[str] = set()
    if fmt == "compressed-tensors":
        for key in [k for k in raw if k.endswith(".weight_packed")]:
            p = key[: -len(".weight_packed")]
            names = [f"{p}.weight_packed", f"{p}.weight_scale", f"{p}.weight_global_scale"]
            missing = [n for n in names if n not in raw]
            if missing:
                raise ValueError(f"{path}: {p} lacks {missing}")
            tensors[f"{p}.weight"] = _as_nvfp4(p, raw[names[0]], raw[names[1]], 1.0 / raw[names[2]].float())
            used.update(names)
            if f"{p}.input_global_scale" in raw:
                inputs[p] = float(1.0 / raw[f"{p}.input_global_scale"].float().reshape(()))
                used.add(f"{p}.input_global_scale")
    else:
        for key in [k for k in raw if k.endswith(".weight_scale_2")]:
            p = key[: -len(".weight_scale_2")]
            names = [f"{p}.weight", f"{p}.weight_scale", key]
            missing = [n for n in names if n not in raw]
            if missing:
                raise ValueError(f"{path}: {p} lacks {missing}")
            tensors[f"{p}.weight"] = _as_nvfp4(p, raw[names[0]], raw[names[1]], raw[key])
            used.update(names)
            if f"{p}.input_scale" in raw:
                inputs[p] = float(raw[f"{p}.input_scale"].float().reshape(()))
                used.add(f"{p}.input_scale")
    tensors.update({k: v for k, v in raw.items() if k not in used})
    return tensors, inputs
