#!/usr/bin/env bash
# Issue 27's GPU checks in one call on a lent GPU machine, sized for a 15-minute device budget (the
# machine's start included): about 9 minutes of command time, each part under its own timeout, in
# the order that matters (correctness at 1B first, then the figures), each writing what it has
# under $OUT even when a later part runs out of time.
#
#   device run:  bash benchmarks/gpu_session.sh            (timeout_s 600; results under $OUT/gpu_session)
#   CPU smoke:   SMOKE=1 OUT=/tmp/smoke bash benchmarks/gpu_session.sh   (tiny models, about 2 minutes)
#
# 1. the GPU tests (pytest -m gpu): CUDA-graph decode, masked rows, bf16 paths, CUDA IPC of the
#    shared weight buffer (skipped where vLLM is absent, as on the project's GPU machine);
# 2. correctness at 1B in the overlapped modes (gpu_bench --check: each engine x mode in a child
#    process, 2 steps, every metric and weight finite), B = 16 to fit the time;
# 3. the figures at 1B (policy) + 125M (reward, critic), B = 64, representative lengths, sequential
#    against oppo (gpu_bench: step time, response tokens/s, decode overhead over the engine's own
#    step, train MFU against a matmul peak probed in the same run, padded share: bench.md).
# Goals (issue 27): decode overhead <= 1.2x, train MFU >= 30%, sequential step <= 6 s, oppo >= 2x
# its sequential and >= 2,500 response tokens/s.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src
OUT=${OUT:-/tmp}/gpu_session
mkdir -p "$OUT"
PY=${PYTHON:-python}
if [ -n "${SMOKE:-}" ]; then  # the same commands on tiny models on the CPU: checks this script itself
  SIZES=(--device cpu --tiny); CHECK=(--batch 8 --steps 2); BENCH=(--steps 2); T=(60 150 150)
else
  SIZES=(--policy-size 1b --reward-size 125m); CHECK=(--batch 16 --steps 2); BENCH=(--batch 64 --steps 4)
  T=(90 200 270)
fi
started=$(date +%s)
part() {  # part NAME SECONDS COMMAND...: run it under a timeout, log it, note rc and seconds
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "| $name | $rc$([ $rc = 124 ] && echo ' (timed out)') | $(( $(date +%s) - t0 )) s | \`$*\` |" >> "$OUT/summary.md"
  echo "$name: rc $rc, $(( $(date +%s) - t0 )) s" >&2
}
{ echo "# GPU session $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  echo; echo "| part | rc | time | command |"; echo "|---|---|---|---|"; } > "$OUT/summary.md"
if [ -n "${SMOKE:-}" ]; then
  part gpu_tests "${T[0]}" $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py
else
  part gpu_tests "${T[0]}" $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_masked_rows.py \
    tests/test_fastdecode.py tests/test_vllm_weights.py
fi
part check_1b "${T[1]}" $PY benchmarks/gpu_bench.py "${SIZES[@]}" "${CHECK[@]}" --check --modes sequential,oppo,pipeline \
  --out "$OUT/check"
part bench_1b "${T[2]}" $PY benchmarks/gpu_bench.py "${SIZES[@]}" "${BENCH[@]}" --modes sequential,oppo \
  --budget-min $(( T[2] / 60 - 1 )) --no-short-row --out "$OUT/bench" --models "$OUT/check/models"
echo "in all $(( $(date +%s) - started )) s" >> "$OUT/summary.md"
cat "$OUT/summary.md"
[ -f "$OUT/bench/bench.md" ] && sed -n '1,60p' "$OUT/bench/bench.md"
exit 0
