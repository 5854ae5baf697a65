#!/usr/bin/env bash
# Everything samba-hf measures and checks on a GPU, in one script sized for about 9 minutes on an H100 / H200 without
# internet access. From the repository root, after `bash benchmarks/gpu_prepare.sh` on a machine with internet:
#
#     bash benchmarks/gpu_run.sh            # writes into $OUT (default out/gpu)
#
#   1. transformers 5.24 (from the bundle) first on the path; samba-hf from src/;
#   2. mamba-ssm and causal-conv1d built from their sdists for this GPU's architecture only, both at once (~3.5 min);
#   3. tests/test_gpu.py without the kernel packages, then with them;
#   4. benchmarks/gpu.py with them, then without them, samba-hf's Triton scan alone (each under a time limit; each
#      JSON written as it goes);
#   5. the GPU, versions, and every step's log and exit status in $OUT/run.log.
# A step that fails is logged and the next one runs. About 9 minutes in all: the device tool's 600 s per command
# holds it (what is in $OUT when a command is cut comes back anyway).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
BUNDLE=${BUNDLE:-out/gpu-bundle}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT  # the builds and the bundle's installs
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/run.log"; }
step() {  # step NAME SECONDS COMMAND...: run it under a time limit, its output in $OUT/NAME.log
    local name=$1 limit=$2; shift 2
    log "start $name (limit ${limit}s): $*"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    log "end $name: exit $? ($(tail -n 1 "$OUT/$name.log" | cut -c1-200))"
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
site="$WORK/site"      # transformers 5.24 and the build tools
kernels="$WORK/kernels"  # mamba-ssm and causal-conv1d, built here
python3 -m pip install -q --no-index --no-deps --target "$site" "$BUNDLE"/*.whl >> "$OUT/run.log" 2>&1
export PYTHONPATH="$PWD/src:$site"
export PATH="$site/bin:$PATH"  # ninja
python3 - <<PY 2>&1 | tee -a "$OUT/run.log"
import torch, transformers, triton
print("GPU", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__)
PY
arch=$(python3 -c "import torch; print(''.join(map(str, torch.cuda.get_device_capability(0))))")

build() {  # build SDIST: for this architecture only, into its own folder under $kernels
    local dir="$WORK/$(basename "$1" .tar.gz)"
    tar -xzf "$1" -C "$WORK"
    # keep only this GPU's architecture: set just before setup.py's "# HACK: ... _GLIBCXX_USE_CXX11_ABI" comment
    sed -i "s|^    # HACK: The compiler flag -D_GLIBCXX_USE_CXX11_ABI|    cc_flag = [\"-gencode\", \"arch=compute_${arch},code=sm_${arch}\"]\n&|" "$dir/setup.py"
    (cd "$dir" && MAMBA_FORCE_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=8 \
        python3 -m pip install --no-build-isolation --no-deps --no-index --target "$kernels/$(basename "$dir")" .)
}
export -f build; export WORK kernels arch
step build-mamba-ssm 300 bash -c "build $BUNDLE/mamba_ssm-*.tar.gz" &
step build-causal-conv1d 300 bash -c "build $BUNDLE/causal_conv1d-*.tar.gz" &
wait

with_kernels="$PWD/src:$(printf '%s:' "$kernels"/*)$site"
without="$PWD/src:$site"
step test-gpu-without-kernels 50 env PYTHONPATH="$without" python3 -m pytest -q tests/test_gpu.py
step test-gpu-with-kernels 70 env PYTHONPATH="$with_kernels" python3 -m pytest -q tests/test_gpu.py
step bench-with-kernels 95 env PYTHONPATH="$with_kernels" python3 benchmarks/gpu.py --time-limit 75 \
    --out "$OUT/gpu-kernels.json"
# what `pip install samba-hf` gives: samba-hf's Triton scan, no kernel package (NemotronH on its torch path)
step bench-pip-install 95 env PYTHONPATH="$without" python3 benchmarks/gpu.py --kernels triton --time-limit 75 \
    --out "$OUT/gpu-pip-install.json"
log "done; results in $OUT"
