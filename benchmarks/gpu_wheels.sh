#!/usr/bin/env bash
# The packages megamlm needs that the lent GPU machine lacks, as wheels to carry there. Its image has
# torch, Triton, transformers, tokenizers, tensorboard, numpy, scipy, einops, psutil, ... (the tool
# library's device/KINDS.md) but not these, and it has no network. Here, with the project's venv:
#   bash benchmarks/gpu_wheels.sh [DIR]          # default .whl (ignored by git); ~10 MiB
# Then carry DIR along (the device tool's `carry`) and begin the command there with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# The versions are the ones installed in this venv (the ones the tests ran with), for the machine's
# CPython 3.12 on x86-64. DeepSpeed publishes no wheel: it is built here without its C++ ops (DS_BUILD_OPS=0;
# the GPU runs use torch's fused AdamW, not DeepSpeed's kernels).
set -euo pipefail
DIR=${1:-.whl}
PY=${PYTHON:-.venv/bin/python}
PACKAGES=(megatron-core webdataset braceexpand hjson pydantic pydantic-core annotated-types typing-inspection zstandard)
pinned() {  # pinned NAME...: NAME==VERSION as installed in $PY's environment
    $PY -c 'import sys, importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' "$@"
}
mkdir -p "$DIR"
# shellcheck disable=SC2046  # one word per package
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DIR" $(pinned "${PACKAGES[@]}")
DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation "$(pinned deepspeed)" -w "$DIR"
ls -s --block-size=K "$DIR"
