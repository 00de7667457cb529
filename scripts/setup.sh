#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv with trainmon and its test tools.
# torch is installed first, pinned by constraints.txt, so no other step can pull a different build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
torch_pin="$(grep -E '^torch==' constraints.txt)"
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '${torch_pin#torch==}')" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet "$torch_pin"
fi
# DeepSpeed builds no C++/CUDA op at install time (DS_BUILD_OPS=0) and uses its CPU accelerator
DS_BUILD_OPS=0 DS_ACCELERATOR=cpu .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[test,frameworks,torchtitan,loops]"
# The plugin's browser test drives Debian's Chromium through Playwright (never `playwright install`).
if ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "installing chromium (for the TensorBoard plugin's browser test)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "warning: chromium is not installed; install it (apt-get install chromium) for tests/test_plugin_ui.py" >&2
  fi
fi
.venv/bin/python -c "import torch, trainmon; print('trainmon', trainmon.__version__, 'with torch', torch.__version__)"
