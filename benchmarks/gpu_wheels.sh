#!/usr/bin/env bash
# The packages megamlm needs that the lent GPU machine lacks, as wheels to carry there. Its image has
# torch, Triton, transformers, tokenizers, tensorboard, numpy, scipy, einops, psutil, ... (the tool
# library's device/KINDS.md) but not these, and it has no network. Here, with the project's venv:
#   bash benchmarks/gpu_wheels.sh [DIR]          # default .whl (ignored by git); ~33 MiB
# Then carry DIR along (the device tool's `carry`); benchmarks/gpu_lease.sh installs them there (`install_wheels`).
# The versions are the ones installed in this venv (the ones the tests ran with), on x86-64, for CPython 3.11,
# 3.12 (the lent image's, as of 2026-11) and 3.13 (GPU_PYTHONS): three packages have a wheel per Python version
# (~10 MiB a version), and an image with another Python would otherwise refuse them after its start, its
# minutes of device time spent. DeepSpeed publishes no wheel: it is built here without its C++ ops
# (DS_BUILD_OPS=0; the GPU runs use torch's fused AdamW, not DeepSpeed's kernels).
set -euo pipefail
DIR=${1:-.whl}
PY=${PYTHON:-.venv/bin/python}
PACKAGES=(megatron-core webdataset braceexpand hjson pydantic pydantic-core annotated-types typing-inspection zstandard)
pinned() {  # pinned NAME...: NAME==VERSION as installed in $PY's environment
    $PY -c 'import sys, importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' "$@"
}
mkdir -p "$DIR"
for version in ${GPU_PYTHONS:-3.11 3.12 3.13}; do  # a pure-Python wheel is downloaded once
    # shellcheck disable=SC2046  # one word per package
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DIR" $(pinned "${PACKAGES[@]}")
done
DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation "$(pinned deepspeed)" -w "$DIR"
ls -s --block-size=K "$DIR"
