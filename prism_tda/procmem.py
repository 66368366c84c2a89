"""Process memory from ``/proc`` (Linux): one process's anonymous or resident memory, a process
tree's, and a sampler that keeps the peak while something runs.

Anonymous memory (``RssAnon``) is what a process itself holds; memory-mapped file pages
(``RssFile``) belong to the page cache and can be dropped by the OS, so limits and per-token
memory figures use ``RssAnon``.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def status_bytes(pid: int, field: str = "RssAnon") -> int:
    """A ``/proc/PID/status`` memory field (``RssAnon``, ``VmRSS``, ``VmHWM``, ...) in bytes; 0 when the
    process is gone or the field is unknown."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def children(pid: int) -> list[int]:
    """The direct children of a process (every thread's)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return out


def tree(pid: int) -> list[int]:
    """A process and all its descendants."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        todo += children(p)
    return seen


def tree_bytes(pid: int, field: str = "RssAnon") -> int:
    return sum(status_bytes(p, field) for p in tree(pid))


class PeakSampler:
    """Samples a process tree's memory every ``interval`` seconds in a thread; ``peak`` is the largest
    total seen, ``base`` the first sample.

        with PeakSampler(pid) as s:
            ...
        grown = s.peak - s.base
    """

    def __init__(self, pid: int | None = None, *, field: str = "RssAnon", interval: float = 0.01,
                 include_children: bool = True) -> None:
        self.pid = pid or os.getpid()
        self.field, self.interval, self.include_children = field, interval, include_children
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-sampler", daemon=True)

    def sample(self) -> int:
        return tree_bytes(self.pid, self.field) if self.include_children else status_bytes(self.pid, self.field)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        self.base = self.peak = self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.sample())
