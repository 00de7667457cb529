#!/usr/bin/env bash
# Every GPU figure from one command: tests/test_cuda.py, bench/launch_count.py, bench/host_cost.py,
# bench/gpu_kernel_sweep.py (the statistics kernels' read speed per tiling, where the budget leaves it room),
# bench/gpu_overhead.py (off / full / wg+mv / interval 10 / full + capture: exact + on_nan: skip, and msprobe's
# monitor where it imports; then the compiled yardstick) and bench/gpu_stacks.py (megatron-core through
# enable_megatron, DeepSpeed ZeRO-2 and ZeRO-3, FSDP2, world size 1, wg + mv), then one summary: per mode mean,
# median, p90 and longest step, ratios to "off", garbage collections and their pauses, kernels and syncs
# added, peak memory, the time to issue a step split into the training thread's CPU, blocked and other
# threads' CPU, the host time per row against host_cost.py's; per stack rows collected, losses bitwise
# equal, wg + mv overhead. Within --budget
# (530 s, under 9 minutes with the wheels' install) on one H100 or H200.
#   bench/gpu_check.sh                      # on a GPU machine
#   bench/gpu_check.sh --json gpu.json      # also keep everything measured
#   bench/gpu_check.sh --tiny               # CPU dry run: Triton's interpreter, a one-layer model
# PYTHON picks the interpreter (default: python3, or .venv/bin/python where python3 has no torch).
#
# Downloads nothing. Wheels in .whl/ at the repository root (TRAINMON_WHEELS names another folder) are
# installed first, with pip's --no-index --no-deps, into /tmp/site (TRAINMON_WHEEL_SITE), put first on
# PYTHONPATH: the native crc32c, msprobe, megatron-core and DeepSpeed with what it needs, which the GPU image
# lacks. bench/gpu_wheels.sh fetches them (and builds DeepSpeed's) on a machine with a package index; then,
# with the device tool's run, carry [".whl"]:
#   run(command="bench/gpu_check.sh --json $OUT/gpu.json 2>&1 | tee $OUT/gpu_check.log", carry=[".whl"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if ! python3 -c "import torch" 2>/dev/null && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
fi
wheels="${TRAINMON_WHEELS:-.whl}"
if compgen -G "$wheels/*.whl" >/dev/null; then
  site="${TRAINMON_WHEEL_SITE:-/tmp/site}"
  TRAINMON_CARRIED_WHEELS="$(cd "$wheels" && ls -- *.whl | tr '\n' ' ')"
  export TRAINMON_CARRIED_WHEELS
  echo "installing the wheels carried in $wheels/ into $site: $TRAINMON_CARRIED_WHEELS"
  if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$wheels"/*.whl; then
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    export TRAINMON_CARRIED_SITE="$site"
  else
    echo "warning: the wheels in $wheels/ could not be installed (above); going on without them" >&2
  fi
fi
# the native code (setup.py: the CPU stats kernel and the step buffer's hot path) is built in place for this
# machine's Python where it does not import (a fresh copy of the tree); without a compiler the Python paths
# run and the report says so
if ! "$PYTHON" -c "import trainmon.step._fastrows, trainmon.stats._statskernel" 2>/dev/null; then
  echo "building the native extensions for $("$PYTHON" -V 2>&1)"
  if ! "$PYTHON" setup.py -q build_ext --inplace >/tmp/trainmon-build-ext.log 2>&1; then
    echo "warning: building the native extensions failed (/tmp/trainmon-build-ext.log); the Python paths run" >&2
  fi
fi
exec "$PYTHON" bench/gpu_check.py "$@"
