"""A learner's checkpoint: the fp32 masters, the optimizer state and a little JSON (step, weight version,
the run's configuration, the torch RNG state).

One process writes `trainer.safetensors` (tensors `master/<weight name>` and `optim/<weight name>/<key>`)
and `trainer.json`; a data-parallel learner writes torch.distributed.checkpoint shards instead (every
rank its own; distributed.py) and rank 0 the JSON. The directory is written atomically
(wal.write_atomically), so a learner killed mid-write resumes from the previous one, and the one before
is kept as `checkpoint.prev`: a latest checkpoint that cannot be read (a truncated or emptied file) is
named in a warning and the run falls back to the previous one, whose later steps the trajectory log
still holds (the trainer drops log records only through the previous checkpoint's step).

`lock_run_dir` keeps a second process from using a run directory while one runs in it (an flock on
`run.lock`, released when the process ends, however it ends). The dataset rows a
step draws come from (seed, step, index) alone (task.py), so no data-loader state is saved.
"""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from . import distributed


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here (the message names the directory and why)."""


class RunDirInUse(ValueError):
    """Another process runs in this run directory."""


_HELD: dict[str, object] = {}  # run directories this process holds (a process may build several Trainers)


def lock_run_dir(run_dir) -> None:
    """Hold `run_dir`/run.lock for the rest of this process, or raise RunDirInUse naming the holder's pid."""
    path = Path(run_dir).resolve()
    if str(path) in _HELD:
        return
    if path.exists() and not path.is_dir():
        raise ValueError(f"run directory {path} is a file, not a directory")
    path.mkdir(parents=True, exist_ok=True)
    f = open(path / "run.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "?"
        f.close()
        raise RunDirInUse(f"run directory {path} is in use by another run (pid {owner}): stop that one first, or "
                          "give this run another run_dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    _HELD[str(path)] = f


def save(path, masters: dict, opt: torch.optim.Optimizer, meta: dict, *, group=None, module=None) -> None:
    """Write the checkpoint into directory `path` (every rank calls this on a data-parallel learner)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "torch_rng": torch.get_rng_state().tolist()}
    if group is not None:
        distributed.save(path, module, opt)
        if group.leader:
            (path / "trainer.json").write_text(json.dumps(meta))
        return
    tensors = {f"master/{n}": m.detach().contiguous() for n, m in masters.items()}
    names = list(masters)
    for idx, st in opt.state_dict()["state"].items():
        for key, val in st.items():
            tensors[f"optim/{names[idx]}/{key}"] = torch.as_tensor(val).contiguous()
    save_file(tensors, str(path / "trainer.safetensors"))
    (path / "trainer.json").write_text(json.dumps(meta))


def load(path, masters: dict, opt: torch.optim.Optimizer, *, group=None, module=None) -> dict:
    """Read the checkpoint in `path` into the masters and the optimizer; -> its JSON metadata."""
    path = Path(path)
    try:
        meta = json.loads((path / "trainer.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / 'trainer.json'} cannot be read: {type(e).__name__}: {e}") from None
    missing = [k for k in ("step", "weight_version", "torch_rng") if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise CheckpointError(f"{path / 'trainer.json'} cannot be read: it has no {missing[0]!r}")
    if group is not None:
        if not (path / ".metadata").exists():
            raise CheckpointError(f"{path} is not a data-parallel (torch.distributed.checkpoint) checkpoint")
        distributed.load(path, module, opt)
    else:
        if not (path / "trainer.safetensors").exists():
            raise CheckpointError(f"{path} holds a data-parallel checkpoint: resume it with torchrun and --data-parallel")
        try:
            tensors = load_file(str(path / "trainer.safetensors"))
        except (OSError, SafetensorError) as e:
            raise CheckpointError(f"{path / 'trainer.safetensors'} cannot be read: {e}") from None
        names = list(masters)
        missing = [n for n in names if f"master/{n}" not in tensors]
        if missing:
            raise CheckpointError(f"{path} was written for another model: it has no master for {missing[0]}")
        wrong = [n for n in names if tensors[f"master/{n}"].shape != masters[n].shape]
        if wrong:
            n = wrong[0]
            raise CheckpointError(f"{path} was written for another model: its {n} has shape "
                                  f"{tuple(tensors[f'master/{n}'].shape)}, this model's {tuple(masters[n].shape)}")
        with torch.no_grad():
            for n in names:
                masters[n].copy_(tensors[f"master/{n}"])
        state = opt.state_dict()
        for idx, n in enumerate(names):
            keys = [k.split("/")[-1] for k in tensors if k.startswith(f"optim/{n}/")]
            if keys:
                state["state"][idx] = {k: tensors[f"optim/{n}/{k}"].clone() for k in keys}
        opt.load_state_dict(state)
    torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
    return meta
