"""Node events end to end: ``GET /v1/node/events`` on an agent with a real
llama-server child, and the deltas (``POST /v1/nodes/events``) a real agent
sends to the fake dispatcher served over real HTTP by a process of its own."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from typing import Any, Dict, List, Optional

from twisted.trial.unittest import SynchronousTestCase

from tests.fixtures.llama import free_port
from tests.integration.fake_dispatcher_server import FakeDispatcherProcess
from tests.integration.harness import (
    AgentProcess,
    require_llama_server,
    tiny_model,
    wait_until,
    write_fake_llama_server_bin,
)

KEY = "events-key"
NODE_ID = "it-node"
CHAT = {"model": "tiny-a", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


class EventReader(threading.Thread):
    """Reads ``GET /v1/node/events`` and keeps each ``data:`` line's JSON."""

    def __init__(self, port: int, key: str) -> None:
        super().__init__(daemon=True)
        self.port, self.key = port, key
        self.events: List[Dict[str, Any]] = []
        self.status: Any = None
        self.content_type: Any = None
        self.connected = threading.Event()
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def run(self) -> None:
        try:
            self.conn.request("GET", "/v1/node/events", headers={"Authorization": f"Bearer {self.key}"})
            response = self.conn.getresponse()
            self.status, self.content_type = response.status, response.getheader("content-type")
            self.connected.set()
            while True:
                line = response.readline()
                if not line:
                    return
                if line.startswith(b"data: "):
                    self.events.append(json.loads(line[len(b"data: "):]))
        except (OSError, AttributeError, ValueError):  # closed under it by close()
            return
        finally:
            self.connected.set()

    def close(self) -> None:
        try:
            if self.conn.sock is not None:
                self.conn.sock.shutdown(2)
        except OSError:
            pass
        self.conn.close()


class EventsStreamRealTests(SynchronousTestCase):
    def test_a_client_sees_load_ready_unloaded_in_order(self) -> None:
        require_llama_server()
        directory = os.path.abspath(self.mktemp())
        model = tiny_model(directory, "a", 1)
        agent = AgentProcess(directory, {
            "api_keys": [KEY],
            # The stream outlives the listener's idle timeout: a response being written is not idle.
            "idle_timeout_s": 1,
            "models": [{"model_id": "tiny-a", "path": model, "roles": ["chat"], "idle_unload_s": 2}],
        })
        self.addCleanup(agent.stop)
        reader = EventReader(agent.port, KEY)
        reader.start()
        self.addCleanup(reader.close)
        self.assertTrue(reader.connected.wait(10))
        self.assertEqual((reader.status, reader.content_type), (200, "text/event-stream; charset=utf-8"))

        status, _, body = agent.request("POST", "/v1/chat/completions", CHAT, timeout=60,
                                        headers={"Authorization": f"Bearer {KEY}"})
        self.assertEqual(status, 200, body)

        def unloaded() -> bool:
            return any(e["type"] == "unloaded" for e in reader.events)

        wait_until(unloaded, 20, interval=0.05, what="an unloaded event")
        mine = [e for e in reader.events if e["model"] == "tiny-a" and e["device"] == "cpu:0"]
        order = [e["type"] for e in mine if e["type"] in ("load_started", "ready", "unloaded")]
        self.assertEqual(order, ["load_started", "ready", "unloaded"], mine)
        for event in mine:
            self.assertEqual({"type", "time", "device", "model"} - set(event), set())
        times = [e["time"] for e in mine]
        self.assertEqual(times, sorted(times))
        self.assertLess(abs(times[-1] - time.time()), 30)  # POSIX seconds


class DeltasRealTests(SynchronousTestCase):
    """A real agent reporting to the real-HTTP fake dispatcher."""

    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.fake = FakeDispatcherProcess(free_port(), log_path=os.path.join(self.dir, "dispatcher.log"))
        self.addCleanup(self.fake.stop)

    def start_agent(self, env: Optional[Dict[str, str]] = None, **top: Any) -> AgentProcess:
        agent = AgentProcess(self.dir, {
            "node_id": NODE_ID,
            "dispatcher_base_url": self.fake.url,
            "shutdown_grace_s": 5,
            **top,
        }, env=env)
        self.addCleanup(agent.stop)
        return agent

    def deltas(self, after: float = 0.0) -> List[Dict[str, Any]]:
        return [r for r in self.fake.received("events") if r["body"]["events"] and r["at"] > after]

    def view(self) -> Dict[str, Any]:
        return self.fake.info()["view"].get(NODE_ID, {})

    def test_a_killed_child_is_heard_of_within_a_second(self) -> None:
        require_llama_server()
        model = tiny_model(self.dir, "a", 1)
        agent = self.start_agent(models=[{"model_id": "tiny-a", "path": model, "roles": ["chat"]}])
        status, _, body = agent.request("POST", "/v1/chat/completions", CHAT, timeout=60)
        self.assertEqual(status, 200, body)
        wait_until(lambda: self.view().get("cpu:0", {}).get("state") == "ready", 10, interval=0.05,
                   what="the dispatcher seeing cpu:0 ready")
        [pid] = agent.child_pids()
        killed = time.time()
        os.kill(pid, signal.SIGKILL)

        def heard() -> bool:
            return self.view().get("cpu:0", {}).get("state") in ("stopped", "failed")

        wait_until(heard, 5, interval=0.02, what="the dispatcher hearing of the dead child")
        told = [r for r in self.deltas(killed)
                if any(e["device"] == "cpu:0" and e.get("state") in ("stopped", "failed") for e in r["body"]["events"])]
        self.assertTrue(told)
        self.assertLessEqual(told[0]["at"] - killed, 1.0)
        self.assertEqual([r for r in self.fake.received("heartbeat") if r["at"] > killed], [])  # not a heartbeat

    def test_a_burst_of_twenty_changes_is_one_or_two_messages(self) -> None:
        """Ten children killed at once: each a crash (failed) and an unload,
        20 changes.  Ten devices on a 2-core host: the cuda backend over a
        stand-in ``nvidia-smi`` listing ten GPUs (NVML is not installed here,
        so the backend asks nvidia-smi), each child the fake llama-server."""
        devices = 10
        bin_dir = os.path.join(self.dir, "bin")
        os.makedirs(bin_dir, exist_ok=True)
        smi = os.path.join(bin_dir, "nvidia-smi")
        with open(smi, "w", encoding="ascii") as f:
            f.write("#!/bin/sh\n"
                    f'if [ "$1" = "-L" ]; then for i in $(seq 0 {devices - 1}); do '
                    'echo "GPU $i: Stand-in GPU (UUID: GPU-00000000-0000-0000-0000-00000000000$i)"; done; exit 0; fi\n'
                    f"for i in $(seq 0 {devices - 1}); do "
                    'echo "$i, GPU-00000000-0000-0000-0000-00000000000$i, Stand-in GPU, 81559, 0, 81559, 0, 30, 50"; '
                    "done\n")
        os.chmod(smi, 0o755)
        model = os.path.join(self.dir, "m.gguf")
        open(model, "wb").close()  # the fake llama-server does not read it
        agent = self.start_agent(
            env={"PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")},
            backend="cuda", llama_server_bin=write_fake_llama_server_bin(self.dir),
            models=[{"model_id": "m", "path": model}],
            preload=[{"model": "m", "device": f"gpu:{i}"} for i in range(devices)],
        )
        wait_until(lambda: sum(d.get("state") == "ready" for d in self.view().values()) == devices, 60,
                   interval=0.1, what="the dispatcher seeing every device ready")
        pids = agent.child_pids()
        self.assertEqual(len(pids), devices)
        killed = time.time()
        for pid in pids:  # each: failed (the crash) and unloaded (stopped): 2 changes a device
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: all(d.get("state") in ("stopped", "failed") for d in self.view().values()), 5,
                   interval=0.05, what="the dispatcher hearing of every dead child")
        # Asserting that no third message comes needs a window: two coalescing windows and a round trip.
        time.sleep(0.5)
        bodies = [r for r in self.deltas(killed)
                  if any(e.get("state") in ("stopped", "failed") for e in r["body"]["events"])]
        self.assertIn(len(bodies), (1, 2), [r["body"] for r in bodies])
        told = {e["device"] for r in bodies for e in r["body"]["events"]}
        self.assertEqual(told, {f"gpu:{i}" for i in range(devices)})
        self.assertGreaterEqual(sum(len(r["body"]["events"]) for r in bodies), devices,
                                "every device's change is in them")

    def test_an_old_protocol_dispatcher_still_gets_heartbeats(self) -> None:
        self.fake.mode(events_route=False)
        agent = self.start_agent(heartbeat_interval_s=0.5, full_heartbeat_interval_s=30)
        self.assertIsNotNone(agent)
        wait_until(lambda: len(self.fake.received("heartbeat")) >= 4, 10, interval=0.05, what="4 heartbeats")
        beats = self.fake.received("heartbeat")
        gaps = [b["at"] - a["at"] for a, b in zip(beats[1:], beats[2:])]  # noqa: RUF007
        self.assertTrue(all(0.3 < g < 1.5 for g in gaps), gaps)
        for beat in beats:
            self.assertNotIn("last_seq", beat["body"])
            self.assertEqual(beat["body"]["schema_version"], 2)
        self.assertEqual([r["body"]["events"] for r in self.fake.received("events")], [[]])  # the probe only

    def test_a_missed_delta_is_healed_by_the_next_full_heartbeat(self) -> None:
        require_llama_server()
        model = tiny_model(self.dir, "a", 1)
        agent = self.start_agent(full_heartbeat_interval_s=2,
                                 models=[{"model_id": "tiny-a", "path": model, "roles": ["chat"]}])
        wait_until(lambda: "cpu:0" in self.view(), 10, interval=0.05, what="a first full heartbeat")
        dropping = time.time()
        self.fake.mode(drop_events=True)
        status, _, body = agent.request("POST", "/v1/chat/completions", CHAT, timeout=60)
        self.assertEqual(status, 200, body)

        def ready_dropped() -> bool:
            return any(e["type"] == "ready" for r in self.fake.received("events") if r["at"] > dropping
                       for e in r["body"]["events"])

        wait_until(ready_dropped, 5, interval=0.05, what="the delta of the load, dropped by the dispatcher")
        self.fake.mode(drop_events=False)
        wait_until(lambda: NODE_ID in self.fake.info()["missed"], 5, interval=0.05,
                   what="the next full heartbeat's last_seq naming the missed delta")
        self.assertEqual(self.view()["cpu:0"]["state"], "ready")  # healed by that heartbeat's full state
        self.assertIn(NODE_ID, self.fake.info()["missed"])
        beat = self.fake.received("heartbeat")[-1]["body"]
        self.assertGreater(beat["last_seq"], 1)
