#!/usr/bin/env bash
# The checks a lent GPU runs, in one go (time limits of 510 s in all, on one H200), from the
# repo root with dflash importable (`pip install -e .`, or PYTHONPATH=. with the deps present):
#   1. benchmarks/gpu.py: drafter training step tokens/s, MFU and peak memory at the
#      Qwen3.6-27B drafter shape, flex vs dense speed (in a process of its own, so that an
#      overrunning compile costs only its rows); then the loss head over a 32,768-row draft
#      vocabulary vs all 248,320, the training loader's cold read rate, both set against
#      that step (handed over in gpu_measured.json), and extraction tokens/s at real width
#      (bare forward, + top-k, + the store writer). It prints timestamped progress, skips
#      parts not started within its budget, reports a failed part and goes on, and dumps
#      every thread's stack when the time limit kills it, so a cut run shows where its time
#      went. Arguments go to one gpu.py run instead: a rerun can take only the parts the
#      first run missed (`bash scripts/gpu_checks.sh --parts loader,extract`);
#   2. the CUDA-only tests: compiled flex block mask vs the dense mask (forward and
#      gradients), for DFlash and for DFlash 2 (its convolutions and selector term), and
#      fla's linear-attention kernels against the float32 torch path (skipped unless fla is
#      installed).
# Everything printed is also written to ${OUT:-.}/gpu_checks.log.
#
# A GPU machine without a package index: on a machine with one, in the repo root,
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 -d .whl zarr==3.1.6 \
#     numcodecs==0.16.6 donfig google-crc32c dask partd locket fla-core \
#     flash-linear-attention transformers==5.24.0
# (26 MB on 2026-12-04, well under the 64 MiB a run carries; gguf and accelerate, which
# pyproject lists, are not imported by these checks; the 2026-11-30 H200 image had torch
# 2.11, numpy, tokenizers, safetensors, einops, pyarrow, click, tqdm, fsspec, pyyaml, toolz,
# cloudpickle, pytest and transformers' other requirements), then carry .whl and start the
# command with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site:$PWD
set -u -o pipefail
log="${OUT:-.}/gpu_checks.log"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nproc && df -h /dev/shm /tmp .  # loader workers hand batches over through /dev/shm
  measured="${OUT:-.}/gpu_measured.json"
  rm -f "$measured"
  if [ $# -gt 0 ]; then  # a rerun's own choice of parts
    timeout -k 20 330 python3 -m benchmarks.gpu --budget 270 --measured "$measured" "$@"
  else
    # The train part in a process of its own: a compile that overruns its limit (as the
    # 2026-11-30 run's did) then costs only its own rows; the other parts read its step
    # from the file it leaves.
    timeout -k 20 210 python3 -m benchmarks.gpu --parts train --budget 150 \
        --measured "$measured"
    timeout -k 20 120 python3 -m benchmarks.gpu --parts head,loader,extract --budget 90 \
        --measured "$measured"
  fi
  timeout 180 python3 -m pytest -q -rs -k cuda tests/drafter/test_model.py \
      tests/drafter/test_dflash2.py tests/extract/test_kernels_cuda.py \
      tests/target_model/test_cached.py
} 2>&1 | tee "$log"
