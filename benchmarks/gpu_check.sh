#!/usr/bin/env bash
# The first command to run when a GPU is lent (benchmarks/gpu_check.py: its docstring says what it runs):
#   PYTHONPATH=src bash benchmarks/gpu_check.sh            (device run, timeout_s 480; results in $OUT/gpu_check)
#   SMOKE=1 PYTHONPATH=src bash benchmarks/gpu_check.sh    (the CPU smoke, tiny sizes; tests/test_gpu_session.py)
# Exits 1 when a part failed. benchmarks/gpu_session.sh stays for a longer loan.
cd "$(dirname "$0")/.." || exit 2
exec "${PYTHON:-python}" benchmarks/gpu_check.py "$@"
