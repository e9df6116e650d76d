#!/usr/bin/env bash
# The project's GPU checks in one call on a lent GPU machine, sized for a 15-minute device budget (the
# machine's start included): about 9 minutes of command time, each part under its own timeout, in
# the order that matters (what would catch the 1B NaN first, then correctness at 1B, then the
# figures), each part's log and result copied flat under $OUT/gpu_session as soon as it ends, so a
# later part that runs out of time loses nothing before it (the device tool returns 8 files).
#
#   device run:  bash benchmarks/gpu_session.sh            (timeout_s 600; results under $OUT/gpu_session)
#   a rerun:     SKIP="nan_probe gpu_tests" bash benchmarks/gpu_session.sh   (parts named in SKIP do not run)
#   CPU smoke:   SMOKE=1 OUT=/tmp/smoke bash benchmarks/gpu_session.sh   (tiny models, about 2 minutes)
#
# 1. nan_probe.py: NaN gradients per batch width, padded vs packed layout (issue 26's root cause);
# 2. the GPU tests (pytest -m gpu): CUDA-graph decode, masked rows, bf16 paths, CUDA IPC of the
#    shared weight buffer (skipped where vLLM is absent, as on the project's GPU machine);
# 3. correctness at 1B in the overlapped modes: gpu_bench --check, oppo and pipeline with the
#    default CUDA engine (static, CUDA graphs), 5 steps each (the 1B NaN appeared after the third
#    update), every metric and weight finite, B = 16 to fit the time;
# 4. the figures at 1B (policy) + 125M (reward, critic), B = 64, representative lengths,
#    sequential (packed, and with ppo.packing=off) against oppo and pipeline (gpu_bench: step time,
#    response tokens/s, decode overhead
#    over the engine's own step, train MFU against a matmul peak probed in the same run, padded
#    share: bench.md), in the time left.
# Goals (issues 27, 35): every mode finite for 5+ steps at 1B, decode overhead <= 1.2x, train MFU
# >= 30%, padded share <= 2%, oppo >= 2x its sequential and >= 2,500 response tokens/s.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}/gpu_session
WORK=${WORK:-/tmp/gpu_session_work}  # models, runs, pictures: too many files to send back
mkdir -p "$OUT" "$WORK"
PY=${PYTHON:-python}
if [ -n "${SMOKE:-}" ]; then  # the same commands on tiny models on the CPU: checks this script itself
  SIZES=(--device cpu --tiny); PROBE=(--device cpu --dtype float32 --widths 56,64)
  CHECK=(--batch 8 --steps 2); BENCH=(--steps 2); T=(60 60 150); TOTAL=480
else
  SIZES=(--policy-size 1b --reward-size 125m); PROBE=(); CHECK=(--batch 16 --steps 5); BENCH=(--batch 64 --steps 4)
  T=(60 90 210); TOTAL=545
fi
started=$(date +%s)
part() {  # part NAME SECONDS COMMAND...: run it under a timeout, log it, note rc and seconds
  local name=$1 limit=$2; shift 2
  case " ${SKIP:-} " in *" $name "*) echo "| $name | skipped (SKIP) | | |" >> "$OUT/summary.md"; return;; esac
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "| $name | $rc$([ $rc = 124 ] && echo ' (timed out)') | $(( $(date +%s) - t0 )) s | \`$*\` |" >> "$OUT/summary.md"
  echo "$name: rc $rc, $(( $(date +%s) - t0 )) s" >&2
}
{ echo "# GPU session $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  echo; echo "| part | rc | time | command |"; echo "|---|---|---|---|"; } > "$OUT/summary.md"
part nan_probe "${T[0]}" $PY benchmarks/nan_probe.py "${PROBE[@]}"
if [ -n "${SMOKE:-}" ]; then
  part gpu_tests "${T[1]}" $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py
else
  part gpu_tests "${T[1]}" $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_masked_rows.py \
    tests/test_fastdecode.py tests/test_vllm_weights.py
fi
part check_1b "${T[2]}" $PY benchmarks/gpu_bench.py "${SIZES[@]}" "${CHECK[@]}" --check --modes oppo,pipeline \
  --check-engines static --out "$WORK/check"
cp "$WORK/check/check.md" "$OUT/check.md" 2>/dev/null
left=$(( TOTAL - ($(date +%s) - started) ))
part bench_1b "$left" $PY benchmarks/gpu_bench.py "${SIZES[@]}" "${BENCH[@]}" --modes sequential,sequential:ppo.packing=off,oppo,pipeline \
  --budget-min $(( (left - 20) / 60 )) --no-short-row --out "$WORK/bench" --models "$WORK/check/models"
cp "$WORK/bench/bench.md" "$WORK/bench/bench.json" "$OUT/" 2>/dev/null
echo "in all $(( $(date +%s) - started )) s" >> "$OUT/summary.md"
cat "$OUT/summary.md"
[ -f "$OUT/check.md" ] && cat "$OUT/check.md"
[ -f "$OUT/bench.md" ] && sed -n '1,60p' "$OUT/bench.md"
exit 0
