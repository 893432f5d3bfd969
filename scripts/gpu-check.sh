#!/usr/bin/env bash
# Check the agent's cuda backend on a host with an NVIDIA GPU, and keep what it saw.
#
#   scripts/gpu-check.sh OUTDIR [LLAMA_SERVER] [--bench]
#
# LLAMA_SERVER is a llama-server built with CUDA (ROLEMESH_LLAMA_CMAKE_ARGS=-DGGML_CUDA=ON
# scripts/install-llama-server.sh; default: $ROLEMESH_TEST_LLAMA_SERVER, else the installed one).
# Run it from an environment with the agent and its test extras installed (PYTHON=... to pick
# the interpreter).  It writes, into OUTDIR:
#
#   nvidia-smi.txt          plain nvidia-smi
#   nvidia_smi_query.csv    the agent's nvidia-smi query, nvidia -L, and NVML's answers
#   nvidia_smi_list.txt     (tests/fixtures/record_nvidia.py: fixtures for the unit tests)
#   nvml.json
#   list-devices.txt        the build's version and --list-devices, unpinned and pinned to GPU 0
#   check.txt               rolemesh-node-agent --check with `backend: auto` and a generated model
#   trial.log               tests.integration.test_cuda_real (the exit status is trial's)
#   capacity.txt            with --bench: bench/capacity.py (three runs, medians) on this GPU
set -u
out=${1:?usage: scripts/gpu-check.sh OUTDIR [LLAMA_SERVER] [--bench]}
shift
bench=0
for arg in "$@"; do
    case $arg in
        --bench) bench=1 ;;
        *) export ROLEMESH_TEST_LLAMA_SERVER=$arg ;;
    esac
done
py=${PYTHON:-python3}
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$out"
out=$(cd "$out" && pwd)
say() { printf '== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

say "nvidia-smi"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
say "recording nvidia-smi and NVML"
"$py" -m tests.fixtures.record_nvidia "$out" > "$out/record.log" 2>&1 || say "recording failed: see record.log"

bin=${ROLEMESH_TEST_LLAMA_SERVER:-$("$py" -c 'from rolemesh.children.llama_build import bundled_binary; print(bundled_binary() or "")')}
say "llama-server: ${bin:-none}"
if [ -n "$bin" ]; then
    {
        "$bin" --version
        echo "# --list-devices"
        "$bin" --list-devices
        echo "# CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0 --list-devices"
        CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0 "$bin" --list-devices
    } > "$out/list-devices.txt" 2>&1
fi

say "rolemesh-node-agent --check"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m tests.fixtures.tiny_gguf "$work/tiny.gguf" > /dev/null
cat > "$work/agent.yaml" <<EOF
node_id: gpu-check
backend: auto
state_dir: $work/state
${bin:+llama_server_bin: $bin}
models:
  - model_id: tiny
    path: $work/tiny.gguf
EOF
"$py" -m rolemesh.cli --check --config "$work/agent.yaml" > "$out/check.txt" 2>&1

say "tests.integration.test_cuda_real"
"$py" -m twisted.trial --temp-directory "$work/_trial_temp" tests.integration.test_cuda_real > "$out/trial.log" 2>&1
status=$?
tail -n 3 "$out/trial.log"

if [ "$bench" = 1 ] && [ -n "$bin" ]; then
    say "bench/capacity.py (three runs)"
    "$py" bench/capacity.py --runs 3 --requests 200 --streams 10 --seconds 3 --no-nginx \
        --llama-server "$bin" > "$out/capacity.txt" 2>&1 || say "capacity bench failed: see capacity.txt"
fi
say "done: trial exit status $status"
exit $status
