"""Where do two engines part ways? Run configuration A's rollout path and configuration B's learner path
over the same sampled tokens, capture every op's output row by row, and compare.

The rollout path is the real one: `RolloutEngine.generate` with continuous batching, its prefill rows
and then one row per decode step for each sequence. The learner path is one batched full-sequence
forward, as `Learner.batch_logprobs` runs it. Rows are matched by position (the last sampled token is
never fed back, so positions 0 .. P+L-2 of each sequence). The report lists, in execution order, each
op's max |difference|, relative error and whether all its bits agree, marks the first op that
differs, and gives the token drift statistics of `drift_stats`.
"""
from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import torch

from .. import ops
from ..engine import RolloutEngine, SamplingParams
from ..model.qwen3 import Qwen3
from .stats import DriftStats, drift_stats


@dataclasses.dataclass
class OpDiff:
    op: str
    max_abs: float
    rel: float
    bitwise_equal: bool

    @property
    def layer(self) -> int | None:
        return int(self.op.split(".")[1]) if self.op.startswith("layers.") else None


@dataclasses.dataclass
class Report:
    ops: list[OpDiff]
    first_divergent: str | None
    drift: DriftStats

    def table(self) -> str:
        lines = [f"{'layer':>5}  {'op':<12} {'max|Δ|':>10} {'rel.err':>10}  bitwise", "-" * 50]
        for d in self.ops:
            name = d.op.split(".")[-1]
            mark = "  <- first divergent op" if d.op == self.first_divergent else ""
            lines.append(f"{'' if d.layer is None else d.layer:>5}  {name:<12} {d.max_abs:>10.3g} {d.rel:>10.3g}  "
                         f"{'yes' if d.bitwise_equal else 'NO'}{mark}")
        s = self.drift
        lines += ["", f"tokens {s.tokens}: mean|Δlogp| {s.mean_abs_diff:.3g}, max|Δlogp| {s.max_abs_diff:.3g}, "
                      f"k3-KL {s.kl_k3:.3g}, argmax mismatch {s.token_mismatch_ratio:.3g}, ppl ratio {s.ppl_ratio:.6f}, "
                      f"bitwise-equal tokens {s.bitwise_equal_ratio:.1%}",
                  f"first divergent op: {self.first_divergent or 'none (bitwise identical)'}"]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"first_divergent_op": self.first_divergent, "drift": self.drift.as_dict(),
                "ops": [dataclasses.asdict(d) for d in self.ops]}

    def plot(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        by_kind = collections.defaultdict(dict)
        for d in self.ops:
            if d.layer is not None:
                by_kind[d.op.split(".")[-1]][d.layer] = d.max_abs
        fig, ax = plt.subplots(figsize=(7, 4))
        for kind, vals in by_kind.items():
            layers = sorted(vals)
            ax.plot(layers, [max(vals[i], 1e-12) for i in layers], marker="o", label=kind)
        ax.set_yscale("log")
        ax.set_xticks(sorted({d.layer for d in self.ops if d.layer is not None}))
        ax.set_xlabel("layer")
        ax.set_ylabel("max |Δ| (1e-12 = bitwise equal)")
        ax.set_title(f"per-layer drift; first divergent op: {self.first_divergent or 'none'}")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def diagnose(rollout_model: Qwen3, learner_model: Qwen3, prompts: list, params: SamplingParams, *,
             max_slots: int = 8, max_seq_len: int = 256) -> Report:
    rows_a: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    engine = RolloutEngine(rollout_model, max_slots=max_slots, max_seq_len=max_seq_len)
    outs = engine.generate(prompts, params, capture=lambda key, name, t: rows_a[key][name].append(t.float()))

    seqs = [o.prompt_ids + o.token_ids for o in outs]
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long, device=learner_model.device)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    captured_b: dict = {}
    with torch.no_grad():
        logits_b = learner_model.forward(ids, torch.arange(longest, device=ids.device).expand(len(seqs), longest),
                                         capture=lambda name, t: captured_b.__setitem__(name, t.float()))
    order = list(captured_b)
    diffs = []
    for name in order:
        max_abs, num, den, equal = 0.0, 0.0, 0.0, True
        for i, o in enumerate(outs):
            n_rows = len(o.prompt_ids) + len(o.token_ids) - 1
            a = torch.cat(rows_a[(o.request_index, o.sample_index)][name])[:n_rows]
            b = captured_b[name][i, :n_rows]
            d = (a - b).double()
            max_abs = max(max_abs, float(d.abs().max()))
            num += float(d.square().sum())
            den += float(b.double().square().sum())
            equal &= torch.equal(a, b)
        diffs.append(OpDiff(name, max_abs, (num / den) ** 0.5 if den > 0 else 0.0, equal))
    first = next((d.op for d in diffs if not d.bitwise_equal), None)

    temperature = params.temperature if params.temperature > 0 else 1.0
    lp_b, am_a, am_b = [], [], []
    for i, o in enumerate(outs):
        p, c = len(o.prompt_ids), len(o.token_ids)
        rows = logits_b[i, p - 1 : p + c - 1]
        lp_b.append(ops.token_logprobs(rows, torch.tensor(o.token_ids, device=rows.device), temperature,
                                       backend=learner_model.backend))
        am_b.append(rows.argmax(-1).cpu())
        am_a.append(torch.cat(rows_a[(o.request_index, o.sample_index)]["lm_head"])[p - 1 : p + c - 1].argmax(-1).cpu())
    stats = drift_stats([o.logprobs for o in outs], lp_b, am_a, am_b)
    return Report(diffs, first, stats)


def write_report(report: Report, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "diagnose.json").write_text(json.dumps(report.to_json(), indent=1))
    report.plot(out_dir / "diagnose.png")
