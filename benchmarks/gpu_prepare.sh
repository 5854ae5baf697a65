#!/usr/bin/env bash
# Fetch what benchmarks/gpu_run.sh needs on a GPU machine without internet, into out/gpu-bundle/ (git-ignored; about
# 16 MB, carried along to the GPU machine): the sdists of mamba-ssm 2.3.2.post1 and causal-conv1d 1.7.0 (no wheels
# exist on PyPI), the transformers 5.24.0 wheel (the GPU machine has 5.17), and what the builds import (einops, ninja,
# wheel, packaging). Everything by package name through pip. Run from the repository root on a machine that reaches
# PyPI:  bash benchmarks/gpu_prepare.sh
set -euo pipefail
bundle=${1:-out/gpu-bundle}
mkdir -p "$bundle"
pip download -q --no-deps --only-binary :all: -d "$bundle" transformers==5.24.0 einops ninja wheel packaging
# The sdists: pip reads their metadata by running setup.py, which imports torch (so no build isolation, the torch of
# this environment) and would compile CUDA code or fetch a prebuilt wheel (so both skipped: only metadata is asked).
MAMBA_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE \
    pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$bundle" \
    mamba-ssm==2.3.2.post1 causal-conv1d==1.7.0
ls -l "$bundle"
