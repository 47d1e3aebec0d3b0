#!/usr/bin/env bash
# Build the prebuilt bundle that `scripts/gpu-smoke.sh --prebuilt DIR` runs on a GPU machine
# with no Rust toolchain and no network: the CUDA release binary and the CUDA test binaries,
# stripped and xz-compressed, with a manifest. Runs here, without a GPU. The NCCL test binary
# (`--features nccl`) also needs Open MPI and libclang to build (Debian: libopenmpi-dev
# libclang-dev); NCCL itself comes from PyPI to link against.
#
# The compiler is CUDA 13.0 from PyPI, not CI's newer one: Candle embeds PTX, and a driver loads
# PTX only from a toolkit no newer than itself, so 13.0 PTX loads on any driver of CUDA 13.0
# or later (driver 580 and up).
#
# Usage: scripts/gpu-bundle.sh [--out DIR]   (default DIR: gpu-bundle/, git-ignored)
# Environment: GACCWB_CI_CACHE (toolkit cache, default ~/.cache/gaccwb-ci), CUDA_COMPUTE_CAP
# (default 90: H100/H200), CARGO_TARGET_DIR (default $GACCWB_CI_CACHE/target-bundle),
# BUNDLE_LIMIT_MIB (default 60: what may travel with the working tree is 64 MiB).

set -euo pipefail
cd "$(dirname "$0")/.."

OUT=gpu-bundle
CACHE=${GACCWB_CI_CACHE:-$HOME/.cache/gaccwb-ci}
# The compiler, and the libraries the binary links against (Candle links cudarc dynamically:
# the link needs them, the GPU machine supplies its own at run time).
CUDA_WHEELS=(nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
    nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-cuda-nvrtc==13.0.88)
CUDA_DIR=$CACHE/cuda-13.0.88
LIMIT_MIB=${BUNDLE_LIMIT_MIB:-60}
# The integration tests to run on the GPU without cargo (the CPU ones already ran here), each
# as TEST:FEATURES. gpu_nccl needs libnccl on the GPU machine, so it is a binary of its own.
TESTS=(gpu:cuda gpu_nccl:nccl)
# NCCL to link gpu_nccl against (the GPU machine supplies its own libnccl.so.2 at run time).
NCCL_WHEEL=nvidia-nccl-cu13==2.32.6
NCCL_DIR=$CACHE/nccl-2.32.6

while [ $# -gt 0 ]; do
    case $1 in
        --out) OUT=${2:?--out needs a folder}; shift 2 ;;
        -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "gpu-bundle: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done

for tool in python3 xz strip cargo; do
    command -v $tool >/dev/null || { echo "gpu-bundle: $tool is needed" >&2; exit 1; }
done

# install_wheels DIR READY WHAT WHEEL...: the wheels into DIR (once; READY is a file they bring).
install_wheels() {
    local dir=$1 ready=$2 what=$3
    shift 3
    [ -e "$dir/$ready" ] && return
    echo "installing $what from PyPI into $dir"
    rm -rf "$dir.partial"
    python3 -m pip install --quiet --no-input --disable-pip-version-check --no-deps \
        --target "$dir.partial" "$@"
    mv "$dir.partial" "$dir"
}
install_wheels "$CUDA_DIR" nvidia/cu13/bin/nvcc "the CUDA 13.0 compiler" "${CUDA_WHEELS[@]}"
install_wheels "$NCCL_DIR" nvidia/nccl/lib/libnccl.so.2 "NCCL (to link against)" "$NCCL_WHEEL"
cu13=$CUDA_DIR/nvidia/cu13
export CUDA_HOME=$cu13 CUDA_PATH=$cu13 PATH=$cu13/bin:$PATH

# Link-time libraries: the wheels carry only versioned names (libcublas.so.13), and no machine
# here has the driver's libcuda.so. A stub libcuda.so.1 defines every driver function cudarc
# declares; the binary records the name libcuda.so.1 and the GPU machine's driver provides it.
link_dir=$CACHE/cuda-13.0-link
if [ ! -e "$link_dir/libcuda.so" ]; then
    rm -rf "$link_dir" && mkdir -p "$link_dir"
    for lib in "$cu13"/lib/lib{cublas,cublasLt,curand,nvrtc,cudart}.so.*; do
        [ -e "$lib" ] || continue
        base=$(basename "$lib")
        ln -sf "$lib" "$link_dir/${base%%.so.*}.so"
    done
    cudarc_src=$(cargo metadata --locked --format-version 1 --features cuda |
        python3 -c 'import json,sys; print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"] == "cudarc").rsplit("/", 1)[0])')
    # The driver functions are declared one per line, `fn cuName(...)`, in extern blocks.
    grep -ohE '^\s*fn cu[A-Za-z0-9_]+\(' "$cudarc_src"/src/driver/sys/*.rs |
        sed -E 's/^\s*fn //; s/\($//' | sort -u | sed 's/.*/void &(void) {}/' >"$link_dir/cuda_stub.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link_dir/libcuda.so" "$link_dir/cuda_stub.c"
fi
ln -sf "$NCCL_DIR/nvidia/nccl/lib/libnccl.so.2" "$link_dir/libnccl.so"
export LIBRARY_PATH=$link_dir${LIBRARY_PATH:+:$LIBRARY_PATH}
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$CACHE/target-bundle}
# No debug info and stripped: the bundle must fit what travels with the working tree.
export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols
echo "nvcc: $(nvcc --version | tail -n 1); compute capability $CUDA_COMPUTE_CAP"

cargo build --locked --release --features cuda --bin gaccwb

rm -rf "$OUT"
mkdir -p "$OUT/tests"
cp "$CARGO_TARGET_DIR/release/gaccwb" "$OUT/gaccwb"
for entry in "${TESTS[@]}"; do
    t=${entry%%:*} features=${entry#*:}
    exe=$(cargo test --locked --release --features "$features" --no-run --message-format=json \
        --test "$t" | python3 -c '
import json, sys
name = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == name \
            and "test" in m["target"]["kind"] and m.get("executable"):
        print(m["executable"])
' "$t")
    [ -n "$exe" ] || { echo "gpu-bundle: no test binary for $t" >&2; exit 1; }
    cp "$exe" "$OUT/tests/$t"
done
strip "$OUT/gaccwb" "$OUT"/tests/*
xz -9 -T0 "$OUT/gaccwb" "$OUT"/tests/*

{
    echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
    echo "toolkit $(nvcc --version | tail -n 1)"
    echo "compute capability $CUDA_COMPUTE_CAP"
    echo "tests ${TESTS[*]} (test:features)"
} >"$OUT/manifest.txt"
(cd "$OUT" && find . -type f -name '*.xz' -exec ls -l {} + | awk '{print $5, $9}') >>"$OUT/manifest.txt"
cat "$OUT/manifest.txt"

size_kib=$(du -sk "$OUT" | cut -f1)
echo "bundle: $OUT, $((size_kib / 1024)) MiB (limit ${LIMIT_MIB} MiB)"
[ "$size_kib" -le $((LIMIT_MIB * 1024)) ] || {
    echo "gpu-bundle: the bundle is over ${LIMIT_MIB} MiB" >&2
    exit 1
}
