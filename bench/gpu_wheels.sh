#!/usr/bin/env bash
# The wheels bench/gpu_check.sh installs on a GPU machine that has no package index, fetched into .whl/ (or
# the folder TRAINMON_WHEELS names) on a machine that has one, from the repository root:
#   bench/gpu_wheels.sh        # then, with the device tool: run(command="bench/gpu_check.sh ...", carry=[".whl"])
# The GPU image (Python 3.12) lacks the native crc32c (TensorBoard's event CRCs then run in pure Python,
# slowing the writer), msprobe (mindstudio-probe, which needs pytz there too), megatron-core, and DeepSpeed
# with what it needs that the image lacks (hjson, pydantic 2 with pydantic-core, annotated-types,
# typing-inspection, and the typing-extensions pydantic-core needs). crc32c's version is the one
# constraints.txt pins; the others are this project's venv's. DeepSpeed publishes an sdist only: its
# pure-Python wheel is built here without its C++/CUDA ops (ZeRO with torch's AdamW needs none), by a Python
# that has torch (PYTHON, default .venv/bin/python). About 13.6 MB in all, inside the device tool's 64 MiB;
# .whl/ is in .gitignore: never committed.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${TRAINMON_WHEELS:-.whl}"
python="${PYTHON:-.venv/bin/python}"
mkdir -p "$out"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
fetch() {
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$out" "$@"
}
fetch crc32c==2.9.post0
fetch mindstudio-probe==26.2.0 pytz==2026.6
fetch megatron-core==0.16.1
fetch hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0
if ! compgen -G "$out/deepspeed-0.19.8-*.whl" >/dev/null; then
  DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir -w "$out" deepspeed==0.19.8
fi
ls -l "$out"
