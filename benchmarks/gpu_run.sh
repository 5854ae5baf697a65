#!/usr/bin/env bash
# Everything samba-hf measures and checks on a GPU, for an H100 / H200 without internet access, in two device commands
# on one machine (a session's 15 device minutes: a start of a minute or two, then these two, the second sent while
# the machine is still warm). From the repository root, after `bash benchmarks/gpu_prepare.sh` on a machine with
# internet:
#
#     bash benchmarks/gpu_run.sh          # first (~8 min, ends by $DEADLINE, default 470 s): starts the builds of
#                                         # mamba-ssm and causal-conv1d in a session of their own (they outlive the
#                                         # command), then tests/test_gpu.py without them, then benchmarks/gpu.py on
#                                         # Samba-1.3B and the same-shape Llama at #46's lengths on samba-hf's Triton
#                                         # kernels (what `pip install` gives), with the micro-benchmarks
#     bash benchmarks/gpu_run.sh second   # then, on the same machine (~5 min, ends by $DEADLINE, default 290 s):
#                                         # tests/test_gpu.py with the built packages, then Phi-4-mini-flash against
#                                         # a same-size Llama, then the Mamba-2-Hybrid against NemotronH's torch path
#     bash benchmarks/gpu_run.sh bench-kernels  # given more time: Samba and Llama with the packages in the models
#
#   1. transformers 5.24 (from the bundle) first on the path; samba-hf from src/;
#   2. mamba-ssm and causal-conv1d built from their sdists for this GPU's architecture only, both at once, niced,
#      into $WORK (default ~/.samba-hf-gpu), each writing $WORK/<sdist>.done when finished;
#   3. each test and benchmark step under a time limit, each JSON written as it goes; tests/test_gpu.py on 4 workers
#      (pytest-xdist, in the GPU image): on the H200 (2026-11-28) one worker ran 28 and 22 of its 34 cases in 200 s;
#   4. the GPU and versions in $OUT/run.log, every step's output appended to $OUT/steps.log (few files: the device
#      tool brings back at most 8).
# A step that fails is logged and the next one runs. Writes into $OUT (default out/gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:-all}
case "$STAGE" in all|second|bench-kernels) ;; *) echo "gpu_run.sh: the stage is second, bench-kernels or nothing (all), not $STAGE" >&2; exit 1 ;; esac
OUT=${OUT:-out/gpu}
BUNDLE=${BUNDLE:-out/gpu-bundle}
WORK=${WORK:-$HOME/.samba-hf-gpu}
if [ "$STAGE" = all ]; then DEADLINE=${DEADLINE:-470}; else DEADLINE=${DEADLINE:-290}; fi
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
log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$OUT/run.log"; }
step() {  # step NAME SECONDS COMMAND...: run it under a time limit, its output appended to $OUT/steps.log
    local name=$1 limit=$2; shift 2
    log "start $name (limit ${limit}s): $*"
    timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
    local status=$?
    { echo "===== $name (exit $status)"; grep -v "^WARNING: Location" "$WORK/$name.log"; } >> "$OUT/steps.log"
    log "end $name: exit $status ($(tail -n 1 "$WORK/$name.log" | cut -c1-200))"
}
left() { echo $((DEADLINE - SECONDS)); }

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
site="$WORK/site"      # transformers 5.24 and the build tools
kernels="$WORK/kernels"  # mamba-ssm and causal-conv1d, built here
[ -d "$site/transformers" ] || python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" "$BUNDLE"/*.whl >> "$OUT/run.log" 2>&1
export PYTHONPATH="$PWD/src:$site"
export PATH="$site/bin:$PATH"  # ninja
python3 - <<PY 2>&1 | tee -a "$OUT/run.log"
import subprocess, torch, transformers, triton
print("GPU", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__)
print("samba-hf", subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "(no git)")
PY
arch=$(python3 -c "import torch; print(''.join(map(str, torch.cuda.get_device_capability(0))))")

build() {  # build SDIST: for this architecture only, into its own folder under $kernels (once); SDIST.done at the end
    local dir="$WORK/$(basename "$1" .tar.gz)"
    if [ -d "$kernels/$(basename "$dir")" ]; then echo "already built: $kernels/$(basename "$dir")"; touch "$dir.done"; return 0; fi
    tar -xzf "$1" -C "$WORK"
    # keep only this GPU's architecture: set just before setup.py's "# HACK: ... _GLIBCXX_USE_CXX11_ABI" comment
    sed -i "s|^    # HACK: The compiler flag -D_GLIBCXX_USE_CXX11_ABI|    cc_flag = [\"-gencode\", \"arch=compute_${arch},code=sm_${arch}\"]\n&|" "$dir/setup.py"
    (cd "$dir" && MAMBA_FORCE_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-8} \
        python3 -m pip install --no-build-isolation --no-deps --no-index --target "$kernels/$(basename "$dir").partial" . \
        && mv "$kernels/$(basename "$dir").partial" "$kernels/$(basename "$dir")")
    echo "build exit $?" > "$dir.done"
}
export -f build; export WORK kernels arch
without="$PWD/src:$site"
with_kernels() { echo "$PWD/src:$(printf '%s:' "$kernels"/*[0-9])$site"; }  # the finished builds (no .partial)
# Samba-1.3B against Llama at #46's lengths; Phi-4-mini-flash against a same-size Llama (decode at 32K, batch 1 and
# the largest that fits, up to 1024); the Mamba-2-Hybrid against NemotronH
samba_lengths="--models Samba-1.3B,Llama-1.3B --prefill 4096,32768,131072 --decode 1024,65536 --batch 16 --steps 16"
phi_lengths="--models Phi-4-mini-flash,Llama-3.8B --prefill 4096,32768 --decode 32768 --batch 16,64,256,1024 --steps 8 --train= --no-graphs --no-micro"
hybrid_lengths="--models Mamba-2-Hybrid,NemotronH --prefill 4096,32768,131072 --decode 1024 --batch 16 --steps 8 --train= --no-graphs --verify-tokens 0 --no-micro"

if [ "$STAGE" = all ]; then
    mkdir -p "$kernels"
    for sdist in "$BUNDLE"/mamba_ssm-*.tar.gz "$BUNDLE"/causal_conv1d-*.tar.gz; do
        name=$(basename "$sdist" .tar.gz)
        rm -f "$WORK/$name.done"
        jobs=8; [[ $name == causal* ]] && jobs=6
        # a session of its own: it goes on after this command returns, for the second command to use
        setsid nice -n 10 env MAX_JOBS=$jobs bash -c "build $sdist" > "$WORK/build-$name.log" 2>&1 < /dev/null &
        log "build of $name started (MAX_JOBS=$jobs, niced, its own session): log $WORK/build-$name.log"
    done
    step test-gpu-without-kernels 200 env PYTHONPATH="$without" python3 -m pytest -q -rf -n 4 --durations=8 tests/test_gpu.py
    if [ "$(left)" -gt 60 ]; then
        step bench-samba "$(left)" env PYTHONPATH="$without" python3 benchmarks/gpu.py --kernels triton $samba_lengths \
            --time-limit $(($(left) - 40)) --out "$OUT/gpu-samba.json"
    else
        log "no time left for the benchmark ($(left)s to the deadline)"
    fi
fi
if [ "$STAGE" = second ]; then
    for sdist in "$BUNDLE"/mamba_ssm-*.tar.gz "$BUNDLE"/causal_conv1d-*.tar.gz; do
        name=$(basename "$sdist" .tar.gz)
        for _ in $(seq 90); do [ -f "$WORK/$name.done" ] && break; sleep 1; done
        log "build of $name: $(cat "$WORK/$name.done" 2> /dev/null || echo 'not finished')"
        { echo "===== build of $name"; tail -n 30 "$WORK/build-$name.log" 2> /dev/null; } >> "$OUT/steps.log"
    done
    step test-gpu-with-kernels "${TEST_LIMIT:-170}" env PYTHONPATH="$(with_kernels)" python3 -m pytest -q -rf -n 4 --durations=8 tests/test_gpu.py
    if [ "$(left)" -gt 40 ]; then
        step bench-phi "$(left)" env PYTHONPATH="$without" python3 benchmarks/gpu.py --kernels triton $phi_lengths \
            --time-limit $(($(left) * 2 / 3)) --out "$OUT/gpu-phi.json"
    fi
    if [ "$(left)" -gt 30 ]; then
        step bench-hybrid "$(left)" env PYTHONPATH="$without" python3 benchmarks/gpu.py --kernels triton $hybrid_lengths \
            --time-limit $(($(left) - 20)) --out "$OUT/gpu-hybrid.json"
    fi
fi
if [ "$STAGE" = bench-kernels ]; then
    step bench-with-kernels "$(left)" env PYTHONPATH="$(with_kernels)" python3 benchmarks/gpu.py $samba_lengths \
        --time-limit $(($(left) - 40)) --out "$OUT/gpu-kernels.json"
fi
log "done ($STAGE); results in $OUT"
