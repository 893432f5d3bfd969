"""Two coding agents that work against llama-server directly work through
the node: Claude Code (``claude -p``, the Anthropic Messages API,
``POST /v1/messages?beta=true``) and Codex CLI (``codex exec`` with a custom
model provider, ``wire_api = "responses"``: ``POST /v1/responses``), each
the real npm release, run as a subprocess against the agent over the real
llama-server and a tiny model.

The packages are installed once per machine with npm into
``${XDG_CACHE_HOME:-~/.cache}/rolemesh/npm/<package>@<version>`` (pinned
below) and reused; without npm, or with the npm registry out of reach, the
tests are skipped. Each agent runs with a ``HOME`` (and ``CODEX_HOME``) of
its own in the test's folder, telemetry and update checks off, and a bound
timeout (in the runs measured, each sent its requests to the node only).

What they send (measured with these versions): Claude Code, without
``ANTHROPIC_MODEL``, a Claude model id (so the node needs
``unknown_models: default``), ``x-api-key``, ``anthropic-beta``, 12 tools,
``thinking``, ``context_management``, ``output_config``, ``metadata``,
``stream: true`` -- about 15,600 tokens of the tiny model's vocabulary;
Codex 9 tools (``function``, ``namespace``, ``web_search``), ``reasoning``,
``store: false``, ``include``, ``prompt_cache_key``, ``client_metadata``,
``Authorization: Bearer`` -- about 17,500 tokens. The chat template has no
tools, so llama-server renders the messages only.

About one Messages stream in three from this llama-server on the tiny model
begins without ``message_start`` (when its first token is an incomplete
UTF-8 sequence; the same directly as through the node). Claude Code then
asks again without streaming and succeeds; with
``CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK=1`` it would end "API Error:
Message not found", directly as through the node."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
from typing import Dict, List, Tuple

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from tests.fixtures.tiny_gguf import write_tiny_gguf
from tests.integration.harness import AgentProcess, require_llama_server, wait_until

CLAUDE_CODE = ("@anthropic-ai/claude-code", "2.1.332")
CODEX = ("@openai/codex", "0.171.0")
KEY = "sk-coding-agents-0123456789"
#: The agents' system prompts and tools are 15-18 thousand tokens of the tiny vocabulary.
CTX = 65536
#: A whole run of one agent: 1-35 s measured on 2 shared cores (the random model ends at its end token).
AGENT_TIMEOUT_S = 240
NPM_TIMEOUT_S = 600
#: Off: telemetry, error reports, update checks, the non-essential requests.
QUIET = {
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "NO_UPDATE_NOTIFIER": "1",
}


def npm_cache() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rolemesh", "npm")


def npm_package(package: str, version: str) -> str:
    """The folder ``package@version`` is installed in (``node_modules`` in
    it), installed the first time under a lock (trial's workers may ask at
    once) into a ``.partial`` folder that is renamed when whole."""
    target = os.path.join(npm_cache(), f"{package}@{version}")
    done = os.path.join(target, ".installed")
    if os.path.exists(done):
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise SkipTest(f"npm is not on PATH: the coding-agent tests install {package}@{version} with npm "
                       "(Node.js 20 or newer)")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    env = {**os.environ, "npm_config_update_notifier": "false", "npm_config_fund": "false",
           "npm_config_audit": "false"}
    with open(f"{target}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if os.path.exists(done):
            return target
        try:
            seen = subprocess.run([npm, "view", f"{package}@{version}", "version"], capture_output=True,
                                  text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise SkipTest(f"the npm registry did not answer for {package}@{version} within 120 s") from None
        if seen.returncode != 0 or seen.stdout.strip() != version:
            said = " ".join((seen.stderr or seen.stdout).splitlines()[:3])
            raise SkipTest(f"the npm registry is not reachable or has no {package}@{version} "
                           f"(`npm view` exit {seen.returncode}): {said}")
        partial = target + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)  # a copy without its mark is not whole
        os.makedirs(partial)
        installed = subprocess.run([npm, "install", "--prefix", partial, "--no-audit", "--no-fund",
                                    "--loglevel=error", f"{package}@{version}"], capture_output=True, text=True,
                                   timeout=NPM_TIMEOUT_S, env=env, stdin=subprocess.DEVNULL)
        if installed.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            raise AssertionError(f"npm install {package}@{version} failed ({installed.returncode}), "
                                 f"though the registry has it:\n{installed.stderr[-3000:]}")
        os.rename(partial, target)
        with open(done, "w", encoding="utf-8") as f:
            f.write(f"{package}@{version}\n")
    return target


def claude_binary() -> str:
    """Claude Code's native executable: ``bin/claude.exe`` once its postinstall
    copied the platform package's binary over the placeholder, else that
    binary itself (an npm that runs no install scripts)."""
    root = os.path.join(npm_package(*CLAUDE_CODE), "node_modules", "@anthropic-ai")
    placeholder = os.path.join(root, "claude-code", "bin", "claude.exe")
    with open(placeholder, "rb") as f:
        if f.read(4) == b"\x7fELF":
            return placeholder
    for name in sorted(os.listdir(root)):
        native = os.path.join(root, name, "claude")
        if name.startswith("claude-code-") and os.access(native, os.X_OK):
            return native
    raise AssertionError(f"no native claude binary for this platform under {root}: {sorted(os.listdir(root))}")


def codex_binary() -> str:
    """Codex's launcher, a Node.js script that runs the platform's native binary."""
    if shutil.which("node") is None:
        raise SkipTest(f"node is not on PATH: {CODEX[0]}'s launcher is a Node.js script (Node.js 20 or newer)")
    return os.path.join(npm_package(*CODEX), "node_modules", ".bin", "codex")


def run_bounded(argv: List[str], cwd: str, env: Dict[str, str]) -> Tuple[int, str, str]:
    """Run an agent in a session of its own; past ``AGENT_TIMEOUT_S`` the
    whole session is killed (Codex's launcher runs the native binary as a
    child)."""
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    try:
        out, err = process.communicate(timeout=AGENT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        raise AssertionError(f"{argv[0]} did not finish within {AGENT_TIMEOUT_S}s\nstdout: {out[-2000:]}\n"
                             f"stderr: {err[-2000:]}") from None
    return process.returncode, out, err


class CodingAgentsRealTests(SynchronousTestCase):
    def setUp(self) -> None:
        require_llama_server()
        self.directory = os.path.abspath(self.mktemp())
        os.makedirs(self.directory)
        path = write_tiny_gguf(os.path.join(self.directory, "tiny.gguf"), seed=11, n_ctx=CTX)
        self.agent = AgentProcess(self.directory, {
            "api_keys": [KEY],
            "models": [{"model_id": "tiny", "path": path, "ctx_size": CTX, "server_args": {"jinja": True}}],
            "default_model": "tiny",
            "unknown_models": "default",
        })
        self.addCleanup(self.agent.stop)
        self.home = os.path.join(self.directory, "home")
        self.work = os.path.join(self.directory, "work")  # no git repository, no CLAUDE.md or AGENTS.md
        os.makedirs(self.home)
        os.makedirs(self.work)

    def env(self, **extra: str) -> Dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": self.home, "TERM": "dumb",
                "LANG": "C.UTF-8", **QUIET, **extra}

    def assert_logged(self, pattern: str, what: str) -> None:
        """The node logs a request when its answer has ended, which may be
        a moment after the client has read what it needed."""
        wait_until(lambda: re.search(pattern, self.agent.log_text()) is not None, 30, what=what)

    def report(self, rc: int, out: str, err: str) -> str:
        return f"exit {rc}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}\nnode log:\n{self.agent.log_text()[-3000:]}"

    def test_claude_code_print_mode_with_its_own_model_id(self) -> None:
        binary = claude_binary()
        rc, out, err = run_bounded([binary, "-p", "say hi", "--max-turns", "1"], self.work, self.env(
            ANTHROPIC_BASE_URL=self.agent.url, ANTHROPIC_API_KEY=KEY))
        self.assertEqual(rc, 0, self.report(rc, out, err))
        self.assert_logged(r"POST /v1/messages tiny -> 200 on cpu:0", "Claude Code's POST /v1/messages -> 200")
        log = self.agent.log_text()
        # No ANTHROPIC_MODEL: Claude Code names a Claude model, served by default_model.
        self.assertRegex(log, r"model 'claude-[^']+' is not served here: its requests go to default_model tiny")
        self.assertNotRegex(log, r"POST /v1/messages\S* \S+ -> 5\d\d")

    def test_codex_exec_with_a_responses_provider(self) -> None:
        binary = codex_binary()
        codex_home = os.path.join(self.home, "codex")
        os.makedirs(codex_home)
        with open(os.path.join(codex_home, "config.toml"), "w", encoding="utf-8") as f:
            f.write(
                'model = "tiny"\n'
                'model_provider = "rolemesh"\n'
                "check_for_update_on_startup = false\n"
                "\n"
                "[model_providers.rolemesh]\n"
                'name = "RoleMesh"\n'
                f'base_url = "{self.agent.url}/v1"\n'
                'env_key = "ROLEMESH_API_KEY"\n'
                'wire_api = "responses"\n'
                "\n"
                "[analytics]\n"
                "enabled = false\n"
            )
        rc, out, err = run_bounded([binary, "exec", "--skip-git-repo-check", "say hi"], self.work, self.env(
            CODEX_HOME=codex_home, ROLEMESH_API_KEY=KEY))
        self.assertEqual(rc, 0, self.report(rc, out, err))
        self.assert_logged(r"POST /v1/responses tiny -> 200 on cpu:0", "Codex's POST /v1/responses -> 200")
        self.assertNotRegex(self.agent.log_text(), r"POST /v1/responses \S+ -> 5\d\d")
