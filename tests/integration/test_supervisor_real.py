"""The supervisor against a real llama-server (and the fake one for faults),
on the real reactor."""

from __future__ import annotations

import os
import time

import treq
from twisted.internet import defer, reactor
from twisted.trial.unittest import TestCase

from rolemesh.backends.cpu import CpuBackend
from rolemesh.base import errors
from rolemesh.children.pidfiles import PidFiles
from rolemesh.children.state import FAILED, READY, STOPPED
from rolemesh.children.supervisor import DeviceSupervisor
from rolemesh.config.file import validate
from tests.integration.harness import (
    corrupt_model,
    pid_alive,
    require_llama_server,
    tiny_model,
    write_fake_llama_server_bin,
)


class RealSupervisorTests(TestCase):
    timeout = 60

    def setUp(self):
        self.binary = require_llama_server()
        self.dir = os.path.abspath(self.mktemp())
        self.models = {
            "a": tiny_model(self.dir, "a", 1),
            "b": tiny_model(self.dir, "b", 2),
        }

    def supervisor(self, models, binary=None, environ=None, **top):
        data = {
            "node_id": "t",
            "state_dir": os.path.join(self.dir, "state"),
            "llama_server_probe_interval_s": 0.05,
            "llama_server_startup_timeout_s": 20,
            "llama_server_stop_timeout_s": 1.0,
            "models": models,
            **top,
        }
        self.config = validate(data, check_files=False, environ={})
        backend = CpuBackend(reactor=reactor)
        device = backend.discover()[0]
        sup = DeviceSupervisor(device, backend, self.config, binary or self.binary, reactor=reactor,
                               pidfiles=PidFiles(data["state_dir"]), environ=environ)
        self.addCleanup(sup.stopService)
        return sup

    @defer.inlineCallbacks
    def models_listed(self, endpoint):
        response = yield treq.get(endpoint.base_url + "/v1/models", persistent=False)
        body = yield response.json()
        return [m["id"] for m in body["data"]]

    @defer.inlineCallbacks
    def test_cold_start_switch_and_stop(self):
        sup = self.supervisor([{"model_id": "a", "path": self.models["a"]},
                               {"model_id": "b", "path": self.models["b"], "alias": "bee"}])
        a, b = self.config.model("a"), self.config.model("b")
        started = time.monotonic()
        ea = yield sup.ensure(a)
        cold = time.monotonic() - started
        self.assertEqual(sup.state, READY)
        self.assertLess(cold, 15)
        self.assertEqual((yield self.models_listed(ea)), ["a"])
        eb = yield sup.ensure(b)
        self.assertNotEqual(ea.pid, eb.pid)
        self.assertFalse(pid_alive(ea.pid), "the old child was reaped before the switch finished")
        self.assertEqual((yield self.models_listed(eb)), ["bee"])
        ea2 = yield sup.ensure(a)
        self.assertNotIn(ea2.pid, (ea.pid, eb.pid))
        self.assertEqual((yield self.models_listed(ea2)), ["a"])
        yield sup.stop()
        self.assertEqual(sup.state, STOPPED)
        self.assertFalse(pid_alive(ea2.pid))
        self.assertEqual(os.listdir(os.path.join(self.dir, "state", "children")), [])

    @defer.inlineCallbacks
    def test_shared_load(self):
        sup = self.supervisor([{"model_id": "a", "path": self.models["a"]}])
        a = self.config.model("a")
        endpoints = yield defer.gatherResults([sup.ensure(a) for _ in range(4)])
        self.assertEqual(len({e.pid for e in endpoints}), 1)

    @defer.inlineCallbacks
    def test_corrupt_gguf_fails_fast_with_log_tail(self):
        path = corrupt_model(self.dir)
        sup = self.supervisor([{"model_id": "broken", "path": path}])
        started = time.monotonic()
        with self.assertRaises(errors.ApiError) as caught:
            yield sup.ensure(self.config.model("broken"))
        self.assertLess(time.monotonic() - started, 5, "did not wait for the startup timeout")
        error = caught.exception
        self.assertEqual(error.code, "model_load_failed")
        self.assertIn("failed to load model", error.message)
        self.assertNotIn(path, error.message)
        self.assertEqual(sup.state, FAILED)

    @defer.inlineCallbacks
    def test_missing_file_fails_fast(self):
        sup = self.supervisor([{"model_id": "gone", "path": os.path.join(self.dir, "gone.gguf")}])
        started = time.monotonic()
        with self.assertRaises(errors.ApiError) as caught:
            yield sup.ensure(self.config.model("gone"))
        self.assertEqual(caught.exception.code, "model_load_failed")
        self.assertLess(time.monotonic() - started, 5)

    @defer.inlineCallbacks
    def test_never_ready_hits_the_timeout(self):
        fake = write_fake_llama_server_bin(self.dir)
        sup = self.supervisor([{"model_id": "a", "path": self.models["a"]}], binary=fake,
                              environ={**os.environ, "FAKE_LLAMA": "never_ready"},
                              llama_server_startup_timeout_s=1.0)
        started = time.monotonic()
        with self.assertRaises(errors.ApiError) as caught:
            yield sup.ensure(self.config.model("a"))
        self.assertEqual(caught.exception.code, "model_load_timeout")
        self.assertGreaterEqual(time.monotonic() - started, 1.0)
        pid = sup.pid
        yield sup.stop()
        self.assertFalse(pid_alive(pid))

    @defer.inlineCallbacks
    def test_child_ignoring_sigterm_is_killed(self):
        fake = write_fake_llama_server_bin(self.dir)
        sup = self.supervisor([{"model_id": "a", "path": self.models["a"]}], binary=fake,
                              environ={**os.environ, "FAKE_LLAMA": "ignore_sigterm"})
        endpoint = yield sup.ensure(self.config.model("a"))
        started = time.monotonic()
        yield sup.stop()
        elapsed = time.monotonic() - started
        self.assertGreaterEqual(elapsed, 1.0, "SIGKILL came only after the grace")
        self.assertFalse(pid_alive(endpoint.pid))

    @defer.inlineCallbacks
    def test_crash_when_ready_then_next_ensure_restarts(self):
        sup = self.supervisor([{"model_id": "a", "path": self.models["a"]}])
        a = self.config.model("a")
        first = yield sup.ensure(a)
        ended = defer.Deferred()
        sup.subscribe(lambda s: s.state == STOPPED and not ended.called and ended.callback(None))
        os.kill(first.pid, 9)
        yield ended
        self.assertEqual(sup.restarts, 1)
        second = yield sup.ensure(a)
        self.assertNotEqual(first.pid, second.pid)
