#!/usr/bin/env bash
# On the lent GPU machine (python3 there has torch, triton, safetensors, tabulate, pytest; no network):
# run the GPU tests, the benchmarks, then the example conversions on CUDA; everything lands under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
# The GPU tests skip without CUDA: make a machine without one fail here instead of passing.
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" || exit 1
PYTHONPATH=. python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest_gpu.txt"
status=${PIPESTATUS[0]}
PYTHONPATH=. python3 scripts/bench_sparse_attention.py --out "$OUT" --budget-s "${BENCH_BUDGET_S:-300}" \
  > "$OUT/bench_sparse_attention.txt" 2>&1 || status=1
PYTHONPATH=. python3 scripts/host_time_window_attention.py --out "$OUT" > "$OUT/host_time.txt" 2>&1 || status=1
for recipe in fp8-dynamic mixed; do
  PYTHONPATH=. python3 -m lowconv.cli convert examples/vit.py "$recipe" -o "$OUT/vit-$recipe" --device cuda \
    > "$OUT/vit-$recipe.txt" 2>&1
done
exit "$status"
