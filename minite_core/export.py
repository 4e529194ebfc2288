"""`minite export RUN_DIR --out DIR [--format hf|compressed-tensors|modelopt]`: a run's trained policy as a
checkpoint other stacks load.

What is exported: the fp32 master weights of the run's latest checkpoint (`RUN_DIR/checkpoint`, or
`checkpoint.old` after a crash between renames; `trainer.safetensors` tensors `master/<HF weight name>`, or
the torch.distributed.checkpoint shards of a data-parallel run, read in this one process), with the model
folder named by `trainer.json`'s config "model_dir" for config.json, generation_config.json and the
tokenizer files (`Tokenizer.files`: tokenizer.json, tokenizer_config.json, chat_template.jinja, ...).
Without a generation_config.json there, one is written with the eos ids the tokenizer folder gives.

Formats:
- `hf`: the masters rounded to bf16 under their HF names (a Qwen3-MoE's experts one by one,
  `mlp.experts.<e>.{gate,up,down}_proj.weight`, as HF checkpoints store them and transformers 5 reads
  them), config.json with dtype bfloat16. transformers' logits on it equal miniTE's.
- `compressed-tensors` / `modelopt`: NVFP4 W4A4 (checkpoint.py has both layouts). The linear layers are
  the masters quantized as the trainer quantizes them for its rollout (per-tensor global scale, 1x16
  blocks), so the packed weights are bit for bit the ones the run's rollout engine served; embeddings,
  norms, lm_head and the MoE routers stay bf16 (listed in `ignore` / `exclude_modules`).

Calibration (the NVFP4 formats only). A W4A4 serving stack quantizes each linear's input with a *static*
per-tensor global scale read from the checkpoint (miniTE itself uses a per-row scale computed on the fly,
which needs none). That scale comes from the largest |input| (amax) the linear sees on representative
data: here the run's own sequences, `RUN_DIR/calibration.json` = {"sequences": [[token ids], ...]}, the
prompt + completion ids of the run's first batch (written by the trainer). They are run through miniTE's
NVFP4 model holding the exported weights (the policy as served), one forward per group of equal-length
sequences (no padding enters an amax), recording every linear's input amax. An expert that no calibration
token reaches takes the largest amax of the same projection among its layer's experts. Stored as each
format wants it: compressed-tensors `input_global_scale` = 448 * 6 / amax (compressed-tensors'
`generate_gparam`), ModelOpt `input_scale` = amax / (448 * 6). No calibration.json: the NVFP4 formats
refuse (pass another file of the same shape with `--calibration`).

`main` prints errors (no run, no checkpoint, a non-empty --out without --force, bad calibration data) as
one line and returns 2. The export is written to a sibling temporary folder and renamed into place, so a
failure leaves no half-written folder.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import load_file

from . import checkpoint, nvfp4
from .nvfp4 import NVFP4Tensor

FORMATS = ("hf",) + checkpoint.FORMATS
_BATCH = 16  # calibration sequences per forward


class ExportError(ValueError):
    """Bad input to an export; the message names the file or folder."""


def read_masters(run_dir) -> tuple[dict[str, torch.Tensor], dict, Path]:
    """(fp32 masters by HF name, trainer.json, the checkpoint folder) of a run's latest readable checkpoint: as
    `--resume` does, a damaged latest one (an interrupted write, a full disk) falls back to the one before it,
    with a warning naming it."""
    from .rl.wal import newest_readable

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    skipped = []
    found = newest_readable(run_dir / "checkpoint", _read_checkpoint, ExportError, lambda c, e: skipped.append(e))
    if found is None:
        raise ExportError(f"{run_dir / 'checkpoint'}: no checkpoint (trainer.json) in this run directory")
    ckpt, (masters, meta) = found
    for e in skipped:
        print(f"minite export: warning: {e}; exporting the previous checkpoint {ckpt}", file=sys.stderr)
    return masters, meta, ckpt


def _read_checkpoint(ckpt: Path) -> tuple[dict[str, torch.Tensor], dict]:
    try:
        meta = json.loads((ckpt / "trainer.json").read_text())
        if not isinstance(meta, dict):
            raise ExportError(f"{ckpt / 'trainer.json'}: expected a JSON object, got {type(meta).__name__}")
        if (ckpt / "trainer.safetensors").is_file():
            masters = {k[len("master/"):]: v for k, v in load_file(str(ckpt / "trainer.safetensors")).items()
                       if k.startswith("master/")}
        elif (ckpt / ".metadata").is_file():
            masters = _read_dcp(ckpt)
        else:
            raise ExportError(f"{ckpt}: neither trainer.safetensors nor a torch.distributed.checkpoint (.metadata)")
    except ExportError:
        raise
    except Exception as e:  # a truncated or damaged file: safetensors', json's and torch's own errors
        raise ExportError(f"{ckpt} cannot be read ({type(e).__name__}: {e})") from None
    if not masters:
        raise ExportError(f"{ckpt}: the checkpoint holds no master weights")
    return masters, meta


def _read_dcp(ckpt: Path) -> dict[str, torch.Tensor]:
    """The "masters" of a data-parallel run's torch.distributed.checkpoint, whole, in this one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    masters = {k[len("masters."):]: torch.empty(tuple(m.size), dtype=m.properties.dtype)
               for k, m in meta.items() if k.startswith("masters.") and isinstance(m, TensorStorageMetadata)}
    state = {"masters": masters}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    return state["masters"]


def _model_dir(meta: dict, ckpt: Path) -> Path:
    """The run's model folder: its config's model_dir, or the built-in tiny model's (RunConfig.model_path)."""
    from .rl.config import RunConfig

    if not isinstance(meta.get("config"), dict):
        raise ExportError(f"{ckpt / 'trainer.json'} holds no run config")
    d = RunConfig.model_construct(**meta["config"]).model_path  # (no validation: the run's own values)
    if not (d / "config.json").is_file():
        raise ExportError(f"{d}: the run's model folder (model_dir in {ckpt / 'trainer.json'}) has no config.json")
    return d


def read_calibration(file, vocab_size: int) -> list[list[int]]:
    """The sequences of a calibration.json ({"sequences": [[token ids], ...]}), ids in [0, vocab_size)."""
    file = Path(file)
    if not file.is_file():
        raise ExportError(f"{file} not found: the NVFP4 formats calibrate their activation scales on the run's "
                          f"sequences, which the trainer writes there at its first step (--format hf needs none)")
    try:
        seqs = json.loads(file.read_text())["sequences"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ExportError(f"{file}: expected {{\"sequences\": [[token ids], ...]}} ({e})") from None
    if not isinstance(seqs, list) or not seqs:
        raise ExportError(f"{file}: \"sequences\" must be a non-empty list of token-id lists")
    for i, s in enumerate(seqs):
        if not isinstance(s, list) or not s or not all(isinstance(t, int) and not isinstance(t, bool) for t in s):
            raise ExportError(f"{file}: sequence {i} is not a non-empty list of token ids")
        if min(s) < 0 or max(s) >= vocab_size:
            raise ExportError(f"{file}: sequence {i} holds a token id outside the vocabulary [0, {vocab_size})")
    return seqs


@torch.no_grad()
def calibrate(model, sequences: list[list[int]]) -> dict[str, float]:
    """{linear module name: the largest |input| it sees} over `sequences`, run through `model`."""
    amax: dict[str, float] = defaultdict(float)

    def observe(x, names):  # every linear's input (experts: the tokens routed to them)
        if x.numel():
            a = float(x.abs().amax())
            for name in names:
                amax[name] = max(amax[name], a)

    by_len = defaultdict(list)
    for s in sequences:
        by_len[len(s)].append(s)
    with model.observing_inputs(observe):
        for group in by_len.values():
            for i in range(0, len(group), _BATCH):
                model.forward(torch.tensor(group[i:i + _BATCH], device=model.device))
    return dict(amax)


def _input_scales(model, amax: dict[str, float]) -> dict[str, float]:
    """Decode-convention activation global scales (amax / 2688) of the NVFP4 linears; uncalibrated experts
    take the largest amax of the same projection in their layer."""
    out = {}
    for name, w in model.w.items():
        if not isinstance(w, NVFP4Tensor):
            continue
        p = name[: -len(".weight")]
        a = amax.get(p, 0.0)
        if a == 0.0 and ".mlp.experts." in p:
            layer, _, rest = p.partition(".mlp.experts.")
            proj = rest.split(".", 1)[1]
            a = max((v for k, v in amax.items() if k.startswith(layer + ".mlp.experts.") and k.endswith("." + proj)),
                    default=0.0)
        if a == 0.0:
            raise ExportError(f"calibration gave {p} no input: its activation scale cannot be set")
        out[p] = float(nvfp4.global_scale_from_amax(torch.tensor(a)))
    return out


def _config(model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "bfloat16"
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = "bfloat16"
    return cfg


def _copy_model_files(model_dir: Path, out: Path) -> None:
    """generation_config.json (or one with the tokenizer folder's eos ids) and the tokenizer files."""
    from .tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    for f in tok.files if tok is not None else []:
        dest = out / f.relative_to(model_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dest)
    if (model_dir / "generation_config.json").is_file():
        shutil.copyfile(model_dir / "generation_config.json", out / "generation_config.json")
        return
    eos = list(tok.eos_token_ids) if tok is not None else []
    if not eos:
        e = json.loads((model_dir / "config.json").read_text()).get("eos_token_id")
        eos = [e] if isinstance(e, int) else list(e or [])
    if eos:
        gen = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=1))


def _check_masters(masters: dict, model_dir: Path, ckpt: Path) -> None:
    from .model.qwen3 import Qwen3Config

    expected = Qwen3Config.from_hf(json.loads((model_dir / "config.json").read_text())).expected_shapes()
    for name, shape in expected.items():
        if name not in masters:
            raise ExportError(f"{ckpt} has no master for {name} of {model_dir}: a run of another model?")
        if tuple(masters[name].shape) != shape:
            raise ExportError(f"{ckpt}: master {name} has shape {tuple(masters[name].shape)}, "
                              f"{model_dir} wants {shape}")
    extra = sorted(set(masters) - set(expected))
    if extra:
        raise ExportError(f"{ckpt}: masters {extra[:3]} are not weights of {model_dir}")


def _write(masters: dict, model_dir: Path, out: Path, fmt: str, calibration: Path | None, device) -> None:
    if fmt == "hf":
        tensors = {n: m.to(torch.bfloat16) for n, m in masters.items()}
        checkpoint.save_checkpoint(out, tensors, fmt=None, config=_config(model_dir))
    else:
        from .model import load_model

        model = load_model(model_dir, precision="nvfp4", device=device)
        sequences = read_calibration(calibration, model.cfg.vocab_size)
        for n, w in model.w.items():  # the masters as the trainer's rollout holds them
            m = masters[n].to(device)
            model.w[n] = nvfp4.quantize(m, scale_mode="tensor") if isinstance(w, NVFP4Tensor) else m.to(model.dtype)
        scales = _input_scales(model, calibrate(model, sequences))
        ignore = sorted({n[: -len(".weight")] for n, w in model.w.items() if not isinstance(w, NVFP4Tensor)
                         and w.dim() == 2 and n != "model.embed_tokens.weight"} | {"lm_head"})
        checkpoint.save_checkpoint(out, dict(model.w), fmt=fmt, input_global_scales=scales,
                                   config=_config(model_dir), ignore=ignore)
    _copy_model_files(model_dir, out)


def export(run_dir, out, *, format: str = "hf", force: bool = False, calibration=None, device="cpu") -> Path:
    """Write the run's trained policy to folder `out` in `format` (see the module docstring); -> out.

    `out` must not exist or be empty unless `force` (then it is replaced). `calibration`: the NVFP4 formats'
    calibration file (default RUN_DIR/calibration.json)."""
    if format not in FORMATS:
        raise ExportError(f"unknown export format {format!r}: expected one of {FORMATS}")
    run_dir, out = Path(run_dir), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ExportError(f"{out} exists and is not empty (pass --force to replace it)")
    masters, meta, ckpt = read_masters(run_dir)
    model_dir = _model_dir(meta, ckpt)
    _check_masters(masters, model_dir, ckpt)
    for keep in (run_dir, model_dir):
        if out.resolve() in (keep.resolve(), *keep.resolve().parents):
            raise ExportError(f"{out} would replace {keep}: choose another --out")
    tmp = out.resolve().with_name(out.resolve().name + ".export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write(masters, model_dir, tmp, format, Path(calibration) if calibration else run_dir / "calibration.json",
               device)
        if out.is_dir():
            shutil.rmtree(out)
        elif out.exists():
            out.unlink()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="minite export", description="write a run's trained policy as a checkpoint "
                                 "(HF bf16, or NVFP4 compressed-tensors / ModelOpt with calibrated activation scales)")
    ap.add_argument("run_dir", help="the run directory (its checkpoint/ and calibration.json)")
    ap.add_argument("--out", required=True, help="the folder to write (must be empty or new, unless --force)")
    ap.add_argument("--format", choices=FORMATS, default="hf")
    ap.add_argument("--force", action="store_true", help="replace a non-empty --out")
    ap.add_argument("--calibration", default=None, help="calibration sequences (default RUN_DIR/calibration.json)")
    ap.add_argument("--device", default="cpu", help="where the calibration forward runs (e.g. cuda)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    from .rl.config import usable_device

    try:
        usable_device(args.device)
        out = export(args.run_dir, args.out, format=args.format, force=args.force, calibration=args.calibration,
                     device=args.device)
    except (ValueError, FileNotFoundError) as e:
        print(f"minite export: error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.run_dir} ({args.format}) to {out}")
    return 0
