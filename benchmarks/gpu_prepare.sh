#!/usr/bin/env bash
# Fetch what benchmarks/gpu_run.sh needs on a GPU machine without internet, into out/gpu-bundle/ (git-ignored; about
# 16 MB, carried along to the GPU machine): the sdists of mamba-ssm 2.3.2.post1 and causal-conv1d 1.7.0 (no wheels
# exist on PyPI), the transformers 5.24.0 wheel (the GPU machine has 5.17), and what the builds import (einops, ninja,
# wheel, packaging). Run from the repository root on a machine that reaches PyPI:  bash benchmarks/gpu_prepare.sh
set -euo pipefail
bundle=${1:-out/gpu-bundle}
mkdir -p "$bundle"
pip download -q --no-deps --only-binary :all: -d "$bundle" transformers==5.24.0 einops ninja wheel packaging
for spec in mamba-ssm==2.3.2.post1 causal-conv1d==1.7.0; do
    name=${spec%%==*}; version=${spec##*==}
    url=$(python3 -c "import json, sys, urllib.request
data = json.load(urllib.request.urlopen('https://pypi.org/pypi/$name/json'))
print(next(u['url'] for u in data['releases']['$version'] if u['packagetype'] == 'sdist'))")
    [ -f "$bundle/$(basename "$url")" ] || curl -sSfL -o "$bundle/$(basename "$url")" "$url"
done
ls -l "$bundle"
