"""`minite export` against the peers' own loaders, on tiny random Qwen3 / Qwen3-MoE models saved by
transformers with a BPE tokenizer folder, and run directories written by the trainer's own checkpoint code
(`rl.state.save`) with "trained" masters (the source weights plus noise, so an export of the source
weights instead of the masters fails).

- hf: transformers' `from_pretrained` loads every tensor (none missing or unexpected) and its fp32 logits
  equal miniTE's `load_model(out, "fp32")` logits to 1e-4 (tests/test_model.py's parity tolerance); the
  tensors are the masters rounded to bf16; config, generation_config and tokenizer files come along.
- NVFP4: `load_model(out, "nvfp4")` holds exactly the masters quantized as the trainer quantizes them, and
  every quantized linear has its activation scale. Layer 0's q/k/v input (embedding + norm, nothing
  quantized upstream) is observed independently with a forward hook on transformers' model; the stored
  scale must be compressed-tensors' own `generate_gparam` of that amax (ModelOpt: amax / 2688).
- compressed-tensors, dense: transformers + compressed-tensors run the export as W4A4 (their fake-quant,
  static input_global_scale). Their logits cannot equal ours bit for bit: miniTE quantizes activations
  with a per-row scale computed on the fly, they use the calibrated per-tensor one, and even with the same
  scale the two quantizers order their fp32 operations differently, so a rare element exactly at a
  rounding tie lands on another grid point. So the bound is relative to the activation-quantization noise
  itself: their W4A4 logits are finite and differ from ours by less than 1.5x the distance between our
  W4A4 and W4A16 logits (measured: 1.09x); and their W4A16 load (weights only) matches ours to bf16
  noise. No scale gives NaN; an inverted scale (the decode convention stored as the encode one) 5.9x, a
  4x too small amax (clipped activations) 3.1x. (A too large amax costs NVFP4 almost nothing: the E4M3
  block scales absorb it; the layer-0 check above pins the value.)
- compressed-tensors, MoE: transformers 5.25 cannot run a compressed-tensors NVFP4 MoE (its fused-expert
  dequantize drops `weight_global_scale`; the compressed path does not quantize fused experts), so each
  expert's tensors go through compressed-tensors' own NVFP4 decompressor instead.
"""
import json

import pytest
import torch
from tests.helpers_hf import save_hf_checkpoint

from minite_core import checkpoint, export, nvfp4
from minite_core.model import load_model
from minite_core.rl import distributed, state
from minite_core.tokenizer import Tokenizer
from tests.helpers_hf import make_bpe_tokenizer_dir, tokenizer_vocab_size, write_generation_config

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402
from compressed_tensors.quantization.utils.helpers import generate_gparam  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class _Leader:  # the data-parallel group as state.save sees it on rank 0
    leader = True


def _source(path, moe: bool):
    make_bpe_tokenizer_dir(path)
    save_hf_checkpoint(path, moe=moe, random_norms=True, vocab_size=tokenizer_vocab_size(path))
    write_generation_config(path)
    return path


def _run(path, src, *, dcp: bool = False, seed: int = 0):
    """A run directory as the trainer leaves it: checkpoint/ (state.save) and calibration.json."""
    g = torch.Generator().manual_seed(seed)
    masters = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in load_model(src, precision="fp32").w.items()}
    meta = {"step": 3, "weight_version": 3, "config": {"model_dir": str(src)}}
    if dcp:
        module = distributed.Masters(masters)
        state.save(path / "checkpoint", dict(module.named_parameters()), torch.optim.AdamW(module.parameters()),
                   meta, group=_Leader(), module=module)
    else:
        state.save(path / "checkpoint", masters, torch.optim.AdamW(list(masters.values())), meta)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in [12] * 6 + [7] * 3 + [20] * 2]
    (path / "calibration.json").write_text(json.dumps({"sequences": seqs}))
    return path, masters, seqs


def _case(moe: bool, tmp_path_factory) -> dict:
    """A source model, a run of it, and the run exported in every format."""
    src = _source(tmp_path_factory.mktemp("src"), moe)
    run, masters, seqs = _run(tmp_path_factory.mktemp("run"), src)
    out = tmp_path_factory.mktemp("out")
    exports = {fmt: export.export(run, out / fmt, format=fmt) for fmt in export.FORMATS}
    return {"moe": moe, "src": src, "run": run, "masters": masters, "seqs": seqs, **exports}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return _case(False, tmp_path_factory)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return _case(True, tmp_path_factory)


@pytest.fixture(scope="module", params=["dense", "moe"])
def case(request):
    return request.getfixturevalue(request.param)


def _hf_model(path, moe, dtype, **kw):
    extra = {"experts_implementation": "eager"} if moe else {}
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", output_loading_info=True, **extra, **kw)
    return model.eval(), info


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_hf_export_loads_in_transformers_with_our_logits(case):
    out, masters = case["hf"], case["masters"]
    raw = checkpoint.read_safetensors(out)
    assert set(raw) == set(masters)
    for n, m in masters.items():  # the trained masters, per-expert names for the MoE
        assert raw[n].dtype == torch.bfloat16 and torch.equal(raw[n], m.to(torch.bfloat16)), n
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and "quantization_config" not in cfg
    assert (out / "generation_config.json").read_text() == (case["src"] / "generation_config.json").read_text()
    for f in TOKENIZER_FILES:
        assert (out / f).read_bytes() == (case["src"] / f).read_bytes(), f
    assert Tokenizer.from_dir(out).eos_token_ids == Tokenizer.from_dir(case["src"]).eos_token_ids

    hf, info = _hf_model(out, case["moe"], torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, cfg["vocab_size"], (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, use_cache=False).logits.float()
    ours = load_model(out, precision="fp32").logits(ids)
    assert (ours - ref).abs().max().item() < 1e-4


def test_hf_export_of_a_data_parallel_checkpoint(dense, tmp_path):
    run, _, _ = _run(tmp_path / "run", dense["src"], dcp=True)  # the same seed: the same masters
    assert (run / "checkpoint" / ".metadata").is_file() and not (run / "checkpoint" / "trainer.safetensors").exists()
    out = export.export(run, tmp_path / "out")
    a, b = checkpoint.read_safetensors(out), checkpoint.read_safetensors(dense["hf"])
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def _layer0_amax(case) -> float:
    """Layer 0's q_proj input amax over the calibration sequences, seen by a hook on transformers' model."""
    hf, _ = _hf_model(case["hf"], case["moe"], torch.bfloat16)
    seen = []
    hf.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, inp, out: seen.append(inp[0].abs().amax()))
    with torch.no_grad():
        for s in case["seqs"]:
            hf(torch.tensor([s]), use_cache=False)
    return float(max(seen))


def test_nvfp4_exports_hold_the_trainers_weights_and_calibrated_scales(case):
    ours = {}
    for fmt in checkpoint.FORMATS:
        assert checkpoint.detect_format(case[fmt]) == fmt
        model = load_model(case[fmt], precision="nvfp4")
        quantized = {n for n, w in model.w.items() if isinstance(w, nvfp4.NVFP4Tensor)}
        assert quantized == {n for n in case["masters"] if n.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                                "gate_proj", "up_proj", "down_proj")}
        for n in quantized:  # bit for bit what the trainer's re-quantize of its masters gives
            w, ref = model.w[n], nvfp4.quantize(case["masters"][n], scale_mode="tensor")
            assert torch.equal(w.data, ref.data) and torch.equal(w.scale.view(torch.uint8), ref.scale.view(torch.uint8))
            assert torch.allclose(w.global_scale, ref.global_scale, rtol=2**-23, atol=0), n  # CT stores 1/gs
        for n, m in case["masters"].items():
            if n not in quantized:
                assert torch.equal(model.w[n], m.to(torch.bfloat16)), n
        _, ours[fmt] = checkpoint.load_checkpoint(case[fmt])  # decode-convention scales by module
        assert set(ours[fmt]) == {n[: -len(".weight")] for n in quantized}
        assert all(0 < s < float("inf") for s in ours[fmt].values())
        cfg = json.loads((case[fmt] / "config.json").read_text())
        routers = [f"model.layers.{i}.mlp.gate" for i in range(2)] if case["moe"] else []
        ignore = cfg["quantization_config"]["ignore" if fmt == "compressed-tensors" else "exclude_modules"]
        assert ignore == ["lm_head"] + routers
    for p, s in ours["modelopt"].items():  # the two formats store the same calibration
        assert s == pytest.approx(ours["compressed-tensors"][p], rel=1e-6), p

    amax = torch.tensor(_layer0_amax(case))
    raw_ct = checkpoint.read_safetensors(case["compressed-tensors"])
    raw_mo = checkpoint.read_safetensors(case["modelopt"])
    for proj in ("q_proj", "k_proj", "v_proj"):
        p = f"model.layers.0.self_attn.{proj}"
        gparam = raw_ct[p + ".input_global_scale"]
        assert gparam.dtype == torch.float32 and gparam.shape == (1,)
        assert torch.allclose(gparam, generate_gparam(-amax, amax), rtol=1e-2), p  # compressed-tensors' own formula
        assert raw_mo[p + ".input_scale"].shape == ()
        assert raw_mo[p + ".input_scale"].item() == pytest.approx(amax.item() / (448 * 6), rel=1e-2), p


def test_compressed_tensors_export_runs_w4a4_in_transformers(case):
    out = case["compressed-tensors"]
    cfg = json.loads((out / "config.json").read_text())
    qcfg = QuantizationConfig.model_validate(cfg["quantization_config"])
    scheme = qcfg.config_groups["group_0"]
    raw = checkpoint.read_safetensors(out)
    quantized = [k[: -len(".weight_packed")] for k in raw if k.endswith(".weight_packed")]
    for p in quantized:  # compressed-tensors' own decompressor on every layer (each expert of the MoE)
        sd = {k.split(".")[-1]: v for k, v in raw.items() if k.startswith(p + ".weight")}
        mine = nvfp4.quantize(case["masters"][p + ".weight"], scale_mode="tensor").dequantize()
        theirs = NVFP4PackedCompressor.decompress(sd, scheme)["weight"].float()
        assert torch.allclose(theirs, mine, rtol=2**-8, atol=0), p  # (decompressed to bf16)
        assert torch.isfinite(raw[p + ".input_global_scale"]).all()
    if case["moe"]:
        return  # transformers 5.25 cannot run a compressed-tensors NVFP4 MoE (see the module docstring)

    ids = torch.tensor(case["seqs"][:6])  # the six calibration sequences of length 12
    w4a4, info = _hf_model(out, False, torch.bfloat16)  # compressed-tensors' fake-quant forward
    assert not info["missing_keys"] and not info["unexpected_keys"], info  # every input_global_scale is read
    dequantize = transformers.CompressedTensorsConfig(dequantize=True)  # their load-time weight decompression
    w4a16, _ = _hf_model(out, False, torch.bfloat16, quantization_config=dequantize)
    with torch.no_grad():
        theirs4, theirs16 = w4a4(ids, use_cache=False).logits.float(), w4a16(ids, use_cache=False).logits.float()
    ours4 = load_model(out, precision="nvfp4").logits(ids)
    ours16 = load_model(out, precision="bf16").logits(ids)  # the same NVFP4 weights, activations unquantized
    assert torch.isfinite(theirs4).all()
    assert _rel(theirs16, ours16) < 0.02  # weights alone: bf16 noise
    noise = _rel(ours4, ours16)  # what activation quantization does to our logits
    assert 0.01 < noise < 0.5
    assert _rel(theirs4, ours4) < 1.5 * noise
    assert _rel(theirs4, theirs16) < 1.5 * noise


def test_uncalibrated_experts_take_their_layers_largest_scale(moe, tmp_path):
    calib = tmp_path / "one-token.json"
    calib.write_text(json.dumps({"sequences": [[5]]}))  # top-2 of 4 experts: two experts per layer see nothing
    out = export.export(moe["run"], tmp_path / "out", format="modelopt", calibration=calib)
    _, scales = checkpoint.load_checkpoint(out)
    for layer in range(2):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            s = [scales[f"model.layers.{layer}.mlp.experts.{e}.{proj}"] for e in range(4)]
            assert s.count(max(s)) >= 3, (layer, proj, s)  # two unrouted experts copy the routed ones' max


def test_generation_config_is_derived_when_the_model_has_none(dense, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(dense["src"], src)
    (src / "generation_config.json").unlink()
    run, _, _ = _run(tmp_path / "run", src)
    out = export.export(run, tmp_path / "out")
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"eos_token_id": Tokenizer.from_dir(src).token_to_id("<|im_end|>")}


def test_bad_input_is_one_line_and_exit_2(dense, tmp_path, capsys):
    run = dense["run"]

    def fails(argv, *words):
        assert export.main([str(a) for a in argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("minite export: error:") and "Traceback" not in err and err.count("\n") == 1, err
        for w in words:
            assert str(w) in err, (w, err)

    fails([tmp_path / "nope", "--out", tmp_path / "o"], tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    fails([tmp_path / "empty", "--out", tmp_path / "o"], tmp_path / "empty" / "checkpoint")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    fails([run, "--out", busy], busy, "--force")
    fails([run, "--out", tmp_path / "o", "--device", "bogus"], "'bogus' is not a torch device")
    assert export.main([str(run), "--out", str(busy), "--force"]) == 0  # replaced: no stale files remain
    assert not (busy / "keep.txt").exists() and (busy / "model.safetensors").is_file()
    fails([run, "--out", run / "x", "--force", "--calibration", tmp_path / "missing.json", "--format", "modelopt"],
          tmp_path / "missing.json")
    assert not (run / "x").exists() and not list(run.glob("*.export-tmp"))  # nothing half written
    bad = tmp_path / "bad.json"
    for content, word in ([{"sequences": [[1, 2], [10**6]]}, "sequence 1"], [{"seqs": []}, "sequences"],
                          [{"sequences": [[1, "a"]]}, "sequence 0"]):
        bad.write_text(json.dumps(content))
        fails([run, "--out", tmp_path / "o", "--format", "compressed-tensors", "--calibration", bad], bad, word)
    import shutil

    copy = shutil.copytree(run, tmp_path / "copy")
    fails([copy, "--out", copy, "--force"], "would replace")  # an --out that is the run itself
    assert (copy / "checkpoint" / "trainer.json").is_file()
    other = _source(tmp_path / "other", moe=True)  # a run whose checkpoint is not this model's
    capsys.readouterr()  # (transformers' progress bars)
    meta = json.loads((run / "checkpoint" / "trainer.json").read_text())
    (run / "checkpoint" / "trainer.json").write_text(json.dumps({**meta, "config": {"model_dir": str(other)}}))
    try:
        fails([run, "--out", tmp_path / "o"], "another model")
    finally:
        (run / "checkpoint" / "trainer.json").write_text(json.dumps(meta))
    with pytest.raises(export.ExportError, match="unknown export format"):
        export.export(run, tmp_path / "o", format="gguf")
    with pytest.raises(SystemExit):
        export.main([str(run), "--out", str(tmp_path / "o"), "--format", "gguf"])


def test_a_plain_checkpoint_holds_no_nvfp4(tmp_path):
    w = nvfp4.quantize(torch.randn(8, 32), scale_mode="tensor")
    with pytest.raises(ValueError, match="plain tensors"):
        checkpoint.save_checkpoint(tmp_path, {"a.weight": w}, fmt=None)
    with pytest.raises(ValueError, match="quantized format"):
        checkpoint.save_checkpoint(tmp_path, {"a.weight": torch.ones(8, 32)}, fmt=None, input_global_scales={"a": 1.0})
    checkpoint.save_checkpoint(tmp_path, {"a.weight": torch.ones(8, 32)}, fmt=None,
                               config={"model_type": "qwen3", "quantization_config": {"quant_method": "modelopt"}})
    assert checkpoint.detect_format(tmp_path) is None  # a stale quantization_config is not carried over


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(dense, tmp_path, capsys):
    """As --resume does: the latest checkpoint truncated (an interrupted write), the previous one is exported,
    with a warning naming the damaged one; none readable: one line naming both, exit 2."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(dense["run"], run)
    shutil.copytree(run / "checkpoint", run / "checkpoint.prev")
    latest = run / "checkpoint" / "trainer.safetensors"
    latest.write_bytes(latest.read_bytes()[:1000])
    assert export.main([str(run), "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and str(run / "checkpoint") in err and "cannot be read" in err, err
    assert str(run / "checkpoint.prev") in err
    (run / "checkpoint.prev" / "trainer.json").write_text("[1, 2]")
    assert export.main([str(run), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint of this run can be read" in err and "expected a JSON object" in err, err
    assert "Traceback" not in err and err.count("\n") == 1
