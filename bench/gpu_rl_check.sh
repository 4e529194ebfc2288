#!/usr/bin/env bash
# A short GPU check of the RL path (`minite train` on CUDA with the Triton backend, dense and MoE, NVFP4):
# the run's drift must be exactly 0 and the reward must be logged; then the learner benchmark's step.
#   bash bench/gpu_rl_check.sh     (on the device; the run settings come from RunConfig like any run)
set -u
OUT=${OUT:-/tmp/minite-gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 - <<'PY'
import torch
from minite_core.model.random_init import random_checkpoint
from minite_core.rl.tiny import TINY, TINY_MOE, write_tokenizer
for name, cfg in (("dense", TINY), ("moe", TINY_MOE)):
    write_tokenizer(random_checkpoint(f"/tmp/rl-{name}", cfg, seed=0, dtype=torch.float32))
PY
for name in dense moe; do
  t0=$(date +%s)
  timeout 240 python3 -m minite_core.cli train --model-dir /tmp/rl-$name --run-dir /tmp/rl-run-$name --steps 4 \
    --device cuda --backend triton --prompts-per-step 8 --num-generations 4 --eval-steps 2 2>&1 | tail -4
  python3 -c "
import json; rows=[json.loads(l) for l in open('/tmp/rl-run-$name/metrics.jsonl')]
print('RL $name', 'steps', len(rows), 'max drift', max(r['sampling/sampling_logp_difference/max'] for r in rows),
      'bitwise', min(r['drift/bitwise_equal_ratio'] for r in rows), 'eval', 'eval/reward' in rows[-1], '$(( $(date +%s) - t0 )) s')"
done 2>&1 | tee "$OUT/rl.txt"
