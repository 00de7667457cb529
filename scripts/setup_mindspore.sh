#!/usr/bin/env bash
# Create (or update) .venv-ms: MindSpore + trainmon without torch, for the tests in tests_ms/.
# A separate venv because MindSpore 2.10 needs numpy<2 and must never be installed beside torch in .venv.
# Idempotent: when MindSpore and trainmon already import, only the editable trainmon install is refreshed.
set -euo pipefail
cd "$(dirname "$0")/.."
# One setup at a time: tests run under pytest-xdist may call this script at once (tests/test_mindspore_env.py,
# tests/test_cross_framework.py); the lock is held until the script exits.
exec 9>.venv-ms.lock
flock 9
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
[ -x .venv-ms/bin/python ] || "$PYTHON" -m venv .venv-ms
if ! .venv-ms/bin/python -c "import mindspore, numpy, pandas, pyarrow, yaml, safetensors, tensorboard, werkzeug, crc32c, pytest, pytest_timeout, sys; sys.exit(mindspore.__version__ != '2.10.0' or int(numpy.__version__.split('.')[0]) >= 2)" 2>/dev/null; then
  .venv-ms/bin/python -m pip install --quiet --upgrade pip
  .venv-ms/bin/python -m pip install --quiet -c constraints-ms.txt \
    mindspore numpy pandas pyarrow pyyaml safetensors tensorboard crc32c pytest pytest-timeout
fi
# trainmon from this checkout through a .pth file, not `pip install -e .`: that would rebuild the native
# stats kernel (torch only) in place, under processes of the main venv that have it loaded; and it would
# pull torch, which this venv must not have. Run the CLI here as `.venv-ms/bin/python -m trainmon`.
site="$(.venv-ms/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
.venv-ms/bin/python -m pip uninstall --quiet --yes trainmon >/dev/null 2>&1 || true
# written aside and renamed: a MindSpore test starting meanwhile sees the old file or the new one, never none
printf '%s\n%s\n' "$PWD" "$PWD/tb_plugin" > "$site/trainmon-checkout.pth.tmp"
mv -f "$site/trainmon-checkout.pth.tmp" "$site/trainmon-checkout.pth"
.venv-ms/bin/python -c "import mindspore, numpy, trainmon; print('trainmon', trainmon.__version__, 'with mindspore', mindspore.__version__, 'numpy', numpy.__version__)"
