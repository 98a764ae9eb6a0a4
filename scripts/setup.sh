#!/usr/bin/env bash
# Create .venv with lowconv and its test dependencies (idempotent).
# torch is pinned first: on CPU machines `pip install torch==2.13.0` takes the CPU wheel,
# while an open range would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q torch==2.13.0
# Triton kernels' logic is tested on the CPU under TRITON_INTERPRET=1; 3.6.0 with numpy < 2.3 is
# the pairing seen working here (a CUDA torch brings its own triton).
.venv/bin/python -c "import triton" 2>/dev/null || .venv/bin/pip install -q triton==3.6.0
.venv/bin/pip install -q -e ".[test]"
