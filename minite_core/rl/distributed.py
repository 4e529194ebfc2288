"""Data-parallel learner on torch.distributed: FSDP2 (`fully_shard`) or DDP, started by `torchrun`.

The learner's state is a dict of fp32 master tensors, not an nn.Module; `Masters` puts them in a module
(named exactly as the checkpoint names them) whose forward returns them, so torch's own wrappers do the
parallel work: DDP keeps a full copy per rank and all-reduces the gradients; FSDP2 keeps a 1/W shard
per rank of each master, its gradient and its AdamW state (the 12 of 16 bytes per parameter that do not
have to be whole), all-gathers the masters for the step and reduce-scatters the gradients. Both reduce
in fp32 (the masters' dtype) and average over the W ranks.

One step, with B sequences in the global batch (= the single-rank batch):

* rank 0 samples (or replays from its trajectory log) and broadcasts the batch; every rank computes
  the rewards and the group advantages of all B sequences;
* rank r scores rows [rB/W, (r+1)B/W) with the same Learner forward as one rank: NVFP4 weights
  re-quantized from the *whole* masters with the same per-row/per-tensor rules, so every row's
  logprobs are the bits one rank (and the rollout) computes: scoring is batch-invariant;
* the local loss is the global loss restricted to the shard: loss_local * share * W, where share is
  the fraction of the global normalizer the shard's loss was divided by (sequences for "grpo" and
  "dr_grpo", tokens for "dapo"), so the averaged gradient is the gradient of the global loss;
* a zero-valued term touches the masters this rank's forward did not read (an MoE expert no token of
  the shard routes to), so every rank reduces a gradient for every master and the collectives stay in
  step; a master no rank read gets no gradient (None), as on one rank (AdamW skips it there too);
* clip, AdamW, then every rank re-quantizes from the gathered masters; rank 0 pushes to the rollout
  and writes metrics, computed from the gathered per-row logprobs with the single-rank formulas.

What is not bitwise: the gradients are sums over the batch split across ranks, so their rounding
differs from one rank's and the masters drift apart at the fp32 rounding level (and an NVFP4 code can
flip where a master sits on a rounding boundary). The rollout-vs-learner promise is unaffected: it
compares logprobs at the same weights, and those are bitwise equal on any rank (tests/rl/test_distributed.py).
Checkpoints use torch.distributed.checkpoint (each rank writes its shards; rank 0 the metadata).

Limit: the forward reads masters by name, not through per-layer modules, so FSDP2 shards the whole
model as one group and keeps it gathered for the step (reshard_after_forward=False); per-layer
gathering would need the model's layers as modules.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

STRATEGIES = ("none", "ddp", "fsdp")


class Masters(torch.nn.Module):
    """fp32 master tensors as parameters of a module tree that mirrors their dotted names."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.names = list(tensors)
        for name, t in tensors.items():
            *path, leaf = name.split(".")
            mod = self
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, torch.nn.Parameter(t.detach().clone()))

    def forward(self, _unused: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """{name: master}: under FSDP2 the gathered masters for this step (called by step_masters)."""
        return {n: self.get_parameter(n) for n in self.names}


@dataclasses.dataclass
class Group:
    """This process's place in the data-parallel learner."""
    strategy: str
    rank: int
    world: int
    device: torch.device

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def rows(self, n: int) -> range:
        """The rows of an n-row global batch this rank scores."""
        return range(self.rank * n // self.world, (self.rank + 1) * n // self.world)

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank (pickled; for batches and small metadata)."""
        box = [obj if self.leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj) -> list | None:
        """[obj of rank 0, obj of rank 1, ...] on rank 0, None elsewhere."""
        out = [None] * self.world if self.leader else None
        dist.gather_object(obj, out, dst=0)
        return out

    def barrier(self) -> None:
        dist.barrier()


def setup(strategy: str) -> Group | None:
    """Join the process group torchrun describes (gloo on CPU, NCCL on CUDA); None for `none`."""
    if strategy not in STRATEGIES:
        raise ValueError(f"data_parallel must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "none":
        return None
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(f"data_parallel={strategy!r} needs torchrun (RANK/WORLD_SIZE are not set): "
                           f"torchrun --nproc-per-node N -m minite_core.cli train --data-parallel {strategy} ...")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():  # (on GPUs: NCCL for CUDA tensors, gloo for the CPU objects and flags)
        dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return Group(strategy, dist.get_rank(), dist.get_world_size(), device)


def wrap(masters: Masters, group: Group) -> torch.nn.Module:
    """The masters under DDP or FSDP2."""
    if group.strategy == "ddp":
        return torch.nn.parallel.DistributedDataParallel(masters, device_ids=None if group.device.type == "cpu" else [group.device])
    from torch.distributed.fsdp import fully_shard

    return fully_shard(masters, reshard_after_forward=False)


def full(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole value of each master (FSDP2's sharded DTensors all-gathered; DDP's are whole already)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in params.items()}


def step_masters(module: torch.nn.Module) -> "Reads":
    """The masters for one step's forward (under FSDP2 all-gathered), recording which ones it reads. The
    zero-dim argument is for FSDP2 of torch 2.11, which indexes the forward's arguments on a GPU."""
    return Reads(module(torch.zeros(())))


class Reads(dict):
    """The masters handed to the forward, recording which ones it read (an MoE expert that no token of a
    shard routes to is not read)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)

    def get(self, name, default=None):
        if name in self:
            self.read.add(name)
        return super().get(name, default)

    def unread(self) -> list[torch.Tensor]:
        return [t for n, t in self.items() if n not in self.read]


def touch(tensors: list[torch.Tensor]) -> torch.Tensor | float:
    """0 x the sum of `tensors`: adds nothing to the loss but gives each of them a (zero) gradient, so
    every rank reduces a gradient for every master and the ranks' collectives stay in step."""
    return sum(t.sum() for t in tensors) * 0.0 if tensors else 0.0


def drop_unread(params: dict[str, torch.nn.Parameter], read: set[str]) -> None:
    """A master no rank's forward read gets no gradient (None, as on one rank: AdamW skips it)."""
    names = list(params)
    used = torch.tensor([float(n in read) for n in names], device=params[names[0]].device)
    dist.all_reduce(used, op=dist.ReduceOp.MAX)
    for n, u in zip(names, used.tolist()):
        if not u:
            params[n].grad = None


def save(path, module: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Masters and optimizer state with torch.distributed.checkpoint (collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(module, opt)
    dcp.save({"masters": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def load(path, module: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(module, opt)
    state = {"masters": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(module, opt, model_state_dict=state["masters"], optim_state_dict=state["optim"])


class PeerFailed(RuntimeError):
    """Rank 0 could not go on with a collective step (its rollout failed): the step is abandoned on every rank."""
