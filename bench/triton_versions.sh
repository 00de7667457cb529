#!/usr/bin/env bash
# The kernels on Triton 3.2, 3.3, 3.4, 3.5, 3.6 and 3.9: AOT compile for sm_90/sm_80 and the interpreter
# golden tests per version, each version installed into a scratch folder of the cache (never the venv).
#   bench/triton_versions.sh [--versions 3.2.0 3.6.0] [--record]
# Wheels and installs are cached in $TRAINMON_TRITON_CACHE (default ~/.cache/trainmon-triton, ~5 GB for all
# six). See bench/triton_versions.py for what each column means.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
exec "$PYTHON" bench/triton_versions.py "$@"
