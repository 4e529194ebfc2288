#!/usr/bin/env bash
# One device call for issue 8 on one GPU: the same-host weight sync (CUDA IPC) tests and benchmark, a
# data-parallel learner smoke run under torchrun (NCCL, 1 rank), and the MoE rollout NVFP4 vs HF static
# in one process. Logs under $OUT. The service packages travel as wheels in .whl (docs/benchmarks.md).
set -u
OUT=${OUT:-/tmp/minite-gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 3
fi
step() { local t0=$(date +%s); echo "== $1"; shift; "$@" 2>&1 | tail -${TAIL:-25}; echo "== $(( $(date +%s) - t0 )) s"; }
step "shared-sync tests" timeout 90 python3 -m pytest -q -p no:cacheprovider -rfs tests/serve/test_shared_weights.py
step "weight sync bench" timeout 150 python3 bench/weight_sync.py --shared --repeats 4
python3 - <<'PY'
import torch
from minite_core.model.random_init import random_checkpoint
from minite_core.rl.tiny import TINY, write_tokenizer
random_checkpoint("/tmp/dp-model", TINY, seed=0, dtype=torch.float32)
write_tokenizer("/tmp/dp-model")
PY
step "torchrun fsdp (NCCL, 1 rank)" timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
  -m minite_core.cli train --model-dir /tmp/dp-model --run-dir /tmp/dp-run --steps 3 --prompts-per-step 4 --num-generations 4 \
  --data-parallel fsdp
ls /tmp/dp-run/checkpoint -a | tr '\n' ' '; echo
step "moe rollout" timeout 170 python3 bench/rollout.py --configs moe --batches 64,256 --peers minite-nvfp4,hf-static \
  --repeats 1 --budget 160 --json "$OUT/moe.json"
