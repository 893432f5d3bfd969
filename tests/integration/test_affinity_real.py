"""Prefix affinity, fair shares and the tenant cap end to end, with the real
llama-server and the tiny model: a conversation's second turn goes to the
device of its first while both devices hold the model; a flooding tenant
does not make another wait behind its queue; ``max_concurrent`` gives 429."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from typing import Any, Dict, List, Optional, Set

from twisted.trial.unittest import SynchronousTestCase

from tests.fixtures.tiny_gguf import write_tiny_gguf
from tests.integration.harness import AgentProcess, require_llama_server, wait_until
from tests.integration.test_multi_device import require_two_cores

KEYS = [{"name": "flood", "key": "k-flood", "max_concurrent": 12}, {"name": "one", "key": "k-one"},
        {"name": "capped", "key": "k-capped", "max_concurrent": 1}]


def post(port: int, path: str, body: Dict[str, Any], key: Optional[str] = None, rid: Optional[str] = None,
         timeout: float = 120) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if rid:
        headers["X-Request-Id"] = rid
    try:
        conn.request("POST", path, json.dumps(body), headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


class _Agent(SynchronousTestCase):
    def start(self, **top: Any) -> AgentProcess:
        require_llama_server()
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        path = os.path.join(self.dir, "tiny.gguf")
        write_tiny_gguf(path, seed=1, name="tiny", n_ctx=8192)
        config = {"log_format": "json", "max_pending_requests_per_device": 16,
                  "models": [{"model_id": "tiny", "path": path, "ctx_size": 8192}], **top}
        agent = AgentProcess(self.dir, config)
        self.addCleanup(agent.stop)
        return agent

    def device_of(self, agent: AgentProcess, rid: str) -> str:
        """The device the request log says served request ``rid``."""
        found: List[str] = []

        def logged() -> bool:
            for line in agent.log_text().splitlines():
                if rid in line and line.startswith("{"):
                    record = json.loads(line)
                    if record.get("request_id") == rid and record.get("device"):
                        found.append(record["device"])
                        return True
            return False

        wait_until(logged, 10, what=f"the log line of {rid}")
        return found[0]


    def finish_order(self, agent: AgentProcess, rids: Set[str]) -> List[str]:
        """The request ids in ``rids`` in the order the agent logged them ended."""
        order: List[str] = []

        def logged() -> bool:
            order[:] = [record["request_id"] for record in map(json.loads, (
                line for line in agent.log_text().splitlines() if line.startswith("{")))
                if record.get("request_id") in rids and record.get("device")]
            return len(order) == len(rids)

        wait_until(logged, 10, what="the log lines of every request")
        return order


class AffinityTests(_Agent):
    def test_the_second_turn_goes_where_the_first_went(self) -> None:
        require_two_cores()
        agent = self.start(cpu_devices=2, preload=[{"model": "tiny", "device": "cpu:0"},
                                                   {"model": "tiny", "device": "cpu:1"}])
        wait_until(lambda: agent.request("GET", "/ready")[0] == 200, 60, what="both preloads")
        filler = {"model": "tiny", "prompt": "x", "max_tokens": 6000, "ignore_eos": True, "stream": True}

        def conversation(name: str) -> Dict[str, str]:
            """Turn 1 on idle devices; turn 2 while turn 1's device is busy
            with another request (the least busy device is the other one)."""
            wait_until(lambda: not any(d["in_flight"] or d["queued"] for d in agent.inventory()["devices"]), 30,
                       what="idle devices")
            system = {"role": "system", "content": f"You help with project {name}. " * 40}
            turn1 = {"model": "tiny", "messages": [system, {"role": "user", "content": "hello"}], "max_tokens": 4}
            self.assertEqual(post(agent.port, "/v1/chat/completions", turn1, rid=f"{name}-1"), 200)
            first = self.device_of(agent, f"{name}-1")
            busy = BusyStream(agent.port, filler)
            busy.start()
            self.addCleanup(busy.stop)
            wait_until(lambda: any(d["in_flight"] for d in agent.inventory()["devices"]), 30, what="a busy device")
            busy_device = [d["device"] for d in agent.inventory()["devices"] if d["in_flight"]][0]
            turn2 = {"model": "tiny", "messages": turn1["messages"] + [
                {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}], "max_tokens": 4}
            self.assertEqual(post(agent.port, "/v1/chat/completions", turn2, rid=f"{name}-2"), 200)
            busy.stop()
            busy.join(60)
            return {"first": first, "busy": busy_device, "second": self.device_of(agent, f"{name}-2")}

        with_affinity = conversation("alpha")
        self.assertEqual(with_affinity["busy"], with_affinity["first"], "the filler took turn 1's device")
        self.assertEqual(with_affinity["second"], with_affinity["first"],
                         f"turn 2 follows turn 1 despite the busier device: {with_affinity}")
        inventory = agent.inventory()
        self.assertGreaterEqual(inventory["prefix_memory"]["hits"], 1, inventory["prefix_memory"])

        # The control: with affinity off, the same steps send turn 2 to the idle device.
        with open(agent.config_path, encoding="utf-8") as f:
            import yaml

            config = yaml.safe_load(f)
        config["prefix_affinity"] = False
        with open(agent.config_path, "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f)
        self.assertEqual(agent.request("POST", "/v1/node/reload")[0], 200)
        without = conversation("beta")
        self.assertEqual(without["busy"], without["first"])
        self.assertNotEqual(without["second"], without["first"], f"without affinity: the least busy {without}")


class BusyStream(threading.Thread):
    """One long streamed completion, read until ``stop()``."""

    def __init__(self, port: int, body: Dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.port, self.body = port, body
        self.stopping = threading.Event()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", json.dumps(self.body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            while not self.stopping.is_set() and response.readline():
                pass
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        self.stopping.set()


class TenantTests(_Agent):
    @staticmethod
    def pending(agent: AgentProcess, tenant: str) -> bool:
        """Whether ``tenant`` has a request queued or running (from /metrics)."""
        text = agent.request("GET", "/metrics", headers={"Authorization": "Bearer k-one"})[2].decode()
        return any(line.startswith((f'rolemesh_tenant_queued{{tenant="{tenant}"}}',
                                    f'rolemesh_tenant_running{{tenant="{tenant}"}}'))
                   and not line.endswith(" 0.0") for line in text.splitlines())

    @staticmethod
    def queued(agent: AgentProcess) -> int:
        """Requests waiting in the one device's queue (from the inventory)."""
        status, _, answer = agent.request("GET", "/v1/node/inventory", headers={"Authorization": "Bearer k-one"})
        assert status == 200, answer
        return int(json.loads(answer)["devices"][0]["queued"])

    def test_a_tenant_that_used_the_idle_device_is_not_punished_when_it_comes_back(self) -> None:
        """Issue 38: B alone on the idle device, then A's flood of eight, then
        B again: B waits only for the request running when it came -- it
        ends second, about twice its latency alone."""
        agent = self.start(api_keys=KEYS, preload=["tiny"])
        wait_until(lambda: agent.request("GET", "/ready")[0] == 200, 60, what="the preload")
        body = {"model": "tiny", "prompt": "x", "max_tokens": 1000, "ignore_eos": True}  # ~0.6 s each here
        alone = []
        for _ in range(3):  # B alone on the idle device (the first warms the child)
            began = time.monotonic()
            self.assertEqual(post(agent.port, "/v1/completions", body, key="k-one"), 200)
            alone.append(time.monotonic() - began)
        statuses: Dict[str, int] = {}

        def send(rid: str) -> None:
            statuses[rid] = post(agent.port, "/v1/completions", body, key="k-flood", rid=rid)

        flood = [threading.Thread(target=send, args=(f"a{i}",)) for i in range(8)]
        for t in flood:
            t.start()

        wait_until(lambda: self.queued(agent) >= 6, 30, what="the flood queued")
        began = time.monotonic()
        self.assertEqual(post(agent.port, "/v1/completions", body, key="k-one", rid="b"), 200)
        behind = time.monotonic() - began
        for t in flood:
            t.join(300)
        # Served ones only: on a loaded machine the last of the flood may pass queue_timeout_s (503).
        done = self.finish_order(agent, {"b", *(rid for rid, status in statuses.items() if status == 200)})
        # B ends second: it waited for the request running when it came, and
        # for none of the seven queued (the old order put it third or fourth).
        # The latency is a figure, not an assertion: about 2.0x of B alone on a
        # quiet machine, but under CI's parallel test jobs one request alone
        # varies by a third (8-12 s), which no wall-clock bound survives.
        self.assertLessEqual(done.index("b"), 1, done)
        base = min(alone[1:])
        print(f"\nB alone {base:.3f}s, behind the flood {behind:.3f}s ({behind / base:.2f}x)", flush=True)

    def test_a_flood_does_not_starve_another_tenant_and_the_cap_is_429(self) -> None:
        agent = self.start(api_keys=KEYS, preload=["tiny"])
        wait_until(lambda: agent.request("GET", "/ready")[0] == 200, 60, what="the preload")
        body = {"model": "tiny", "prompt": "x", "max_tokens": 300, "ignore_eos": True}
        finished: List[str] = []
        lock = threading.Lock()

        def send(name: str, key: str) -> None:
            status = post(agent.port, "/v1/completions", body, key=key, rid=name)
            with lock:
                finished.append(f"{name}:{status}")

        flood = [threading.Thread(target=send, args=(f"a{i}", "k-flood")) for i in range(8)]
        for t in flood:
            t.start()
        wait_until(lambda: self.queued(agent) >= 7, 30, what="the flood queued")
        one = threading.Thread(target=send, args=("b", "k-one"))
        one.start()
        # The cap: a second request of the capped tenant while its first waits.
        capped = threading.Thread(target=send, args=("c0", "k-capped"))
        capped.start()
        wait_until(lambda: self.pending(agent, "one") and self.pending(agent, "capped"), 30, what="b and c0 queued")
        status, headers, answer = agent.request(
            "POST", "/v1/completions", body, headers={"Authorization": "Bearer k-capped"})
        self.assertEqual(status, 429, answer)
        self.assertEqual((json.loads(answer)["error"]["code"], headers.get("retry-after")), ("tenant_limit", "1"))
        for t in flood + [one, capped]:
            t.join(300)
        self.assertTrue(all(f.endswith(":200") for f in finished), finished)
        # The order the agent finished them in (its request log, written in
        # end order by one thread), not the order the client threads woke up
        # in: under load those differ by several of these short requests.
        done = self.finish_order(agent, {f.split(":")[0] for f in finished})
        # b and c0 came after 8 of the flood, but each waited for at most the
        # running request and one more of the flood's (fair order), not for all 8.
        self.assertLessEqual(done.index("b"), 3, done)
        self.assertLessEqual(done.index("c0"), 4, done)
        status, _, metrics = agent.request("GET", "/metrics", headers={"Authorization": "Bearer k-one"})
        text = metrics.decode()
        self.assertIn('rolemesh_tenant_limited_total{tenant="capped"} 1.0', text)
        self.assertIn('rolemesh_tenant_queue_wait_seconds_count{tenant="flood"} 8.0', text)
