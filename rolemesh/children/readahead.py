"""Warm switches: read a model's GGUF ahead while the requests before its
switch finish.

When a request waits in a queue for a model that no device holds or is
loading (a switch is coming once the current requests end), the agent asks
the kernel to start reading that model's files into the page cache
(``posix_fadvise(POSIX_FADV_WILLNEED)``, a read-ahead window per call:
Linux reads no more than that per call), so the load that follows reads
memory instead of disk.  Bounded by free memory: at most half of
``MemAvailable`` is asked for (the first bytes of the files, in order:
llama.cpp reads the tensors from the front), and nothing when the host
reports no memory to spare.  A model is read ahead at most once per
:data:`WINDOW_S` (every queued request for it would ask again).

:func:`plan` is pure; :class:`ReadAhead` does the I/O through injected
functions (``advise``, ``mem_available``, the clock), off the reactor
thread where the reactor has threads.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from twisted.logger import Logger

log = Logger(namespace="rolemesh.readahead")

#: A model is read ahead at most once in this many seconds.
WINDOW_S = 60.0
#: The share of ``MemAvailable`` a read-ahead may ask for.
SHARE_OF_AVAILABLE = 0.5
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def plan(sizes: Sequence[int], available: Optional[int], share: float = SHARE_OF_AVAILABLE) -> List[int]:
    """Bytes to read ahead of each file (pure): in order, until
    ``share * available`` is used up; nothing when ``available`` is unknown
    or none."""
    budget = int(max(0, available or 0) * share)
    out = []
    for size in sizes:
        take = max(0, min(size, budget))
        out.append(take)
        budget -= take
    return out


def files_of(model: Any) -> List[str]:
    """The files a child of ``model`` reads: its GGUF, the other parts of a
    split model (``-00001-of-00003``), its ``mmproj``."""
    files = [model.path]
    match = _SPLIT.match(os.path.basename(model.path))
    if match and int(match.group("part")) == 1:
        folder, count = os.path.dirname(model.path), int(match.group("count"))
        files += [os.path.join(folder, f"{match.group('stem')}-{n:05d}-of-{match.group('count')}.gguf")
                  for n in range(2, count + 1)]
    if getattr(model, "mmproj", None):
        files.append(model.mmproj)
    return files


def mem_available(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """``MemAvailable`` in bytes, or None where the host does not say."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


#: Linux reads at most the device's read-ahead window (``read_ahead_kb``)
#: per WILLNEED call (``force_page_cache_ra``), so a whole file is asked
#: for a window at a time; this one where the window cannot be read.
DEFAULT_WINDOW = 128 * 1024


def read_ahead_window(path: str) -> int:
    """The read-ahead window of the block device holding ``path``, in bytes
    (``/sys/dev/block/M:m/queue/read_ahead_kb``, or its parent's for a
    partition); at least :data:`DEFAULT_WINDOW`."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return DEFAULT_WINDOW
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for candidate in (f"{base}/queue/read_ahead_kb", f"{base}/../queue/read_ahead_kb"):
        try:
            with open(candidate, encoding="ascii") as f:
                return max(DEFAULT_WINDOW, int(f.read().strip()) * 1024)
        except (OSError, ValueError):
            continue
    return DEFAULT_WINDOW


def advise_willneed(path: str, length: int) -> None:
    """Ask the kernel to read the first ``length`` bytes of ``path`` ahead
    (one WILLNEED per read-ahead window: the kernel reads no more per call).
    The reads are queued, not waited for."""
    window = read_ahead_window(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset in range(0, length, window):
            os.posix_fadvise(fd, offset, min(window, length - offset), os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def evict(path: str) -> None:
    """Drop ``path`` from the page cache (``POSIX_FADV_DONTNEED``; the
    benchmark's cold-cache case)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class ReadAhead:
    """Reads models ahead for coming switches (see the module)."""

    def __init__(self, reactor: Callable[[], Any], *,
                 advise: Callable[[str, int], None] = advise_willneed,
                 available: Callable[[], Optional[int]] = mem_available,
                 size_of: Callable[[str], int] = os.path.getsize,
                 window_s: float = WINDOW_S) -> None:
        self._reactor = reactor
        self._advise = advise
        self._available = available
        self._size_of = size_of
        self.window_s = window_s
        self.enabled = hasattr(os, "posix_fadvise")
        #: path -> reactor time of its last read-ahead.
        self._last: Dict[str, float] = {}

    def warm(self, model: Any) -> Optional[Tuple[Tuple[str, int], ...]]:
        """Read ``model``'s files ahead unless done within the window; the
        (file, bytes) asked for, or None when nothing was asked."""
        if not self.enabled:
            return None
        now = self._reactor().seconds()
        if now - self._last.get(model.path, float("-inf")) < self.window_s:
            return None
        self._last[model.path] = now
        try:
            files = files_of(model)
            sizes = [self._size_of(f) for f in files]
            lengths = plan(sizes, self._available())
        except OSError as e:
            log.info("no read-ahead for {model}: {error}", model=model.model_id, error=e.strerror or str(e))
            return None
        asked = tuple((f, n) for f, n in zip(files, lengths) if n > 0)
        if not asked:
            log.info("no read-ahead for {model}: no memory to spare (MemAvailable)", model=model.model_id)
            return None
        total, whole = sum(n for _, n in asked), sum(sizes)
        log.info("reading {model} ahead for a coming switch: {mib:.0f} of {whole_mib:.0f} MiB",
                 model=model.model_id, mib=total / 2**20, whole_mib=whole / 2**20)
        reactor = self._reactor()
        call = getattr(reactor, "callInThread", None)
        if call is not None:
            call(self._advise_all, model.model_id, asked)
        else:
            self._advise_all(model.model_id, asked)
        return asked

    def _advise_all(self, model_id: str, asked: Sequence[Tuple[str, int]]) -> None:
        for path, length in asked:
            try:
                self._advise(path, length)
            except OSError as e:  # a file gone meanwhile: the load will say so
                log.info("read-ahead of {model} ({path}) failed: {error}", model=model_id, path=path,
                         error=e.strerror or str(e))
