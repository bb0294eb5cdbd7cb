#!/usr/bin/env bash
# Trains on all GPUs of this host with MirroredStrategy:
#   launch/multi_gpu.sh --gin_file=vit_b16.gin --model_dir=runs/vit_b16 [--gin.NAME=VALUE ...]
# CUDA_VISIBLE_DEVICES selects the GPUs; the global batch must be a multiple of their number.
# Relative paths (--model_dir, --gin_file) mean the caller's working directory: the script stays
# in it and finds the framework through PYTHONPATH when it is not installed.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
if command -v nvidia-smi >/dev/null; then
  echo "GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | paste -sd, -)"
else
  echo "warning: nvidia-smi not found; mirrored will use the CPU" >&2
fi
# The runtime config comes last so it wins over a model config; --gin.NAME=VALUE still overrides it.
exec python -m framework.train "$@" --gin_file=runtime/multi_gpu.gin
