#!/usr/bin/env bash
# Makes .venv, the current Python stack ckpt is tested against (python/requirements.txt), beside
# Debian's python3-torch (1.13, the oldest torch supported), which tests use too. Skipped when
# .venv already holds every pinned version.
set -euo pipefail
cd "$(dirname "$0")/.."
req=python/requirements.txt
torch_version=$(sed -n 's/^torch==//p' "$req")
if [ -x .venv/bin/python ] && .venv/bin/python - "$req" <<'PY' 2>/dev/null; then
import sys
from importlib.metadata import version
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, want = line.split("==")
        if version(name).split("+")[0] != want:
            sys.exit(1)
PY
  exit 0
fi
/usr/bin/python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch's CPU build first, by its exact version: from a wheel pip already knows of (a local
# wheel directory or index), else from PyTorch's CPU index. Asked for without "+cpu", PyPI would
# give the CUDA build.
.venv/bin/python -m pip install -q "torch==${torch_version}+cpu" ||
  .venv/bin/python -m pip install -q "torch==${torch_version}+cpu" \
    --index-url https://download.pytorch.org/whl/cpu
.venv/bin/python -m pip install -q -r "$req"
.venv/bin/python -c "import torch, transformers, accelerate, lightning, peft, safetensors; \
print('venv: torch', torch.__version__, 'transformers', transformers.__version__)"
