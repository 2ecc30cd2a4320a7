#!/usr/bin/env bash
# Download, on a machine with PyPI, the wheels the GPU machine lacks (diffusers, for the
# `diffusers-group` bench method and the pipeline tests; nvCOMP, for codec='ans' on CUDA;
# torchao, for the quantized-block tests; about 43 MB, under the 64 MiB a call carries) into
# .whl/ (git-ignored). Carry `.whl` with the device
# call; launch/gpu_suite.sh installs them into /tmp/site when the folder is present.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl diffusers==0.42.1 importlib_metadata nvidia-nvcomp-cu13==6.0.0.12 \
  nvidia-libnvcomp-cu13==6.0.0.12 torchao==0.18.0
ls -la .whl
