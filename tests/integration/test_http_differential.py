"""Differential fuzzing of the listener against twisted.web.

Hypothesis builds HTTP/1.1 request streams from a grammar (methods, paths,
Host, extra headers, Content-Length or chunked bodies, Expect,
Connection: close, HTTP/1.0, pipelining, split writes) and mutates them
(bare LF, lone CR, NUL, VT, FF, obs-fold, duplicate or conflicting
Content-Length and Transfer-Encoding, no Host or two, names that are not
tokens, many headers, junk in the length, truncation, odd versions, transfer
codings not understood alone or in lists, more than one space in the
request line, bytes that are no UTF-8 in each header the node reads).  The
same bytes go, over real TCP, to the agent's listener and to plain
twisted.web serving the same app (tests/integration/http_pair_server.py).

- Unmutated streams must be answered the same: as many answers, the same
  status classes, the same close.
- Mutated ones may be refused by the agent where twisted.web served them
  (it is stricter by design: RFC 9112's rules, docs/security.md), but
  never the other way round: up to the agent's refusal the two agree, the
  refusal is a 4xx/5xx and the agent's last answer, and the connection
  closes.  Where twisted.web refused, the agent refused at or before it.
- Where a stream's first mutated request is one the agent must refuse
  (``MUST_REFUSE``) and only requests that keep the connection open come
  before it, the agent refuses it (or earlier) and closes.

CI runs a bounded number of examples; ``ROLEMESH_DIFF_EXAMPLES=N`` runs more.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.http.request_head import READ_FIELDS
from tests.integration.raw_http import Answers, exchange, final

EXAMPLES = int(os.environ.get("ROLEMESH_DIFF_EXAMPLES", "60"))
#: With ``ROLEMESH_DIFF_STATS=PATH``: how many streams of each kind were sent, written there at exit.
STATS: Counter = Counter()
if os.environ.get("ROLEMESH_DIFF_STATS"):
    atexit.register(lambda: open(os.environ["ROLEMESH_DIFF_STATS"], "w").write(json.dumps(STATS, indent=1)))

NAMES = [b"Accept", b"User-Agent", b"X-Request-Id", b"Content-Type", b"X-A", b"Authorization"]
VALUES = [b"v", b"*/*", b"a b", b"application/json", b"\xffobs", b"x\ty", b""]
BYTE_MUTATIONS = ["bare_lf", "lone_cr", "nul", "vt", "ff", "del"]
HEAD_MUTATIONS = ["obs_fold", "dup_cl", "dup_cl_same", "te_identity", "te_gzip", "te_and_cl", "no_host", "two_hosts",
                  "space_in_name", "space_before_colon", "at_in_name", "many_headers", "cl_junk", "cl_plus",
                  "bad_version", "lower_method", "unknown_expect", "chunk_size_0x", "truncate", "te_list",
                  "host_bytes", "te_alone", "spaced_line", "read_field_bytes"]
#: The headers the node reads, as a client may spell them.
READ_NAMES = sorted(READ_FIELDS) + [b"Authorization", b"X-Api-Key", b"Content-Type", b"X-RoleMesh-Tenant",
                                    b"X-Conversation-Id", b"Access-Control-Request-Headers", b"Origin"]
NOT_UTF8 = [b"\xff\xfe", b"a\xc3", b"\x80node", b"Bearer \xff", b"\xed\xa0\x80"]
#: Mutations after which the agent must refuse that request (400 or 501) and close.
MUST_REFUSE = ("spaced_line", "read_field_bytes", "te_alone", "te_list")


def not_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


@st.composite
def requests(draw: Any) -> Tuple[bytes, Optional[str], bool]:
    """One request's bytes, the mutation applied (None: a valid request),
    and whether the connection stays open after it (HTTP/1.1, no close)."""
    method = draw(st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"OPTIONS"]))
    path = draw(st.sampled_from([b"/v1/chat/completions", b"/health", b"/other", b"/v1/chat/completions?x=1",
                                 b"/a%20b", b"/"]))
    version = draw(st.sampled_from([b"1.1", b"1.1", b"1.1", b"1.0"]))
    mutation = draw(st.sampled_from([None] * 8 + BYTE_MUTATIONS + HEAD_MUTATIONS))
    headers: List[Tuple[bytes, bytes]] = []
    if version == b"1.1" or draw(st.booleans()):
        headers.append((b"Host", b"node"))
    headers += draw(st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(VALUES)), max_size=4))
    body = draw(st.binary(max_size=40)) if method in (b"POST", b"PUT") else b""
    chunked = bool(body) and version == b"1.1" and draw(st.booleans())
    if chunked:
        headers.append((b"Transfer-Encoding", b"chunked"))
        cut = draw(st.integers(min_value=1, max_value=len(body)))
        encoded = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:cut], body[cut:]) if part)
        encoded += b"0\r\n\r\n"
    else:
        if body or method in (b"POST", b"PUT"):
            headers.append((b"Content-Length", b"%d" % len(body)))
        encoded = body
    if body and version == b"1.1" and draw(st.booleans()):
        headers.append((b"Expect", b"100-continue"))
    closes = version != b"1.1" or draw(st.integers(min_value=0, max_value=3)) == 0
    if closes:
        headers.append((b"Connection", b"close"))

    if mutation == "obs_fold":
        headers.insert(1, (b"X-Fold", b"a\r\n b"))
    elif mutation == "dup_cl":
        headers.append((b"Content-Length", b"%d" % (len(body) + 3)))
    elif mutation == "dup_cl_same":
        headers.append((b"Content-Length", b"%d" % len(body)))
    elif mutation == "te_identity":
        headers = [h for h in headers if h[0] != b"Transfer-Encoding"] + [(b"Transfer-Encoding", b"identity")]
    elif mutation == "te_gzip":
        headers.append((b"Transfer-Encoding", b"gzip"))
    elif mutation == "te_list":  # codings besides chunked, in one line or more: 501 (RFC 9112 §6.1)
        others = [h for h in headers if h[0] != b"Transfer-Encoding"]
        codings = draw(st.lists(st.sampled_from([b"identity", b"gzip", b"deflate", b"x-custom", b"GZip", b"br"]),
                                min_size=1, max_size=3))
        last = draw(st.sampled_from([b"chunked", b"Chunked", b"CHUNKED"]))
        if draw(st.booleans()):
            headers = others + [(b"Transfer-Encoding", b", ".join(codings + [last]))]
        else:
            headers = others + [(b"Transfer-Encoding", c) for c in codings + [last]]
    elif mutation == "te_alone":  # a coding not understood, alone (no chunked at all): 400 (§6.3)
        others = [h for h in headers if h[0] not in (b"Transfer-Encoding", b"Content-Length")]
        codings = draw(st.lists(st.sampled_from([b"identity", b"gzip", b"deflate", b"x-custom", b"compress"]),
                                min_size=1, max_size=2))
        headers = others + [(b"Transfer-Encoding", b", ".join(codings))]
    elif mutation == "read_field_bytes":  # bytes that are no UTF-8 in a header the node reads: 400
        name = draw(st.sampled_from(READ_NAMES))
        value = draw(st.sampled_from(NOT_UTF8))
        if name.lower() == b"host":
            headers = [h for h in headers if h[0] != b"Host"]
        headers.insert(draw(st.integers(min_value=0, max_value=len(headers))), (name, value))
    elif mutation == "host_bytes":  # a Host that is no UTF-8: 400 on both
        headers = [(n, draw(st.sampled_from([b"\xff\xfe", b"a\xc3", b"\x80node"]))) if n == b"Host" else (n, v)
                   for n, v in headers]
    elif mutation == "te_and_cl":
        headers.append((b"Transfer-Encoding", b"chunked") if not chunked else (b"Content-Length", b"5"))
    elif mutation == "no_host":
        headers = [h for h in headers if h[0] != b"Host"]
    elif mutation == "two_hosts":
        headers += [(b"Host", b"a"), (b"Host", b"b")]
    elif mutation == "space_in_name":
        headers.append((b"Content Type", b"v"))
    elif mutation == "space_before_colon":
        headers.append((b"X-B ", b"v"))
    elif mutation == "at_in_name":
        headers.append((draw(st.sampled_from([b"X@Y", b"X(A)", b"X-A\x7f", b"X/Y"])), b"v"))
    elif mutation == "many_headers":
        headers += [(b"X-%d" % i, b"v") for i in range(draw(st.sampled_from([101, 300, 600])))]
    elif mutation == "cl_junk":
        headers = [(n, v + draw(st.sampled_from([b"\x0b", b"\x0c", b"_0", b" 1", b",1"])))
                   if n == b"Content-Length" else (n, v) for n, v in headers]
    elif mutation == "cl_plus":
        headers = [(n, b"+" + v) if n == b"Content-Length" else (n, v) for n, v in headers]
    elif mutation == "bad_version":
        version = draw(st.sampled_from([b"1.2", b"2.0", b"0.9", b"1.01"]))
    elif mutation == "lower_method":
        method = method.lower()
    elif mutation == "unknown_expect":
        headers.append((b"Expect", b"something-else"))
    elif mutation == "chunk_size_0x" and chunked:
        encoded = b"0x" + encoded

    if mutation is None and any(n.lower() in READ_FIELDS and not_utf8(v) for n, v in headers):
        mutation = "read_field_bytes"  # the grammar's own values: refused as that mutation is
    spaces = [b" ", b" "]
    if mutation == "spaced_line":  # more than one SP between the parts of the request line (RFC 9112 §3)
        spaces = draw(st.sampled_from([[b"  ", b" "], [b" ", b"  "], [b"   ", b"   "]]))
    head = b"%s%s%s%sHTTP/%s\r\n" % (method, spaces[0], path, spaces[1], version) + b"".join(
        name + b": " + value + b"\r\n" for name, value in headers) + b"\r\n"
    if mutation in BYTE_MUTATIONS:
        if mutation in ("bare_lf", "lone_cr"):
            breaks = [i for i in range(len(head) - 1) if head[i:i + 2] == b"\r\n"]
            at = breaks[draw(st.integers(min_value=0, max_value=len(breaks) - 1))]
            head = head[:at] + (b"\n" if mutation == "bare_lf" else b"\r") + head[at + 2:]
        else:
            at = draw(st.integers(min_value=1, max_value=len(head) - 4))
            head = head[:at] + {"nul": b"\x00", "vt": b"\x0b", "ff": b"\x0c", "del": b"\x7f"}[mutation] + head[at:]
    data = head + encoded
    if mutation == "truncate":
        data = data[:draw(st.integers(min_value=1, max_value=len(data) - 1))]
    return data, mutation, not closes


streams = st.tuples(st.lists(requests(), min_size=1, max_size=3), st.integers(min_value=1, max_value=3))


def same_class(a: int, b: int) -> bool:
    return a // 100 == b // 100


class DifferentialTests(SynchronousTestCase):
    server: Optional[subprocess.Popen] = None
    ports: Dict[str, int] = {}

    def setUp(self) -> None:
        cls = type(self)
        if cls.server is None or cls.server.poll() is not None:
            script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "http_pair_server.py")
            cls.server = subprocess.Popen([sys.executable, script], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            line = cls.server.stdout.readline()  # type: ignore[union-attr]
            cls.ports = json.loads(line)
            atexit.register(cls.stop_server)  # and if trial dies, the closed stdin stops it
        self.pool = ThreadPoolExecutor(2)
        self.addCleanup(self.pool.shutdown)

    @classmethod
    def stop_server(cls) -> None:
        if cls.server is not None:
            cls.server.stdin.close()  # type: ignore[union-attr]
            cls.server.wait(10)
            cls.server = None

    def both(self, data: bytes, pieces: int, quiet: float = 0.15) -> Tuple[Answers, Answers]:
        ours = self.pool.submit(exchange, self.ports["ours"], data, quiet=quiet, limit=10, pieces=pieces)
        plain = self.pool.submit(exchange, self.ports["twisted_web"], data, quiet=quiet, limit=10, pieces=pieces)
        return ours.result(), plain.result()

    def check(self, data: bytes, pieces: int, mutated: bool, refused_at: Optional[int] = None) -> None:
        """Judged on a short wait for answers; a disagreement is judged again
        on a long one (a busy machine can take longer than the short wait)."""
        try:
            self.judge(*self.both(data, pieces), mutated, data, refused_at)
        except self.failureException:
            STATS["judged again"] += 1
            self.judge(*self.both(data, pieces, quiet=3.0), mutated, data, refused_at)

    def judge(self, ours: Answers, plain: Answers, mutated: bool, data: bytes, refused_at: Optional[int] = None
              ) -> None:
        """``refused_at``: the request the agent must refuse (and close after), if any."""
        o, p = final(ours), final(plain)
        where = f"\nsent {data[:600]!r}\nours {ours!r}\ntwisted.web {plain!r}"
        if refused_at is not None:
            self.assertTrue(o and len(o) <= refused_at + 1 and o[-1] >= 400 and ours.closed,
                            f"request {refused_at} must be refused, and the connection closed" + where)
        if not mutated:
            self.assertEqual(len(o), len(p), where)
            self.assertTrue(all(same_class(a, b) for a, b in zip(o, p)), where)
            self.assertEqual(ours.closed, plain.closed, where)
            return
        for i, (a, b) in enumerate(zip(o, p)):
            if same_class(a, b):
                continue
            # The first disagreement: the agent refused what twisted.web served, and stopped there.
            self.assertGreaterEqual(a, 400, "the agent served what twisted.web refused" + where)
            self.assertEqual(i, len(o) - 1, "the agent's refusal is its last answer" + where)
            self.assertTrue(ours.closed, "and it closes" + where)
            return
        if len(o) == len(p):
            if o and o[-1] >= 400 and ours.closed:
                return
            self.assertEqual(ours.closed, plain.closed, where)
        elif len(o) < len(p):  # the agent answered fewer: only by refusing, and closing
            self.assertTrue(o and o[-1] >= 400 and ours.closed, "the agent stopped answering" + where)
        elif len(o) == len(p) + 1 and o[-1] >= 400 and ours.closed:
            return  # the agent refused (and closed) where twisted.web still waits for more
        else:  # the agent answered more: only where twisted.web waits or closed without an answer it owed
            self.assertTrue(plain.closed or not ours.closed, where)
            self.assertFalse(p and p[-1] >= 400 and plain.closed,
                             "twisted.web refused and closed, the agent went on" + where)

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(streams)
    def test_same_framing_as_twisted_web_or_stricter(
            self, stream: Tuple[List[Tuple[bytes, Optional[str], bool]], int]) -> None:
        parts, pieces = stream
        data = b"".join(p for p, _, _ in parts)
        mutated = any(m is not None for _, m, _ in parts)
        STATS["streams"] += 1
        STATS["requests"] += len(parts)
        for _, m, _ in parts:
            STATS[m or "valid"] += 1
        # Where a request the agent must refuse follows only valid requests that keep the connection open.
        refused_at = None
        for i, (_, m, keeps) in enumerate(parts):
            if m in MUST_REFUSE:
                refused_at = i
            if m is not None or not keeps:
                break
        self.check(data, pieces, mutated, refused_at)

    def test_known_disagreements_are_the_agent_being_stricter(self) -> None:
        """The cases of issue 25 where twisted.web itself serves what RFC 9112 refuses."""
        ok = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        for data in (b"POST /other HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity\r\n\r\n" + ok,
                     b"GET /health HTTP/1.1\r\n\r\n",
                     b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"):
            ours, plain = self.both(data, 1)
            self.assertEqual(final(ours), [400], ours)
            self.assertTrue(ours.closed)
            self.assertNotEqual(final(plain), [400], f"twisted.web serves it: {plain!r}")

    def test_spaced_request_lines_and_no_utf8_in_the_headers_the_node_reads(self) -> None:
        """Issue 38: the agent refuses both with 400 and closes, whichever
        path the request takes (twisted.web, serving an app that reads no
        header, refuses some spaced lines and serves the rest)."""
        for path in (b"/health", b"/other"):
            for line in (b"GET  %s HTTP/1.1", b"GET %s  HTTP/1.1"):
                ours, _ = self.both((line % path) + b"\r\nHost: x\r\n\r\n", 1)  # twisted.web: 400 or 200
                self.assertEqual((final(ours), ours.closed), ([400], True), ours)
            for name in READ_NAMES:
                head = b"GET " + path + b" HTTP/1.1\r\n" + (b"" if name.lower() == b"host" else b"Host: x\r\n")
                ours, _ = self.both(head + name + b": \xff\xfe\r\n\r\n", 1)
                self.assertEqual((final(ours), ours.closed), ([400], True), (name, ours))
