#!/usr/bin/env bash
# Prepare the folder benchmarks/gpu/run.sh installs from, on a machine with uv and PyPI, for a
# GPU machine with no network (Python 3.12, its own torch): the workspace's own wheels (~0.6
# MB for all nine) plus the few dependencies such a machine lacks or has older (FACTS.md,
# "On an H100": 16 MB in all). Usage: bash benchmarks/gpu/prepare.sh [OUT] [--own-only]
#   OUT defaults to .whl; --own-only builds the workspace's wheels only (the CPU smoke run,
#   whose Python already has every dependency).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-.whl}
mkdir -p "$OUT"
uv build --all-packages --wheel --quiet -o "$OUT"
if [ "${2:-}" != "--own-only" ]; then
  # versions of uv.lock; the Python 3.12 builds (megatron-core's newest need 3.12)
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$OUT" \
    omegaconf==2.4.0 transformers==5.23.0 megatron-core==0.19.2 megatron-fsdp==0.6.1
fi
du -sh "$OUT"
