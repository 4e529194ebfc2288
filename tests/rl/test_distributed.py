"""The data-parallel learner (minite_core/rl/distributed.py) on CPU: torchrun, gloo, 2 real processes.

Same global batch, 1 rank vs 2 (FSDP2 and DDP): the per-step metrics and the final masters agree within
rounding (tolerances below, and why), the NVFP4 run's learner
logprobs equal the rollout's bit for bit on every step, and a run resumed from its
torch.distributed.checkpoint continues exactly as an uninterrupted one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

STEPS, LR = 5, 5e-4
ARGS = ["--prompts-per-step", "4", "--num-generations", "4", "--learning-rate", str(LR), "--checkpoint-every", "100"]


def _train(model: str, run_dir, *extra, ranks: int = 0) -> list[dict]:
    """`minite train` in one plain process (ranks=0) or under torchrun with `ranks` processes."""
    head = [sys.executable, "-m", "minite_core.cli"] if not ranks else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m", "minite_core.cli"]
    cmd = head + ["train", "--model-dir", model, "--run-dir", str(run_dir), *ARGS, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _dcp_masters(path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / (path.name + ".pt")
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out)["masters"]


@pytest.fixture(scope="module")
def fp32_runs(service_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    one = _train(str(service_model), root / "one", "--precision", "fp32", "--steps", str(STEPS))
    fsdp = _train(str(service_model), root / "fsdp", "--precision", "fp32", "--steps", str(STEPS),
                  "--data-parallel", "fsdp", ranks=2)
    ddp = _train(str(service_model), root / "ddp", "--precision", "fp32", "--steps", str(STEPS),
                 "--data-parallel", "ddp", ranks=2)
    return root, one, {"fsdp": fsdp, "ddp": ddp}


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_ranks_follow_one_rank_on_the_same_global_batch(fp32_runs, strategy):
    """Tolerances: the batch splits the gradient's sums between the ranks, so the masters differ from one
    rank's by fp32 rounding after step 1, which AdamW (an update of ~lr per element whatever the gradient's
    size) can grow to a fraction of lr per step where a gradient element is near zero. Step 1 sees the
    same masters and so the same logprobs: its metrics are equal; after it the sampled tokens and rewards
    stay equal, entropy within 1e-5 relative, the gradient norm within 1e-3 relative, and the final masters
    differ from one rank's by at most 2 lr per element and by <= 1% of the distance training moved them
    (L2 norms; measured ~0.1%)."""
    root, one, runs = fp32_runs
    fsdp = runs[strategy]
    assert [m["step"] for m in fsdp] == list(range(1, STEPS + 1))
    assert fsdp[0]["loss"] == one[0]["loss"] and fsdp[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-6)
    assert fsdp[0]["batch_sha256"] == one[0]["batch_sha256"]
    for a, b in zip(one, fsdp):
        assert (a["tokens"], a["reward"], a["reward_std"]) == (b["tokens"], b["reward"], b["reward_std"]), a["step"]
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        assert b["sampling/sampling_logp_difference/max"] == 0.0  # the rollout on rank 0 == the learner on both
    single = load_file(str(root / "one" / "checkpoint" / "trainer.safetensors"))
    masters = _dcp_masters(root / strategy / "checkpoint")
    assert set(masters) == {k[len("master/"):] for k in single if k.startswith("master/")}
    start = _initial(fp32_runs)
    diff = torch.cat([(single["master/" + n] - t).flatten() for n, t in masters.items()])
    update = torch.cat([(single["master/" + n] - start[n]).flatten() for n in masters])
    assert diff.abs().max() <= 2 * LR  # AdamW: at most one step's update either way on a near-zero gradient
    assert diff.norm() <= 1e-2 * update.norm(), (diff.norm(), update.norm())  # measured ~1e-3


def _initial(fp32_runs) -> dict:
    root = fp32_runs[0]
    cfg = json.loads((root / "one" / "checkpoint" / "trainer.json").read_text())["config"]
    return {n: t.float() for n, t in load_file(os.path.join(cfg["model_dir"], "model.safetensors")).items()}


def test_nvfp4_two_ranks_logprobs_equal_the_rollout_and_resume_is_exact(service_model, tmp_path):
    """NVFP4 W4A4: every rank scores its rows with weights re-quantized from the gathered masters, so the
    learner's logprobs equal the rollout's bitwise on every step; stopping after step 2 and resuming from
    the torch.distributed.checkpoint gives the uninterrupted run's steps 3-4 exactly."""
    full = _train(str(service_model), tmp_path / "full", "--steps", "4", "--data-parallel", "fsdp", ranks=2)
    for m in full:
        assert m["sampling/sampling_logp_difference/max"] == 0.0 and m["drift/bitwise_equal_ratio"] == 1.0, m["step"]
    one = _train(str(service_model), tmp_path / "one", "--steps", "1")
    assert full[0]["batch_sha256"] == one[0]["batch_sha256"] and full[0]["loss"] == one[0]["loss"]
    assert full[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-3)  # bf16 STE backward, split batch

    part = tmp_path / "part"
    _train(str(service_model), part, "--steps", "2", "--data-parallel", "fsdp", ranks=2)
    assert (part / "checkpoint" / ".metadata").exists()  # a torch.distributed.checkpoint
    resumed = _train(str(service_model), part, "--steps", "4", "--data-parallel", "fsdp", "--resume", ranks=2)
    keys = ("batch_sha256", "loss", "grad_norm", "entropy", "weight_version")
    assert [[m[k] for k in keys] for m in resumed] == [[m[k] for k in keys] for m in full]


def test_moe_experts_a_shard_does_not_route_to(tmp_path):
    """32 experts, top-1, ~20 tokens per rank: most experts are read by neither rank or by one only. The
    unread ones get a zero term (so both ranks reduce every gradient and the collectives stay in step) and
    those no rank read get no gradient, as on one rank (AdamW skips them): the run neither hangs nor drifts."""
    import dataclasses

    from minite_core.model.random_init import random_checkpoint
    from minite_core.rl.tiny import TINY_MOE, write_tokenizer

    model = tmp_path / "moe32"
    random_checkpoint(model, dataclasses.replace(TINY_MOE, num_experts=32, num_experts_per_tok=1), seed=0,
                      dtype=torch.float32)
    write_tokenizer(model)
    common = ("--precision", "fp32", "--steps", "3", "--prompts-per-step", "2", "--num-generations", "2")
    one = _train(str(model), tmp_path / "one", *common)
    two = _train(str(model), tmp_path / "two", *common, "--data-parallel", "fsdp", ranks=2)
    for a, b in zip(one, two):
        assert (a["tokens"], a["reward"]) == (b["tokens"], b["reward"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["sampling/sampling_logp_difference/max"] == 0.0


def test_bad_data_parallel_setups_are_named(service_model, tmp_path):
    p = subprocess.run([sys.executable, "-m", "minite_core.cli", "train", "--model-dir", str(service_model),
                        "--run-dir", str(tmp_path / "r"), "--data-parallel", "fsdp", "--steps", "1"],
                       capture_output=True, text=True, timeout=120, env={k: v for k, v in os.environ.items()
                                                                         if k not in ("RANK", "WORLD_SIZE")})
    assert p.returncode != 0 and "needs torchrun" in p.stderr and "Traceback" not in p.stderr


def test_learner_service_under_torchrun(service_model, tmp_path):
    """`minite learner --data-parallel fsdp` on 2 ranks against a real rollout process: rank 0 serves and
    talks to the replica, rank 1 trains with it; every step's rollout logprobs equal the learner's, the
    replica ends on the learner's last version, and both ranks exit 0."""
    import grpc

    from minite.v1 import rollout_pb2 as rpb
    from minite.v1 import rollout_pb2_grpc as rpb_grpc
    from tests.service_helpers import Proc, free_port

    token = "dp-token-51c9"
    g, h = free_port(), free_port()
    rollout = Proc(["rollout", "--model-dir", str(service_model), "--grpc-port", str(g), "--http-port", str(h)],
                   tmp_path / "rollout.log", env={"MINITE_AUTH_TOKEN": token})
    try:
        rollout.wait_http(f"http://127.0.0.1:{h}/health")
        run_dir = tmp_path / "learner"
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            "-m", "minite_core.cli", "learner", "--data-parallel", "fsdp", "--model-dir", str(service_model),
                            "--rollout", f"127.0.0.1:{g}", "--grpc-port", "0", "--http-port", "0", "--steps", "3",
                            "--prompts-per-step", "4", "--num-generations", "4", "--run-dir", str(run_dir),
                            "--exit-when-done"], stdout=(tmp_path / "learner.log").open("w"), stderr=subprocess.STDOUT,
                           timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1", "MINITE_AUTH_TOKEN": token})
        assert p.returncode == 0, (tmp_path / "learner.log").read_text()[-3000:]
        steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in steps] == [1, 2, 3]
        assert all(m["sampling/sampling_logp_difference/max"] == 0.0 for m in steps)
        assert (run_dir / "checkpoint" / ".metadata").exists()
        with grpc.insecure_channel(f"127.0.0.1:{g}") as ch:
            served = rpb_grpc.RolloutServiceStub(ch).GetWeightVersion(
                rpb.GetWeightVersionRequest(), metadata=[("authorization", f"Bearer {token}")]).version
        assert served == steps[-1]["weight_version"]
    finally:
        rollout.kill()
