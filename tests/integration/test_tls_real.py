"""TLS end to end: the agent as a process serving HTTPS, real clients, a real
HTTPS fake dispatcher.

Certificates come from :class:`tests.config.test_tls.Pki` (generated per test with
``cryptography``; no key is committed).  The model child is the fake
llama-server except in the ``openai``-with-a-real-model test, which needs a
real llama-server and a tiny generated GGUF.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import ssl
from typing import Any, Dict, Optional, Tuple

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.config.test_tls import Pki
from tests.fixtures.llama import free_port, http_request
from tests.integration.fake_dispatcher_server import FakeDispatcherProcess
from tests.integration.harness import (
    AgentProcess,
    require_llama_server,
    tiny_model,
    wait_until,
    write_fake_llama_server_bin,
)

API_KEY = "tls-test-key"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def client_context(ca_file: str, cert: Optional[Tuple[str, str]] = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_file)
    if cert is not None:
        context.load_cert_chain(*cert)
    return context


def https_request(port: int, method: str, path: str, context: ssl.SSLContext, body: Any = None,
                  host: str = "localhost", timeout: float = 10) -> Tuple[int, bytes]:
    conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=context)
    try:
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class TLSAgentProcess(AgentProcess):
    """AgentProcess whose readiness check and requests speak HTTPS."""

    def __init__(self, directory: str, config: Dict[str, Any], context: ssl.SSLContext,
                 env: Optional[Dict[str, str]] = None) -> None:
        self.context = context
        super().__init__(directory, config, env=env)
        self.url = f"https://localhost:{self.port}"

    def _healthy(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"agent exited with {self.process.returncode}:\n" + self.log_text()[-3000:])
        try:
            return https_request(self.port, "GET", "/health", self.context, timeout=1)[0] == 200
        except (OSError, http.client.HTTPException):
            return False

    def https(self, method: str, path: str, body: Any = None, context: Optional[ssl.SSLContext] = None
              ) -> Tuple[int, bytes]:
        return https_request(self.port, method, path, context or self.context, body)


class TLSAgentCase(SynchronousTestCase):
    """An agent with a certificate from a test CA (no tests of its own)."""

    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        self.pki = Pki(os.path.join(self.dir, "pki"))
        self.cert, self.key = self.pki.issue("node")

    def fake_config(self, **top: Any) -> Dict[str, Any]:
        model = os.path.join(self.dir, "m.gguf")
        open(model, "wb").close()
        return {"llama_server_bin": write_fake_llama_server_bin(self.dir), "api_key": API_KEY,
                "tls_cert_file": self.cert, "tls_key_file": self.key,
                "models": [{"model_id": "m", "path": model}], **top}

    def start(self, config: Dict[str, Any], context: Optional[ssl.SSLContext] = None) -> TLSAgentProcess:
        agent = TLSAgentProcess(self.dir, config, context or client_context(self.pki.ca_file))
        self.addCleanup(agent.stop)
        return agent

    def openai_client(self, agent: AgentProcess, context: ssl.SSLContext) -> openai.OpenAI:
        http_client = openai.DefaultHttpxClient(verify=context)  # the CA bundle (and client certificate)
        self.addCleanup(http_client.close)
        return openai.OpenAI(base_url=f"https://localhost:{agent.port}/v1", api_key=API_KEY,
                             http_client=http_client, max_retries=0, timeout=60)



class TLSAgentTests(TLSAgentCase):
    def test_openai_client_with_a_ca_bundle_on_a_real_model(self) -> None:
        require_llama_server()
        model = tiny_model(self.dir, "tls", 7)
        agent = self.start({"api_key": API_KEY, "tls_cert_file": self.cert, "tls_key_file": self.key,
                            "models": [{"model_id": "m", "path": model}]})
        client = self.openai_client(agent, client_context(self.pki.ca_file))
        answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4)
        self.assertEqual(answer.model, "m")
        self.assertEqual(len(answer.choices), 1)
        self.assertEqual([m.id for m in client.models.list().data], ["m"])

    def test_https_serves_and_plain_http_to_the_tls_port_fails_cleanly(self) -> None:
        agent = self.start(self.fake_config())
        self.assertIn("serving the OpenAI-compatible API on https://", agent.log_text())
        self.assertIn("TLS certificate: CN=node [localhost, 127.0.0.1]", agent.log_text())
        status, body = agent.https("POST", "/v1/chat/completions", CHAT)
        self.assertEqual(status, 200, body)

        # A plain HTTP client gets a 400 that says what is wrong, then the
        # connection is closed: no hang, no TLS alert to puzzle over.
        with socket.create_connection(("127.0.0.1", agent.port), timeout=10) as raw:
            raw.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            received = b""
            while True:
                chunk = raw.recv(4096)
                if not chunk:
                    break
                received += chunk
        self.assertTrue(received.startswith(b"HTTP/1.1 400 Bad Request\r\n"), received)
        status, _, body = http_request("POST", f"http://127.0.0.1:{agent.port}/v1/chat/completions", CHAT)
        self.assertEqual(status, 400)
        self.assertEqual(json.loads(body)["error"]["code"], "https_required")

        # The agent is unharmed, and said nothing alarming.
        self.assertEqual(agent.https("GET", "/health")[0], 200)
        self.assertNotIn("Traceback", agent.log_text())
        self.assertIsNone(agent.process.poll())

    def test_mutual_tls_refuses_a_wrong_client_certificate(self) -> None:
        dispatcher_cert = self.pki.issue("dispatcher", hosts=(), client=True)
        stranger = Pki(os.path.join(self.dir, "other"), name="Other CA")
        wrong_cert = stranger.issue("intruder", hosts=(), client=True)
        good = client_context(self.pki.ca_file, dispatcher_cert)
        agent = self.start(self.fake_config(tls_client_ca_file=self.pki.ca_file), context=good)

        client = self.openai_client(agent, good)
        self.assertEqual(client.chat.completions.create(**CHAT).choices[0].finish_reason in ("length", "stop"), True)

        for name, context in (("wrong CA", client_context(self.pki.ca_file, wrong_cert)),
                              ("no certificate", client_context(self.pki.ca_file))):
            with self.assertRaises((ssl.SSLError, ConnectionError, http.client.HTTPException), msg=name):
                agent.https("GET", "/v1/models", context=context)
        self.assertEqual(agent.https("GET", "/v1/models")[0], 200)
        self.assertNotIn("Traceback", agent.log_text())


class TLSDispatcherTests(SynchronousTestCase):
    """The agent's dispatcher client over HTTPS against the fake dispatcher."""

    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.pki = Pki(os.path.join(self.dir, "pki"), name="Dispatcher CA")
        cert, key = self.pki.issue("dispatcher", hosts=("localhost",))
        self.fake = FakeDispatcherProcess(free_port(), log_path=os.path.join(self.dir, "dispatcher.log"),
                                          tls=(cert, key, self.pki.ca_file))
        self.addCleanup(self.fake.stop)
        self.url = f"https://localhost:{self.fake.port}"

    def agent(self, name: str, **top: Any) -> AgentProcess:
        directory = os.path.join(self.dir, name)
        os.makedirs(directory)
        model = os.path.join(directory, "m.gguf")
        open(model, "wb").close()
        agent = AgentProcess(directory, {
            "node_id": name, "llama_server_bin": write_fake_llama_server_bin(directory),
            "models": [{"model_id": "m", "path": model}], "heartbeat_interval_s": 0.5, "full_heartbeat_interval_s": 0.5,
            "dispatcher_base_url": self.url, **top})
        self.addCleanup(agent.stop)
        return agent

    def test_unverifiable_dispatcher_is_refused_in_one_log_line_and_local_serving_goes_on(self) -> None:
        stranger = Pki(os.path.join(self.dir, "other"), name="Other CA")
        agent = self.agent("distrustful", dispatcher_ca_file=stranger.ca_file)
        line = "the dispatcher's certificate could not be verified (certificate verify failed)"
        wait_until(lambda: line in agent.log_text(), 15, interval=0.05, what="the TLS failure in the log")

        status, _, body = agent.request("POST", "/v1/chat/completions", CHAT, timeout=30)
        self.assertEqual(status, 200, body)
        lines = [x for x in agent.log_text().splitlines() if line in x]
        self.assertEqual(len(lines), 1, lines)
        self.assertIn("local serving continues", lines[0])
        self.assertIn("set dispatcher_ca_file to the CA that signed it", lines[0])
        self.assertEqual(self.fake.received("register"), [])  # nothing was sent to an unverified peer
        self.assertNotIn("Traceback", agent.log_text())

    def test_system_store_does_not_trust_a_private_ca(self) -> None:
        agent = self.agent("default-trust")
        wait_until(lambda: "could not be verified" in agent.log_text(), 15, interval=0.05,
                   what="the TLS failure in the log")
        self.assertEqual(self.fake.received("register"), [])

    def test_dispatcher_ca_file_verifies_and_registers(self) -> None:
        agent = self.agent("trusting", dispatcher_ca_file=self.pki.ca_file)
        wait_until(lambda: len(self.fake.received("heartbeat")) >= 1, 15, interval=0.05,
                   what="a heartbeat over HTTPS")
        self.assertEqual(self.fake.received("register")[0]["body"]["node_id"], "trusting")
        self.assertEqual(agent.stop(), 0)
        wait_until(lambda: len(self.fake.received("deregister")) == 1, 5, what="deregistration over HTTPS")
        log = agent.log_text()
        self.assertNotIn("could not be verified", log)
        self.assertNotIn("plain http://", log)
        self.assertNotIn("Traceback", log)  # HTTPS connections are closed before the reactor stops


class CertificateRotationTests(TLSAgentCase):
    def test_sighup_rotates_the_certificate_for_new_connections(self) -> None:
        agent = self.start(self.fake_config())
        self.assertEqual(agent.https("GET", "/health")[0], 200)
        # The files are replaced in place, by a certificate of another CA.
        other = Pki(os.path.join(self.dir, "pki2"), name="RoleMesh Rotated CA")
        cert, key = other.issue("node")
        os.replace(cert, self.cert)
        os.replace(key, self.key)
        agent.process.send_signal(signal.SIGHUP)
        wait_until(lambda: "certificate reloaded" in agent.log_text() or "listener TLS" in agent.log_text(), 10,
                   what="the reload logged")

        def new_certificate_served() -> bool:
            try:
                return https_request(agent.port, "GET", "/health", client_context(other.ca_file), timeout=2)[0] == 200
            except (OSError, http.client.HTTPException):
                return False

        wait_until(new_certificate_served, 10, what="the rotated certificate served")
        with self.assertRaises(ssl.SSLError):
            https_request(agent.port, "GET", "/health", client_context(self.pki.ca_file), timeout=2)
