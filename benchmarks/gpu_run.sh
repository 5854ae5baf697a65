#!/usr/bin/env bash
# Everything samba-hf measures and checks on a GPU, for an H100 / H200 without internet access. From the repository
# root, after `bash benchmarks/gpu_prepare.sh` on a machine with internet:
#
#     bash benchmarks/gpu_run.sh            # all of it in one 600 s device command (~9 min; below)
#     bash benchmarks/gpu_run.sh pip        # what `pip install samba-hf` gives (~9 min): tests/test_gpu.py without
#                                           # the kernel packages, then benchmarks/gpu.py on samba-hf's Triton scans
#     bash benchmarks/gpu_run.sh kernels    # build mamba-ssm and causal-conv1d (~5 min), tests/test_gpu.py with them
#     bash benchmarks/gpu_run.sh bench      # benchmarks/gpu.py at #32's lengths on samba-hf's Triton kernels (~4
#                                           # min; its micro-benchmarks set them beside mamba-ssm's where `all` or
#                                           # `kernels` built it on this machine: call it while that one is warm)
#     bash benchmarks/gpu_run.sh bench-kernels  # the same with mamba-ssm and causal-conv1d in the models (~4 min)
#
# The default (all) is one device command: the two builds run niced while tests/test_gpu.py runs without the
# packages; then tests/test_gpu.py with them; then benchmarks/gpu.py at the lengths #32 names (prefill 4K / 32K /
# 128K, decode at 1K and 64K) on samba-hf's Triton scans (what `pip install` gives Samba; the micro-benchmark sets
# them beside mamba-ssm's kernels, and NemotronH takes mamba-ssm), cut off by its --time-limit so that everything
# ends by $DEADLINE seconds (default 580). On an H100 (2026-11-26) the two test runs took 131 s and 158 s and left
# the benchmark 57 s, too few: it ran as a second command on the same machine (220 s; the command is in
# benchmarks/results/HISTORY.md). So with 15 minutes of device time (a start, 9 minutes, 4 minutes): `all`, then at once
# `bench` on the still-warm machine; `bench-kernels` when there is more time.
#   1. transformers 5.24 (from the bundle) first on the path; samba-hf from src/;
#   2. mamba-ssm and causal-conv1d built from their sdists for this GPU's architecture only, both at once (kept in
#      $WORK, default ~/.samba-hf-gpu, so that `bench` after `kernels` on the same machine reuses them);
#   3. each test and benchmark step under a time limit, each JSON written as it goes;
#   4. the GPU and versions in $OUT/run.log, every step's output appended to $OUT/steps.log (few files: the device
#      tool brings back only a handful).
# A step that fails is logged and the next one runs. Writes into $OUT (default out/gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:-all}
case "$STAGE" in all|pip|kernels|bench|bench-kernels) ;; *) echo "gpu_run.sh: the stage is pip, kernels, bench, bench-kernels or nothing (all), not $STAGE" >&2; exit 1 ;; esac
OUT=${OUT:-out/gpu}
BUNDLE=${BUNDLE:-out/gpu-bundle}
WORK=${WORK:-$HOME/.samba-hf-gpu}
DEADLINE=${DEADLINE:-580}
# what the run needs, checked before anything is written: the bundle, and a GPU
if ! compgen -G "$BUNDLE/*.whl" > /dev/null; then
    echo "gpu_run.sh: no wheels in $BUNDLE: run \`bash benchmarks/gpu_prepare.sh\` on a machine with internet and carry $BUNDLE here (or set BUNDLE)" >&2
    exit 1
fi
if ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2> /dev/null; then
    echo "gpu_run.sh: python3's torch sees no CUDA GPU here: run it on the GPU machine" >&2
    exit 1
fi
mkdir -p "$OUT" "$WORK"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/run.log"; }
step() {  # step NAME SECONDS COMMAND...: run it under a time limit, its output appended to $OUT/steps.log
    local name=$1 limit=$2; shift 2
    log "start $name (limit ${limit}s): $*"
    timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
    local status=$?
    { echo "===== $name (exit $status)"; grep -v "^WARNING: Location" "$WORK/$name.log"; } >> "$OUT/steps.log"
    log "end $name: exit $status ($(tail -n 1 "$WORK/$name.log" | cut -c1-200))"
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
site="$WORK/site"      # transformers 5.24 and the build tools
kernels="$WORK/kernels"  # mamba-ssm and causal-conv1d, built here
python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" "$BUNDLE"/*.whl >> "$OUT/run.log" 2>&1
export PYTHONPATH="$PWD/src:$site"
export PATH="$site/bin:$PATH"  # ninja
python3 - <<PY 2>&1 | tee -a "$OUT/run.log"
import torch, transformers, triton
print("GPU", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__)
PY
arch=$(python3 -c "import torch; print(''.join(map(str, torch.cuda.get_device_capability(0))))")

build() {  # build SDIST: for this architecture only, into its own folder under $kernels (once)
    local dir="$WORK/$(basename "$1" .tar.gz)"
    if [ -d "$kernels/$(basename "$dir")" ]; then echo "already built: $kernels/$(basename "$dir")"; return 0; fi
    tar -xzf "$1" -C "$WORK"
    # keep only this GPU's architecture: set just before setup.py's "# HACK: ... _GLIBCXX_USE_CXX11_ABI" comment
    sed -i "s|^    # HACK: The compiler flag -D_GLIBCXX_USE_CXX11_ABI|    cc_flag = [\"-gencode\", \"arch=compute_${arch},code=sm_${arch}\"]\n&|" "$dir/setup.py"
    (cd "$dir" && MAMBA_FORCE_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-8} \
        python3 -m pip install --no-build-isolation --no-deps --no-index --target "$kernels/$(basename "$dir")" .)
}
export -f build; export WORK kernels arch
with_kernels="$PWD/src:$(printf '%s:' "$kernels"/*)$site"
without="$PWD/src:$site"
if [ "$STAGE" = all ]; then
    # the builds niced, while the tests without the packages run on the GPU (on an H100, 2026-11-26: mamba-ssm
    # built in 137 s with 9 jobs; causal-conv1d had not finished in 330 s with 3, and its tests were skipped)
    step build-mamba-ssm 330 nice -n 10 env MAX_JOBS=9 bash -c "build $BUNDLE/mamba_ssm-*.tar.gz" &
    step build-causal-conv1d 330 nice -n 10 env MAX_JOBS=6 bash -c "build $BUNDLE/causal_conv1d-*.tar.gz" &
    step test-gpu-without-kernels 240 env PYTHONPATH="$without" python3 -m pytest -q -rf --durations=8 tests/test_gpu.py
    wait
    with_kernels="$PWD/src:$(printf '%s:' "$kernels"/*)$site"
    step test-gpu-with-kernels 200 env PYTHONPATH="$with_kernels" python3 -m pytest -q -rf --durations=8 tests/test_gpu.py
    left=$((DEADLINE - SECONDS))  # the benchmark stops measuring a minute before, and is stopped at, the deadline
    if [ "$left" -gt 90 ]; then
        step bench-pip-install "$left" env PYTHONPATH="$with_kernels" python3 benchmarks/gpu.py --kernels triton \
            --prefill 4096,32768,131072 --decode 1024,65536 --steps 16 --time-limit $((left - 60)) \
            --out "$OUT/gpu-pip-install.json"
    else
        log "no time left for the benchmark (${left}s to the deadline): run the pip stage"
    fi
fi
if [ "$STAGE" = pip ]; then
    step test-gpu-without-kernels 200 env PYTHONPATH="$without" python3 -m pytest -q -rf tests/test_gpu.py
    # what `pip install samba-hf` gives: samba-hf's Triton scans, no kernel package (NemotronH on its torch path)
    step bench-pip-install 330 env PYTHONPATH="$without" python3 benchmarks/gpu.py --kernels triton --time-limit 300 \
        --out "$OUT/gpu-pip-install.json"
fi
if [ "$STAGE" = kernels ]; then
    step build-mamba-ssm 400 bash -c "build $BUNDLE/mamba_ssm-*.tar.gz" &
    step build-causal-conv1d 400 bash -c "build $BUNDLE/causal_conv1d-*.tar.gz" &
    wait
    with_kernels="$PWD/src:$(printf '%s:' "$kernels"/*)$site"
    step test-gpu-with-kernels 170 env PYTHONPATH="$with_kernels" python3 -m pytest -q -rf tests/test_gpu.py
fi
lengths="--prefill 4096,32768,131072 --decode 1024,65536 --steps 16"  # #32's
if [ "$STAGE" = bench ]; then
    step bench-pip-install 250 env PYTHONPATH="$with_kernels" python3 benchmarks/gpu.py --kernels triton $lengths \
        --time-limit 190 --out "$OUT/gpu-pip-install.json"
fi
if [ "$STAGE" = bench-kernels ]; then
    step bench-with-kernels 250 env PYTHONPATH="$with_kernels" python3 benchmarks/gpu.py $lengths --time-limit 190 \
        --out "$OUT/gpu-kernels.json"
fi
log "done ($STAGE); results in $OUT"
