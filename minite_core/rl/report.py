"""What a run leaves for a person to read: metrics.jsonl (one JSON object per step, TRL's names for the
sampling drift, `eval/...` on the steps after which the run evaluated), summary.json (evaluation before
the first and after the last step), a progress bar, and reward_drift.png (reward, eval reward and the
rollout/learner drift by step)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file; a torn last line (a crash mid-append) is dropped."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return rows


def batch_digest(outs: list) -> str:
    """SHA-256 of a batch's completions (token ids, logprob bits, versions): which batch a step used."""
    h = hashlib.sha256()
    for o in outs:
        h.update(json.dumps([o.prompt_ids, o.token_ids, o.weight_version, o.request_index, o.sample_index]).encode())
        h.update(o.logprobs.to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def progress(enabled: bool):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), disable=not enabled)


def describe(m: dict) -> str:
    """The progress bar's line for a step's metrics."""
    ev = f" eval {m['eval/reward']:.3f}" if "eval/reward" in m else ""
    return (f"step {m['step']} reward {m['reward']:.3f}{ev} drift {m['sampling/sampling_logp_difference/max']:.2g} "
            f"{m['tokens_per_s']:.0f} tok/s")


def plot(history: list[dict], path: Path, before: dict | None = None, title: str = "GRPO") -> None:
    """Reward (raw and 10-step mean), greedy eval reward, and max |Δlogp| by step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in history]

    def smooth(vals, k=10):
        return [sum(vals[max(0, i - k + 1): i + 1]) / len(vals[max(0, i - k + 1): i + 1]) for i in range(len(vals))]

    fig, ax = plt.subplots(figsize=(7, 4))
    reward = [m["reward"] for m in history]
    ax.plot(steps, reward, color="tab:blue", alpha=0.25)
    ax.plot(steps, smooth(reward), label="mean reward (10-step avg)", color="tab:blue")
    evals = ([(0, before["eval/reward"])] if before and "eval/reward" in before else []) + \
        [(m["step"], m["eval/reward"]) for m in history if "eval/reward" in m]
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval reward (greedy)", color="tab:green")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax2 = ax.twinx()
    ax2.plot(steps, [m["sampling/sampling_logp_difference/max"] for m in history], label="max |Δlogp|",
             color="tab:red", linestyle="--")
    ax2.set_ylabel("rollout vs learner max |Δlogp|")
    fig.legend(loc="lower right", fontsize=8)
    ax.set_title(f"{title}: reward and rollout/learner drift")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
