#!/usr/bin/env bash
# Every GPU figure from one command: tests/test_cuda.py, bench/launch_count.py and bench/gpu_overhead.py
# (off / full / wg+mv / interval 10 / full + capture: exact + on_nan: skip), then one summary table.
# Uses the torch and Triton installed on the machine; installs and downloads nothing; ~8 min on one H100.
#   bench/gpu_check.sh                      # on a GPU machine
#   bench/gpu_check.sh --json gpu.json      # also keep everything measured
#   bench/gpu_check.sh --tiny               # CPU dry run: Triton's interpreter, a one-layer model
# PYTHON picks the interpreter (default: python3, or .venv/bin/python where python3 has no torch).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if ! python3 -c "import torch" 2>/dev/null && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
fi
exec "$PYTHON" bench/gpu_check.py "$@"
