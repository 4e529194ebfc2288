#!/usr/bin/env bash
# One device session: the GPU tests of the kernels and engines, then the benchmarks, logs under $OUT.
#   bash bench/gpu_session.sh [tests] [rollout] [learner] [attention] [gemm] [gemm-bits] [learner-cap] [rollout-cap] [launch] [packed] [one-tile] [attn-quant] [attn-stages] [swap-bound] [swap-tile] [overlap] [prefill-graphs]
#   (default: all but gemm-bits and the caps; learner-cap / rollout-cap: MINITE_MAX_K_CHUNKS=$CAP, default 1;
#   the engines' own cap is gemm.DEFAULT_MAX_CHUNKS = 4, CAP=64 gives the uncapped S of before 2026-12-06)
# gemm-bits: bench/gemm.py again with the element-wise FP4 decode (MINITE_FP4_DECODE=bits), for the word decode's gain.
# packed: bench/rollout.py with MINITE_WIDE_PACKED_MAX_M=0 and =$WP (default 65536; PACKED_ARGS: its arguments).
# one-tile: bench/rollout.py with a decode step's quantizes on whole-row tiles (the default) and on the chunk walk.
# attn-quant: bench/rollout.py with the o_proj input quantized in the decode attention kernel (the default) and after it.
# launch: bench/launch_cost.py, the host's time per call of each op at tiny sizes, and (--stages) the steps of Triton's launch path.
# TESTS_FILES overrides the GPU test files (default: every kernel and engine file, most important first);
# ROLLOUT_ARGS / LEARNER_ARGS / GEMM_ARGS / LAUNCH_ARGS override the benchmarks' arguments, ROLLOUT_TIMEOUT / LEARNER_TIMEOUT
# their time limits (s). A summary table comes last.
# All of it does not fit one 600 s device call (the tests need minutes cold: Triton compiles, TESTS_WORKERS at a time):
# run `tests gemm` in one call and `rollout learner attention` in the next, on the same warm machine.
# The Triton cache comes back as $OUT/triton-cache.tar.xz (when under the 16 MiB a returned file may have):
# copy it to .triton-cache.tar.xz (git-ignored) and carry it (`carry: [".whl", ".triton-cache.tar.xz"]`), and the
# next session's first call starts with the kernels of unchanged sources compiled.
set -u
OUT=${OUT:-/tmp/minite-gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 TRITON_STORE_BINARY_ONLY=1
parts=${*:-tests rollout learner attention gemm}
# bench/rollout.py with one module setting set to each VALUE in turn (the same run, and the same bits, either way):
#   rollout_ab MODULE NAME ARGS VALUE...  -> $OUT/ab_NAME_VALUE.txt each, and its result lines
#   (no '=' in the file names: the device tool returns only files named in letters, digits, '.', '_' and '-')
rollout_ab() {
  local module=$1 name=$2 args=$3 v; shift 3
  for v in "$@"; do
    timeout ${ROLLOUT_TIMEOUT:-420} python3 -c "import importlib, runpy, sys
setattr(importlib.import_module('$module'), '$name', $v); sys.argv[0] = 'bench/rollout.py'
runpy.run_path('bench/rollout.py', run_name='__main__')" $args 2>&1 \
      | tee "$OUT/ab_${name}_$v.txt" | grep -E "^(0.6b|1.7b|moe) " | sed "s/^/$name=$v: /"
  done
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
git log --oneline -1 | tee -a "$OUT/device.txt"
if [ -f .triton-cache.tar.xz ]; then
  mkdir -p ~/.triton && tar xJf .triton-cache.tar.xz -C ~/.triton && echo "triton cache: $(ls ~/.triton/cache | wc -l) entries carried"
fi
for p in $parts; do
  t0=$(date +%s)
  case $p in
    # the kernels' numerics against their definitions first (test_ops: the PTX decode on every code and scale
    # byte, the K chunk walks against the split programs; the fp8 and quantize encodings), then the promise
    # (rollout == learner, the engine's fast paths), then the rest: a cold run may not reach the end in the time
    # limit, so what matters most runs first; every test's line in $OUT/tests.log
    # TESTS_WORKERS pytest-xdist processes (the device image has it) compile the Triton kernels in parallel
    # at the time limit pytest gets SIGINT (SIGKILL 30 s later), so it still prints the failures' tracebacks
    tests) timeout -s INT -k 30 ${TESTS_TIMEOUT:-300} python3 -m pytest -v -p no:cacheprovider -rfs --tb=short -n ${TESTS_WORKERS:-8} \
             ${TESTS_FILES:-tests/core/test_ops.py tests/kernels/test_fp8.py tests/kernels/test_quantize.py \
             tests/engine/test_rollout_equals_learner.py tests/engine/test_rollout_fast_paths.py tests/engine/test_scheduler.py tests/consistency/test_knobs.py \
             tests/model/test_moe.py tests/kernels/test_gemm.py tests/kernels/test_rows.py \
             tests/kernels/test_qk_norm_rope.py tests/kernels/test_attention.py \
             tests/kernels/test_grouped_gemm.py tests/kernels/test_sample.py tests/core/test_backward.py} \
             > "$OUT/tests.log" 2>&1
           { grep -E "(FAILED|ERROR)" "$OUT/tests.log" | tail -20
             echo "$(grep -c " PASSED" "$OUT/tests.log") passed, $(grep -c " FAILED" "$OUT/tests.log") failed," \
                  "$(grep -c " SKIPPED" "$OUT/tests.log") skipped; last: $(grep -E "::" "$OUT/tests.log" | tail -1 | cut -c1-150)"
           } | tee "$OUT/tests.txt" ;;
    rollout) timeout ${ROLLOUT_TIMEOUT:-420} python3 bench/rollout.py ${ROLLOUT_ARGS:---configs 0.6b --batches 16,64 --repeats 2} \
             --json "$OUT/rollout.json" 2>&1 | tee "$OUT/rollout.txt" | tail -30 ;;
    learner) timeout ${LEARNER_TIMEOUT:-300} python3 bench/learner.py ${LEARNER_ARGS:---steps 5 --backward fp8} 2>&1 \
             | tee "$OUT/learner.txt" | tail -30 ;;
    # the W4A4 GEMM with its K chunks capped at CAP (MINITE_MAX_K_CHUNKS; other bits, the same in both engines):
    # the learner's wide tiles against the decode's occupancy, end to end (NVFP4 rows only; BF16 in-run baseline)
    learner-cap) MINITE_MAX_K_CHUNKS=${CAP:-1} timeout ${LEARNER_TIMEOUT:-300} python3 bench/learner.py \
             ${LEARNER_CAP_ARGS:---config 0.6b --steps 4 --skip-hf} 2>&1 | tee "$OUT/learner_cap.txt" | tail -15 ;;
    rollout-cap) MINITE_MAX_K_CHUNKS=${CAP:-1} timeout ${ROLLOUT_TIMEOUT:-420} python3 bench/rollout.py \
             ${ROLLOUT_CAP_ARGS:---configs 0.6b --batches 16,64 --repeats 1 --peers minite-nvfp4,minite-bf16} 2>&1 \
             | tee "$OUT/rollout_cap.txt" | tail -15 ;;
    # the prefill's wide tiles on the rollout's packed weights (MINITE_WIDE_PACKED_MAX_M, kernels/gemm.py) against a
    # decode of each weight per call: the same rollout run with the bound 0 (off) and $WP (same bits either way)
    packed) for wp in 0 ${WP:-65536}; do
              MINITE_WIDE_PACKED_MAX_M=$wp timeout ${ROLLOUT_TIMEOUT:-420} python3 bench/rollout.py \
                ${PACKED_ARGS:---configs 0.6b,1.7b --batches 16,64 --repeats 3 --peers minite-nvfp4,minite-bf16} 2>&1 \
                | tee "$OUT/rollout_packed_$wp.txt" | grep -E "^(0.6b|1.7b|moe) " | sed "s/^/MINITE_WIDE_PACKED_MAX_M=$wp: /"
            done ;;
    # a decode step's few rows quantized with the whole row in one tile (quantize.ONE_TILE_MAX_ROWS, the default) or
    # with the chunk walk that many rows take (0): the same rollout run both ways (same bits either way)
    one-tile) rollout_ab minite_core.kernels.quantize ONE_TILE_MAX_ROWS \
                "${ONE_TILE_ARGS:---configs 0.6b,1.7b --batches 16,64 --repeats 2 --peers minite-nvfp4}" 256 0 ;;
    # a decode step's o_proj input quantized by the attention kernel (attention.FUSE_QUANTIZE, the default) or by a
    # quantize launch after it (same bits): the same rollout run both ways
    attn-quant) rollout_ab minite_core.kernels.attention FUSE_QUANTIZE \
                "${ATTN_QUANT_ARGS:---configs 0.6b,1.7b --batches 16,64 --repeats 2 --peers minite-nvfp4}" True False ;;
    # the decode step launched before the host reads the last step's tokens (engine/rollout.OVERLAP, the default on CUDA)
    # or after it (one host round trip a step with the GPU idle): the same rollout run both ways (same tokens either way)
    overlap) rollout_ab minite_core.engine.rollout OVERLAP \
                "${OVERLAP_ARGS:---configs 0.6b,1.7b --batches 16,64 --repeats 2 --peers minite-nvfp4,minite-bf16}" True False ;;
    # a decode step's attention launched with fewer software-pipelining stages (attention.DECODE_STAGES: more programs
    # an SM) or Triton's default (None, the prefill's binary): the same rollout run each way (same bits either way)
    attn-stages) rollout_ab minite_core.kernels.attention DECODE_STAGES \
                "${ATTN_STAGES_ARGS:---configs 0.6b --batches 64,256 --repeats 2 --peers minite-nvfp4,minite-bf16}" None 2 1 ;;
    # prefills replayed from CUDA graphs of their (rows, length) bucket (engine/rollout.PREFILL_GRAPHS, the default
    # since 2026-12-08) or launched eagerly: the same rollout run both ways (same tokens either way)
    prefill-graphs) rollout_ab minite_core.engine.rollout PREFILL_GRAPHS \
                "${PREFILL_GRAPHS_ARGS:---configs 0.6b,1.7b --batches 16,64 --repeats 2 --peers minite-nvfp4,minite-bf16}" False True ;;
    # (MINITE_SWAP_MAX_M=N sets the bound for every part, the tests included: `MINITE_SWAP_MAX_M=256 ... tests`)
    # a decode step of up to $SB sequences (default 512) on the swapped tiles (gemm.SWAP_MAX_M: 128-row tiles that read
    # the packed weights; the default bound is 256 since 2026-12-08) or, above 128 rows, on the wide tiles that decode
    # them (bound 128): same bits
    swap-bound) rollout_ab minite_core.kernels.gemm SWAP_MAX_M \
                "${SWAP_BOUND_ARGS:---configs 0.6b,1.7b --batches 256 --repeats 2 --peers minite-nvfp4,minite-bf16}" 128 ${SB:-512} ;;
    # a b256 decode step's GEMMs on one 256-row swapped tile (gemm.SWAP_TILE_MAX = 256: each weight tile decoded
    # once) or two 128-row ones (the default): the same rollout run each way (same bits either way)
    swap-tile) rollout_ab minite_core.kernels.gemm SWAP_TILE_MAX \
                "${SWAP_TILE_ARGS:---configs 0.6b,1.7b --batches 256 --repeats 2 --peers minite-nvfp4,minite-bf16}" 128 256 ;;
    attention) timeout 120 python3 bench/attention.py 2>&1 | tee "$OUT/attention.txt" | tail -20 ;;
    launch) timeout 150 python3 bench/launch_cost.py ${LAUNCH_ARGS:---stages} 2>&1 | tee "$OUT/launch.txt" | tail -20 ;;
    gemm) timeout 240 python3 bench/gemm.py ${GEMM_ARGS:---quick --chunks 1,2,4} --json "$OUT/gemm.json" 2>&1 | tee "$OUT/gemm.txt" | tail -40 ;;
    gemm-bits) MINITE_FP4_DECODE=bits timeout 240 python3 bench/gemm.py ${GEMM_ARGS:---quick} --json "$OUT/gemm_bits.json" 2>&1 \
             | tee "$OUT/gemm_bits.txt" | tail -40 ;;
  esac
  echo "== $p: $(( $(date +%s) - t0 )) s"
done
# the compiled kernels for the next session (binaries and metadata only: TRITON_STORE_BINARY_ONLY above; a
# cache entry is found again only at the same path, ~/.triton/cache, and only with all its files)
tar cJf "$OUT/triton-cache.tar.xz" -C ~/.triton cache 2>/dev/null && ls -l "$OUT/triton-cache.tar.xz" | awk '{print "triton cache:", $5, "bytes"}'
# the short table last: the figures issue 18's targets are about, from the logs above
echo "== summary"
[ -f "$OUT/tests.txt" ] && echo "tests:    $(grep -E '[0-9]+ (passed|failed)' "$OUT/tests.txt" | tail -1)"
[ -f "$OUT/learner.txt" ] && grep -E '^NVFP4 / (BF16|HF)' "$OUT/learner.txt" | sed 's/^/learner:  /'
[ -f "$OUT/learner.txt" ] && grep -E '^--- .*GPU busy' "$OUT/learner.txt" | sed 's/^--- /profile:  /'
[ -f "$OUT/rollout.txt" ] && grep -E 'minite-nvfp4 / ' "$OUT/rollout.txt" | sed 's/^/rollout:  /'
for f in "$OUT"/rollout_packed_*.txt; do [ -f "$f" ] && grep -E 'minite-nvfp4 / |prefill' "$f" | grep -v '^ *$' \
  | sed "s/^/rollout, MINITE_WIDE_PACKED_MAX_M=$(basename "$f" .txt | sed 's/rollout_packed_//'): /"; done
for f in "$OUT"/ab_*.txt; do [ -f "$f" ] && grep -E 'minite-nvfp4 / |^(0.6b|1.7b) +minite-(nvfp4|bf16) +b' "$f" \
  | sed "s/^/rollout, $(basename "$f" .txt | sed 's/^ab_//'): /"; done
[ -f "$OUT/learner_cap.txt" ] && grep -E '^NVFP4 / BF16' "$OUT/learner_cap.txt" | sed "s/^/learner, S <= ${CAP:-1}: /"
[ -f "$OUT/rollout_cap.txt" ] && grep -E 'minite-nvfp4 / ' "$OUT/rollout_cap.txt" | sed "s/^/rollout, S <= ${CAP:-1}: /"
[ -f "$OUT/gemm.txt" ] && grep -E '^ *[0-9]+ +[0-9]+ +(1|16|64|4096) ' "$OUT/gemm.txt" | awk -F'|' '{print "gemm:     N K M S =" $1 "w4a4 vs bf16 =" $(NF-1)}'
[ -f "$OUT/gemm.txt" ] && grep -E '^quantize' "$OUT/gemm.txt" | sed 's/^/gemm:     /'
[ -f "$OUT/gemm.txt" ] && grep -E '^decode ' "$OUT/gemm.txt" | sed 's/^/layer:    /'
[ -f "$OUT/gemm.txt" ] && grep -E '^chunks layer' "$OUT/gemm.txt" | sed 's/^/K chunks: /'
[ -f "$OUT/gemm.txt" ] && grep -E '^walk ' "$OUT/gemm.txt" | sed 's/^/gemm:     /'
[ -f "$OUT/gemm.txt" ] && grep -E '^learner (layer: FAILED|[0-9a-z.]+ +[0-9]+ \|)' "$OUT/gemm.txt" | sed 's/^/layer fwd+bwd: /'
[ -f "$OUT/gemm.txt" ] && grep -E '^backward (parts: FAILED|[0-9a-z.]+ +[0-9]+ \|)' "$OUT/gemm.txt" | sed 's/^/backward parts (deq-w, deq-x, dgrad, wgrad fp32 out, bf16 out; ms): /'
[ -f "$OUT/gemm_bits.txt" ] && grep -E '^decode ' "$OUT/gemm_bits.txt" | sed 's/^/layer, element decode: /'
[ -f "$OUT/launch.txt" ] && grep -E '^launch ' "$OUT/launch.txt" | sed 's/^launch /host per call: /'
[ -f "$OUT/launch.txt" ] && grep -E '^stages ' "$OUT/launch.txt" | sed 's/^stages /Triton launch path, us: /'
[ -f "$OUT/gemm_bits.txt" ] && grep -E '^ *[0-9]+ +[0-9]+ +(16|4096) ' "$OUT/gemm_bits.txt" | awk -F'|' '{print "gemm, element decode: N K M S =" $1 "w4a4 vs bf16 =" $(NF-1)}'
true
