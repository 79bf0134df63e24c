#!/usr/bin/env bash
# Build the llama.cpp peer (its kimi-k3 model) outside the repository, CPU only.
#
# The source is the llama.cpp tree vendored in the llama-cpp-python 0.3.36 source distribution on
# PyPI. Only what the benchmarks and the parity test need is built: the shared libllama (driven from
# Python through the sdist's own ctypes bindings), llama-completion / llama-cli, llama-perplexity,
# llama-server, llama-bench, llama-quantize and llama-tokenize. Tests, examples and the web UI are off.
#
# Output: ${K3_PEERS:-~/.cache/k3/peers}/llama.cpp-0.3.36/{bin,lib,src,READY}. A finished build is
# reused (a missing tool is built incrementally); delete the folder to rebuild from scratch. First
# build: 5-25 minutes on 2 cores.
set -euo pipefail

VERSION=0.3.36
ROOT="${K3_PEERS:-$HOME/.cache/k3/peers}"
DEST="$ROOT/llama.cpp-$VERSION"
JOBS="${JOBS:-$(nproc)}"

TARGETS=(llama llama-completion llama-cli llama-perplexity llama-server llama-bench llama-quantize llama-tokenize)
have_all() {
    [[ -f "$DEST/READY" ]] || return 1
    for t in "${TARGETS[@]:1}"; do [[ -x "$DEST/bin/$t" ]] || return 1; done
}
if have_all; then
    echo "llama.cpp peer present: $DEST"
    exit 0
fi

mkdir -p "$ROOT"
SDIST="$ROOT/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    echo "downloading llama-cpp-python==$VERSION (source distribution)"
    python -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$ROOT"
fi

SRC="$DEST/src"
if [[ ! -d "$SRC/vendor/llama.cpp" ]]; then
    rm -rf "$SRC"
    mkdir -p "$DEST"
    tar xzf "$SDIST" -C "$DEST"
    mv "$DEST/llama_cpp_python-$VERSION" "$SRC"
fi

LLAMA="$SRC/vendor/llama.cpp"
BUILD="$DEST/build"

# -march=native turns on AMX wherever the CPU advertises it, but some hypervisors advertise AMX without
# enabling its register state, and then ggml's Q8_0 products die on the first tile instruction. Run one
# tile instruction first; if it faults, build without AMX (the rest of -march=native stays).
EXTRA_FLAGS=""
PROBE="$DEST/amx_probe"
mkdir -p "$DEST"
cat >"$PROBE.c" <<'C'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char cfg[64];
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 2;
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1;              /* palette 1 */
    cfg[16] = 64;            /* tile 0: 64 bytes per row */
    cfg[48] = 16;            /* tile 0: 16 rows */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
C
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    # the probe runs in a subshell so that its SIGILL is reported by its exit code alone
    if ! { cc -O1 -mamx-tile -o "$PROBE" "$PROBE.c" 2>/dev/null && (bash -c "'$PROBE'" 2>/dev/null); }; then
        echo "AMX is advertised but not usable here: building without AMX"
        EXTRA_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    fi
fi
echo "configuring llama.cpp in $BUILD"
cmake -S "$LLAMA" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DCMAKE_C_FLAGS="$EXTRA_FLAGS" -DCMAKE_CXX_FLAGS="$EXTRA_FLAGS" \
    -DLLAMA_BUILD_NUMBER=0 >"$DEST/configure.log" 2>&1 || { tail -30 "$DEST/configure.log"; exit 1; }

echo "building ${TARGETS[*]} with $JOBS jobs (log: $DEST/build.log)"
start=$(date +%s)
cmake --build "$BUILD" --config Release -j "$JOBS" --target "${TARGETS[@]}" >"$DEST/build.log" 2>&1 \
    || { tail -40 "$DEST/build.log"; exit 1; }

mkdir -p "$DEST/bin" "$DEST/lib"
for t in "${TARGETS[@]:1}"; do cp "$BUILD/bin/$t" "$DEST/bin/"; done
find "$BUILD" -name '*.so*' -exec cp -P {} "$DEST/lib/" \;
echo "$(( $(date +%s) - start )) s" >"$DEST/build_seconds"
"$DEST/bin/llama-completion" --version 2>&1 | grep -m1 '^version' >"$DEST/version.txt" || true
echo "$VERSION" >"$DEST/READY"
echo "llama.cpp peer built in $(cat "$DEST/build_seconds"): $DEST"
