#!/usr/bin/env bash
# GPU smoke test: on a machine with an NVIDIA GPU and the CUDA toolkit, build gaccwb with the
# `cuda` feature, run the test suite with it, run every built-in preset headless on cuda:0 with
# --record, and print a table (tokens/s, NVML peak memory, trainer peak, measured categories vs
# the estimate, NVML vs trainer agreement). Everything lands in one folder. From the bundle it
# also runs tests/gpu_nccl.rs: a world of one sums gradients through NCCL (needs libnccl.so.2).
# With --speed it then times the training step against PyTorch's where python3 has PyTorch with
# CUDA (benches/hf_speed.py --device cuda; OUT/speed.txt); --speed-only does only that.
#
# Usage:
#   scripts/gpu-smoke.sh [--steps N] [--out DIR]   the smoke test (default: 40 steps, gpu-smoke-out/)
#   scripts/gpu-smoke.sh --prebuilt BUNDLE [--steps N] [--out DIR]
#                                                  the same without compiling, from the bundle that
#                                                  scripts/gpu-bundle.sh builds (no toolkit needed)
#   scripts/gpu-smoke.sh ... --speed | --speed-only  also (only) the step against PyTorch's
#   scripts/gpu-smoke.sh --table DIR               rebuild the table from DIR's recordings
#   scripts/gpu-smoke.sh --self-test BIN           check the table builder without a GPU (CI)
#
# Environment: CUDA_HOME (toolkit; else nvcc on PATH or /usr/local/cuda), CUDA_COMPUTE_CAP (else
# asked of nvidia-smi), GPU_SMOKE_CONTEXT_MIB (NVML-over-trainer allowance, default 1536),
# CUDA_LIB_DIRS (--prebuilt: extra folders for CUDA's libraries; it also looks in python3's
# site-packages/nvidia/*/lib, where PyTorch's CUDA wheels put them).

set -uo pipefail
cd "$(dirname "$0")/.."
SCRIPTS=$PWD/scripts

STEPS=40
OUT=gpu-smoke-out
PREBUILT=
BUILD_LIMIT_S=360
TEST_LIMIT_S=240
PRESET_LIMIT_S=90
SPEED_LIMIT_S=300
SPEED=        # also | only: time the step against PyTorch's (benches/hf_speed.py)

fail() {
    printf '\ngpu-smoke: FAILED: %s\n' "$*" >&2
    exit 1
}

need_python() {
    command -v python3 >/dev/null || fail "python3 is needed to read the recordings"
}

build_table() {
    need_python
    python3 "$SCRIPTS/smoke_table.py" "$1"
}

# ---------------------------------------------------------------------------------------------
# Without a GPU: the table builder on a fixture shaped like a GPU run, then on a real CPU run.

self_test() {
    local bin=$1 tmp status
    [ -x "$bin" ] || fail "--self-test needs the gaccwb binary, got '$bin'"
    need_python
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' RETURN

    echo "table of scripts/testdata/gpu-smoke (a recording shaped like a cuda:0 run):"
    python3 "$SCRIPTS/smoke_table.py" "$SCRIPTS/testdata/gpu-smoke" >"$tmp/fixture.txt"
    status=$?
    cat "$tmp/fixture.txt"
    [ $status -eq 1 ] || fail "the fixture has a failed run: the table must exit 1, it exited $status"
    diff -u "$SCRIPTS/testdata/gpu-smoke.expected" "$tmp/fixture.txt" ||
        fail "the table differs from scripts/testdata/gpu-smoke.expected"

    echo
    echo "table of a 3-step CPU run of each preset:"
    mkdir "$tmp/cpu"
    # A narrower model keeps this quick; each preset keeps its own batch, K and timeline.
    run_presets "$bin" cpu 3 "$tmp/cpu" --set model.d_model=32 --set model.layers=1 --set model.heads=2
    python3 "$SCRIPTS/smoke_table.py" "$tmp/cpu" | tee "$tmp/cpu.txt" ||
        fail "the table of CPU runs reports a failure"
    for preset in $("$bin" presets | awk '{print $1}'); do
        grep -qE "^$preset +ok +3 +[0-9]+ " "$tmp/cpu.txt" ||
            fail "no 'ok, 3 steps, tokens/s' row for preset $preset"
    done
    echo "gpu-smoke self-test: ok"
}

# run_presets BIN DEVICE STEPS DIR [EXTRA ARGS...]: every preset headless, recorded to DIR/NAME.jsonl;
# DIR/runs.tsv lists preset, exit status, seconds.
run_presets() {
    local bin=$1 device=$2 steps=$3 dir=$4 start status
    shift 4
    local presets
    presets=$("$bin" presets | awk '{print $1}') || fail "'gaccwb presets' failed"
    [ -n "$presets" ] || fail "'gaccwb presets' listed no presets"
    : >"$dir/runs.tsv"
    for preset in $presets; do
        start=$SECONDS
        # A preset that fine-tunes a Hugging Face model runs on the repository's tiny checkpoint.
        local model=()
        case $preset in finetune | lora-vs-full)
            model=(--model "$PWD/tests/fixtures/hf/models/llama-tied" --set model.seq_len=16) ;;
        esac
        # --ranks 1: one process each, the data-parallel presets too (their own `train.ranks`
        # would start mpirun, which this table does not measure).
        timeout --kill-after=10 "$PRESET_LIMIT_S" "$bin" run "$preset" --headless --steps "$steps" \
            --ranks 1 --device "$device" --record "$dir/$preset.jsonl" "${model[@]}" "$@" </dev/null \
            >"$dir/$preset.log" 2>&1
        status=$?
        printf '%s\t%s\t%s\n' "$preset" "$status" "$((SECONDS - start))" >>"$dir/runs.tsv"
        printf '  %-24s exit %-3s %4ss  %s\n' "$preset" "$status" "$((SECONDS - start))" \
            "$(tail -n 1 "$dir/$preset.log")"
    done
}

# ---------------------------------------------------------------------------------------------
# On a GPU box.

find_cuda() {
    command -v nvidia-smi >/dev/null ||
        fail "no nvidia-smi: this script needs an NVIDIA GPU and its driver (for the CUDA compile check alone, run .ci/run cuda)"
    nvidia-smi -L 2>/dev/null | grep -q '^GPU 0' || fail "nvidia-smi finds no GPU: $(nvidia-smi -L 2>&1 | head -n 1)"
    if [ -z "${CUDA_HOME:-}" ]; then
        if command -v nvcc >/dev/null; then
            CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
        elif [ -x /usr/local/cuda/bin/nvcc ]; then
            CUDA_HOME=/usr/local/cuda
        fi
    fi
    [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ] ||
        fail "no nvcc: install the CUDA toolkit or set CUDA_HOME (README: Building with CUDA)"
    export CUDA_HOME PATH=$CUDA_HOME/bin:$PATH
    if [ -z "${CUDA_COMPUTE_CAP:-}" ]; then
        CUDA_COMPUTE_CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader -i 0 | tr -d '.[:space:]')
    fi
    export CUDA_COMPUTE_CAP
    need_python
}

# phase NAME LIMIT_S COMMAND...: run with a time limit, log to $OUT/NAME.log, note the time.
phase() {
    local name=$1 limit=$2 start=$SECONDS status
    shift 2
    echo "== $name"
    timeout --kill-after=10 "$limit" "$@" </dev/null >"$OUT/$name.log" 2>&1
    status=$?
    printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" >>"$OUT/phases.tsv"
    echo "   exit $status after $((SECONDS - start))s (log: $OUT/$name.log)"
    [ $status -ne 124 ] || echo "   timed out after ${limit}s"
    return $status
}

smoke() {
    find_cuda
    rm -rf "$OUT"
    mkdir -p "$OUT/runs" || fail "cannot create $OUT"
    local start=$SECONDS failed=0
    {
        date -u
        git rev-parse HEAD 2>/dev/null
        nvidia-smi
        nvcc --version
        echo "CUDA_HOME=$CUDA_HOME CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP"
    } >"$OUT/env.txt" 2>&1
    echo "GPU: $(nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader -i 0)"
    echo "nvcc: $(nvcc --version | tail -n 1); outputs in $OUT/"

    phase build "$BUILD_LIMIT_S" cargo build --locked --release --features cuda ||
        fail "the cuda build failed; see $OUT/build.log"
    if [ "$SPEED" = only ]; then
        speed ./target/release/gaccwb || fail "see $OUT/speed.log"
        return
    fi
    phase test "$TEST_LIMIT_S" cargo test --locked --release --features cuda -- --include-ignored || failed=1
    grep -E '^test result:' "$OUT/test.log" | sed 's/^/   /'

    presets_and_verdict ./target/release/gaccwb 480 "$failed" "$OUT/test.log" "$start"
}

# presets_and_verdict BIN BUDGET_S FAILED LOGS START: every preset on cuda:0 with BIN, the table,
# the time against the budget; fails (pointing at LOGS) when FAILED is 1 or the table has a failure.
presets_and_verdict() {
    local bin=$1 budget=$2 failed=$3 logs=$4 start=$5
    echo "== presets on cuda:0, $STEPS steps each"
    run_presets "$bin" cuda:0 "$STEPS" "$OUT/runs"

    echo
    build_table "$OUT/runs" | tee "$OUT/table.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1

    local total=$((SECONDS - start))
    echo
    echo "total ${total}s (budget ${budget}s)$([ $total -gt "$budget" ] && echo ': OVER BUDGET')"
    if [ "$SPEED" = also ]; then
        speed "$bin" || failed=1
    fi
    [ "$failed" -eq 0 ] || fail "see the table and $logs"
    echo "gpu-smoke: ok"
}

# speed BIN: the training step against PyTorch's on cuda:0 (benches/hf_speed.py: tokens/s and the
# step's FLOP/s over the best product measured on the GPU) at GPT-2-small and Qwen2-0.5B, f32 and
# bf16. Asked for, so a python3 without PyTorch on CUDA fails it.
speed() {
    local bin=$1
    if ! python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        echo "== speed: FAILED: python3 has no PyTorch that sees a CUDA GPU (PYTHONPATH to one)"
        return 1
    fi
    echo "== speed on cuda:0 against PyTorch (benches/hf_speed.py)"
    phase speed "$SPEED_LIMIT_S" python3 benches/hf_speed.py --device cuda --bin "$bin" \
        --shape gpt2-small tests/fixtures/hf/qwen2-0.5b.json --threads 1 --dtype f32 bf16 \
        --rounds 1 --steps 3 --warmup 2 --seq-len 1024 --micro-batch 4
    local status=$?
    grep -E '^[|#]' "$OUT/speed.log" | tee "$OUT/speed.txt"
    [ $status -eq 0 ] || tail -n 20 "$OUT/speed.log"
    return $status
}

# ---------------------------------------------------------------------------------------------
# On a GPU box without a toolchain: the prebuilt bundle.

# Folders holding CUDA's shared libraries: CUDA_LIB_DIRS, then the NVIDIA wheels of python3's
# packages (PyTorch's cu13 build carries cuBLAS, cuRAND and NVRTC there).
cuda_lib_dirs() {
    local d
    for d in ${CUDA_LIB_DIRS:+${CUDA_LIB_DIRS//:/ }}; do [ -d "$d" ] && echo "$d"; done
    command -v python3 >/dev/null || return 0
    python3 - <<'PY' 2>/dev/null
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()] + sys.path
seen = set()
for root in roots:
    for lib in sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib"))):
        if lib not in seen and glob.glob(os.path.join(lib, "*.so*")):
            seen.add(lib)
            print(lib)
PY
}

# What the environment offers, before anything runs: a failure later still teaches something.
print_environment() {
    local bin=$1 lib
    echo "date: $(date -u)"
    echo "host: $(uname -srm), $(nproc) cores"
    echo "bundle:"
    sed 's/^/  /' "$PREBUILT/manifest.txt" 2>/dev/null || echo "  (no manifest.txt)"
    if command -v nvidia-smi >/dev/null; then
        echo "driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader -i 0 2>&1)," \
            "CUDA $(nvidia-smi 2>/dev/null | grep -oE 'CUDA Version: [0-9.]+' | cut -d' ' -f3)"
        echo "nvidia-smi -L:"
        nvidia-smi -L 2>&1 | sed 's/^/  /'
    else
        echo "nvidia-smi: not found"
    fi
    echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}"
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    echo "ldd $bin (not found = missing):"
    ldd "$bin" 2>&1 | sed 's/^/  /'
    # NVML is opened at run time (dlopen), so ldd cannot list it: look it up as the loader will.
    printf 'opened at run time: %s %s\n' libnvidia-ml.so.1 "$(find_library libnvidia-ml.so.1)"
    local missing=0 t
    ldd "$bin" 2>&1 | grep -q 'not found' && missing=1
    # The test binaries may need more (gpu_nccl: libnccl.so.2, from PyTorch's nvidia-nccl wheel).
    for t in "$(dirname "$bin")"/tests/*; do
        [ -x "$t" ] || continue
        if ldd "$t" 2>&1 | grep -q 'not found'; then
            echo "ldd tests/$(basename "$t"), missing:"
            ldd "$t" 2>&1 | grep 'not found' | sed 's/^/  /'
            missing=1
        fi
    done
    if [ $missing -eq 1 ]; then
        echo "MISSING LIBRARIES: set CUDA_LIB_DIRS to the folders that hold them"
    fi
}

# Where the loader would find library $1, or "NOT FOUND".
find_library() {
    local d
    for d in ${LD_LIBRARY_PATH:+${LD_LIBRARY_PATH//:/ }}; do
        [ -e "$d/$1" ] && { echo "$d/$1"; return; }
    done
    ldconfig -p 2>/dev/null | awk -v lib="$1" '$1 == lib {print $NF; found=1; exit} END {if (!found) print "NOT FOUND"}'
}

# Unpack the bundle's binaries (xz or plain) into $1.
unpack_bundle() {
    local dest=$1 f name
    mkdir -p "$dest/tests"
    [ -e "$PREBUILT/gaccwb.xz" ] || [ -e "$PREBUILT/gaccwb" ] ||
        fail "$PREBUILT holds no gaccwb binary: build the bundle with scripts/gpu-bundle.sh"
    for f in "$PREBUILT"/gaccwb* "$PREBUILT"/tests/*; do
        [ -e "$f" ] || continue
        name=${f#"$PREBUILT"/}
        name=${name%.xz}
        if [[ $f == *.xz ]]; then
            xz -dc "$f" >"$dest/$name" || fail "cannot unpack $f"
        else
            cp "$f" "$dest/$name"
        fi
        chmod +x "$dest/$name"
    done
}

smoke_prebuilt() {
    need_python
    rm -rf "$OUT"
    mkdir -p "$OUT/runs" || fail "cannot create $OUT"
    OUT=$(cd "$OUT" && pwd)
    local start=$SECONDS failed=0 bin=$OUT/bin/gaccwb t libs
    libs=$(cuda_lib_dirs | paste -sd: -)
    export LD_LIBRARY_PATH=${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    unpack_bundle "$OUT/bin"
    print_environment "$bin" 2>&1 | tee "$OUT/env.txt"
    echo "bundle size: $(du -sh "$PREBUILT" | cut -f1) packed, $(du -sh "$OUT/bin" | cut -f1) unpacked"
    if [ "$SPEED" = only ]; then
        speed "$bin" || fail "see $OUT/speed.log"
        return
    fi

    for t in "$OUT"/bin/tests/*; do
        [ -x "$t" ] || continue
        # The tests read presets and fixtures relative to the repository root (this folder).
        phase "test-$(basename "$t")" "$TEST_LIMIT_S" "$t" --include-ignored --test-threads=1 --nocapture || failed=1
        grep -E '^test |skipped|rel\. error|^(NVML|NCCL|ZeRO|fp16|f32)' "$OUT/test-$(basename "$t").log" |
            sed 's/^/   /'
    done

    presets_and_verdict "$bin" 360 "$failed" "$OUT/test-*.log" "$start"
}

# ---------------------------------------------------------------------------------------------

while [ $# -gt 0 ]; do
    case $1 in
        --steps) STEPS=${2:?--steps needs a number}; shift 2 ;;
        --out) OUT=${2:?--out needs a folder}; shift 2 ;;
        --prebuilt) PREBUILT=${2:?--prebuilt needs the bundle folder}; shift 2 ;;
        --speed) SPEED=also; shift ;;
        --speed-only) SPEED=only; shift ;;
        --table) build_table "${2:?--table needs a folder}"; exit ;;
        --self-test) self_test "${2:?--self-test needs the gaccwb binary}"; exit ;;
        -h | --help) sed -n '2,22p' "$0"; exit 0 ;;
        *) fail "unknown argument '$1' (see --help)" ;;
    esac
done
if [ -n "$PREBUILT" ]; then
    [ -d "$PREBUILT" ] || fail "--prebuilt $PREBUILT: no such folder"
    PREBUILT=$(cd "$PREBUILT" && pwd)
    smoke_prebuilt
else
    smoke
fi
