"""Telemetry end to end: the agent as a process with a real llama-server child
(``parallel: 4``), four real streams, the fake dispatcher over real HTTP.

While the four streams run, ``/metrics``, the inventory and the next heartbeat
all say 4 busy slots of 4 on the device and tokens/s above 0; once the streams
end, 0 busy.  The same real scrape passes ``promtool check metrics``, and the
shipped dashboard and alert rules name only series it contains."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from typing import Any, Dict, List, Optional

import jsonschema
from prometheus_client.parser import text_string_to_metric_families
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.children.telemetry import load_progress
from rolemesh.schemas import load_schema
from tests.children.test_telemetry import NO_PROMTOOL, alert_exprs, dashboard_exprs, exported_series, series_in
from tests.fixtures.llama import free_port
from tests.fixtures.tiny_gguf import write_tiny_gguf
from tests.integration.fake_dispatcher_server import FakeDispatcherProcess
from tests.integration.harness import AgentProcess, Stream, require_llama_server, wait_until

DEVICE = "cpu:0"
MODEL = "tiny-p"
SLOTS = 4
#: Long enough that four streams outlast a telemetry sample (every 5 s) and a
#: heartbeat on a busy 2-core machine; the test ends them itself once checked.
STREAM = {"model": MODEL, "prompt": "hello", "max_tokens": 8000, "ignore_eos": True, "stream": True}


class TelemetryRealTests(SynchronousTestCase):
    def setUp(self) -> None:
        require_llama_server()
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        # Bigger than the default tiny model and with a long context, so a
        # stream lasts seconds, not milliseconds.
        self.model = write_tiny_gguf(os.path.join(self.dir, "p.gguf"), seed=3, n_embd=512, n_layer=4, n_head=8,
                                     n_ff=1024, n_ctx=8192, name="p")
        self.fake = FakeDispatcherProcess(free_port(), log_path=os.path.join(self.dir, "dispatcher.log"))
        self.addCleanup(self.fake.stop)
        self.agent = AgentProcess(self.dir, {
            "heartbeat_interval_s": 0.5,
            "full_heartbeat_interval_s": 0.5,
            "dispatcher_base_url": f"http://127.0.0.1:{self.fake.port}",
            "max_pending_requests_per_device": 8,
            "shutdown_grace_s": 5,
            "models": [{"model_id": MODEL, "path": self.model, "ctx_size": SLOTS * 8192,
                        "server_args": {"parallel": SLOTS}}],
        })
        self.addCleanup(self.agent.stop)

    # -- reading the three views ------------------------------------------------

    def scrape(self) -> str:
        status, _, body = self.agent.request("GET", "/metrics")
        self.assertEqual(status, 200, body)
        return body.decode("utf-8")

    def gauge(self, text: str, name: str) -> Optional[float]:
        found = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == name and s.labels == {"device": DEVICE, "model": MODEL}]
        return found[0] if found else None

    def device(self) -> Dict[str, Any]:
        (device,) = [d for d in self.agent.inventory()["devices"] if d["device"] == DEVICE]
        return device

    def next_heartbeat(self) -> Dict[str, Any]:
        """The first heartbeat the dispatcher receives after now."""
        after = time.time()
        beats: List[Any] = []

        def arrived() -> bool:
            beats[:] = [r for r in self.fake.received("heartbeat") if r["at"] > after]
            return bool(beats)

        wait_until(arrived, 15, interval=0.05, what="a heartbeat")
        body = beats[0]["body"]
        jsonschema.validate(body, load_schema("heartbeat"))
        self.assertEqual((body["schema_version"], "last_seq" in body), (3, True))  # this dispatcher takes events
        (device,) = [d for d in body["devices"] if d["device"] == DEVICE]
        return device

    # -- the test ---------------------------------------------------------------

    def test_four_streams_fill_four_slots_then_free_them(self) -> None:
        status, _, body = self.agent.request("POST", "/v1/completions",
                                             {"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
        self.assertEqual(status, 200, body)  # loaded: the streams start together
        self.check_load_steps_of_this_build()

        streams = [Stream(self.agent.port, STREAM) for _ in range(SLOTS)]
        for stream in streams:
            self.addCleanup(stream.stop)
            stream.start()
        for stream in streams:
            self.assertTrue(stream.first.wait(60), "no first event")
            self.assertIsNone(stream.error)
            self.assertEqual(stream.status, 200)

        # /metrics: the next telemetry sample (every 5 s) sees four busy slots.
        scraped: List[str] = []

        def four_busy() -> bool:
            scraped[:] = [self.scrape()]
            return (self.gauge(scraped[0], "rolemesh_device_slots_busy") == SLOTS
                    and (self.gauge(scraped[0], "rolemesh_device_tokens_per_second") or 0) > 0)

        wait_until(four_busy, 30, interval=0.2, what="/metrics showing 4 busy slots and tokens/s")
        self.assertTrue(all(s.is_alive() for s in streams), "a stream ended before the checks")
        text = scraped[0]
        self.assertEqual(self.gauge(text, "rolemesh_device_slots"), SLOTS)
        self.assertEqual(self.gauge(text, "rolemesh_llamacpp_requests_processing"), SLOTS)
        self.assertEqual(self.gauge(text, "rolemesh_device_telemetry_stale"), 0)
        self.assertNotIn("llamacpp:", text)

        device = self.device()
        self.assertEqual((device["slots"]["total"], device["slots"]["busy"], device["slots"]["free"]),
                         (SLOTS, SLOTS, 0))
        self.assertGreater(device["throughput"]["tokens_per_s"], 0)
        self.assertEqual((device["in_flight"], device["slots_busy"]), (SLOTS, SLOTS))

        beat = self.next_heartbeat()
        self.assertEqual((beat["slots_total"], beat["slots_busy"], beat["slots_free"]), (SLOTS, SLOTS, 0))
        self.assertGreater(beat["tokens_per_s"], 0)
        self.assertEqual((beat["queue_depth"], beat["issues"]), (0, []))
        self.assertTrue(all(s.is_alive() for s in streams), "a stream ended before the heartbeat")

        self.check_scrape_with_promtool(text)
        self.check_deploy_files(text)

        # Hang up: the agent closes its upstream requests, llama-server frees the slots.
        for stream in streams:
            stream.stop()
        for stream in streams:
            stream.join(60)
            self.assertFalse(stream.is_alive())

        wait_until(lambda: self.gauge(self.scrape(), "rolemesh_device_slots_busy") == 0, 30, interval=0.2,
                   what="/metrics showing 0 busy slots")
        device = self.device()
        self.assertEqual((device["slots"]["busy"], device["slots"]["free"], device["in_flight"]), (0, SLOTS, 0))
        beat = self.next_heartbeat()
        self.assertEqual((beat["slots_busy"], beat["slots_free"], beat["in_flight"]), (0, SLOTS, 0))

    def check_load_steps_of_this_build(self) -> None:
        """The load-progress patterns match what this llama-server prints."""
        status, _, raw = self.agent.request("GET", f"/v1/node/devices/{DEVICE}/logs?tail=1000")
        self.assertEqual(status, 200, raw)
        progress = load_progress(json.loads(raw)["lines"], MODEL, 0.0)
        self.assertEqual(progress.step, "loaded")
        self.assertGreaterEqual(progress.steps_done, 4, progress)

    def check_scrape_with_promtool(self, text: str) -> None:
        promtool = shutil.which("promtool")
        if promtool is None:
            print(f"\n  skipped: promtool check metrics ({NO_PROMTOOL})")
            return
        result = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True,
                                timeout=60)
        self.assertEqual(result.returncode, 0, (result.stdout + result.stderr).decode())

    def check_deploy_files(self, text: str) -> None:
        exported = exported_series(text)
        for expr in dashboard_exprs() + alert_exprs():
            self.assertEqual(series_in(expr) - exported, set(), expr)
