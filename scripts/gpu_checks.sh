#!/usr/bin/env bash
# The checks a lent GPU runs, in one go (at most 9 minutes on one H200), from the repo root
# with dflash importable (`pip install -e .`, or PYTHONPATH=. with the deps present):
#   1. the CUDA-only tests: compiled flex block mask vs the dense mask (forward and gradients),
#      and fla's linear-attention kernels vs the torch path (skipped unless fla is installed);
#   2. benchmarks/gpu.py: extraction tokens/s at real width, drafter training step tokens/s
#      and MFU at the Qwen3.6-27B drafter shape, flex vs dense speed.
# Everything printed is also written to ${OUT:-.}/gpu_checks.log.
set -u -o pipefail
log="${OUT:-.}/gpu_checks.log"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  timeout 200 python3 -m pytest -q -rs -k cuda tests/drafter/test_model.py \
      tests/extract/test_kernels_cuda.py
  timeout 330 python3 benchmarks/gpu.py
} 2>&1 | tee "$log"
