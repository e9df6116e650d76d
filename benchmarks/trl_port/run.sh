#!/usr/bin/env bash
# TRL's PPOTrainer against the oppo port of its example script (examples/trl_ppo.py), back to
# back on the same tiny local models, settings and threads. Usage, from the repository root:
#   TRL_PY=/path/to/trl-venv/bin/python PY=.venv/bin/python bash benchmarks/trl_port/run.sh [ROUNDS] [STEPS]
# Writes benchmarks/trl_port/results.jsonl (one line per run: trainer, mode, step seconds).
set -euo pipefail
ROUNDS=${1:-2}; STEPS=${2:-10}
PY=${PY:-.venv/bin/python}; TRL_PY=${TRL_PY:?set TRL_PY to a python with trl==1.12.0}
WORK=$(mktemp -d); OUT=benchmarks/trl_port/results.jsonl
export OMP_NUM_THREADS=1 PYTHONPATH=src TRL_EXPERIMENTAL_SILENCE=1   # one thread each: a shared 2-core machine
$PY - "$WORK" <<'PYEOF'
import json, sys
from pathlib import Path
sys.path.insert(0, "tests")
from conftest import TINY_PROMPTS, make_models
root = Path(sys.argv[1])
make_models(root)
(root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TINY_PROMPTS * 16))
PYEOF
: > "$OUT"
for r in $(seq "$ROUNDS"); do
  echo "round $r: trl" >&2
  $TRL_PY benchmarks/trl_port/trl_side.py --policy "$WORK/policy" --reward "$WORK/reward" \
      --prompts "$WORK/prompts.jsonl" --out "$WORK/trl-$r" --batch 8 --steps "$STEPS" 2>/dev/null | tail -1 >> "$OUT"
  for mode in sequential oppo; do
    echo "round $r: oppo port, $mode" >&2
    $PY examples/trl_ppo.py --dataset_name "$WORK/prompts.jsonl" --output_dir "$WORK/oppo-$mode-$r" \
        --sft_model_path "$WORK/policy" --reward_model_path "$WORK/reward" --per_device_train_batch_size 8 \
        --total_episodes $((8 * STEPS)) --response_length 16 --missing_eos_penalty 1.0 --stop_token eos \
        --oppo placement.threads=1 --oppo run.samples=0 --oppo log.progress=false --oppo run.save_final=none \
        --oppo overlap.mode=$mode > /dev/null 2>&1
    $PY -c "import json,sys; m=[json.loads(l) for l in open(sys.argv[1])]; print(json.dumps({'trainer': 'oppo port', 'mode': sys.argv[2], 'step_s': [x['time/step'] for x in m], 'length': [x['response_length/mean'] for x in m]}))" \
        "$WORK/oppo-$mode-$r/metrics.jsonl" "$mode" >> "$OUT"
  done
done
uptime >&2
rm -rf "$WORK"
