"""Math-verify worker processes: JSON lines over pipes, each worker on its own main thread.

Why not ``multiprocessing``: its ``spawn`` start method re-imports the parent's ``__main__`` in
every worker (which breaks for ``python - < script`` and would re-run a training script's
top-level code, MPI initialisation included), and ``fork`` is unsafe in a process that runs
threads (torch, MPI). A worker here is a fresh interpreter running :func:`main`: it imports
only this package and math-verify (started with ``-c``, not ``-m``, so that this module is not
imported twice).

Protocol: the parent writes ``{"gold": str, "pred": str | null, "timeout_seconds": int}`` per
line; the worker answers ``[correct, status]`` per line (see :func:`grade_strings`).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
import time
import weakref
from collections import deque

from essa.rewards.grading import grade_strings

# A fresh worker imports sympy before its first answer.
STARTUP_SECONDS = 30.0


def main() -> None:
    """Worker loop: answer requests until stdin closes."""
    protocol = sys.stdout
    sys.stdout = sys.stderr  # stray library prints must not corrupt the protocol stream
    for line in sys.stdin:
        request = json.loads(line)
        correct, status = grade_strings(
            request["gold"], request["pred"], request["timeout_seconds"]
        )
        protocol.write(json.dumps([correct, status]) + "\n")
        protocol.flush()


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            pipe.close()


def _kill_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        _stop(process)
    processes.clear()


class VerifyWorkers:
    """A small pool of worker processes with a per-item wall-clock deadline.

    Each item gets ``item_seconds`` (plus :data:`STARTUP_SECONDS` on a fresh worker); a worker
    that misses its deadline is killed and replaced, and the item is reported as a timeout.
    A worker that dies mid-item reports ``(None, "error")``. Calls are serialised by a lock.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._idle: list[subprocess.Popen] = []
        self._all: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _kill_all, self._all)

    def _spawn(self) -> subprocess.Popen:
        env = dict(os.environ)
        # The worker must import the same essa as this process, installed or not.
        env["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
        process = subprocess.Popen(
            [sys.executable, "-c", "from essa.rewards.verify_worker import main; main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
        )
        self._all.append(process)
        return process

    def _retire(self, process: subprocess.Popen) -> None:
        _stop(process)
        self._all.remove(process)

    def run(
        self, items: list[tuple[str, str | None]], timeout_seconds: int, item_seconds: float
    ) -> list[tuple[bool | None, str]]:
        """Grade ``(gold, pred)`` items in parallel; results in input order."""
        with self._lock:
            return self._run(items, timeout_seconds, item_seconds)

    def _run(
        self, items: list[tuple[str, str | None]], timeout_seconds: int, item_seconds: float
    ) -> list[tuple[bool | None, str]]:
        results: list[tuple[bool | None, str]] = [(None, "error")] * len(items)
        queue = deque(range(len(items)))
        busy: dict[subprocess.Popen, tuple[int, float]] = {}  # worker -> (item, deadline)
        fresh: set[subprocess.Popen] = set()
        selector = selectors.DefaultSelector()

        def dispatch() -> None:
            while queue and (self._idle or len(self._all) < self.size):
                if self._idle:
                    worker = self._idle.pop()
                else:
                    worker = self._spawn()
                    fresh.add(worker)
                index = queue.popleft()
                gold, pred = items[index]
                request = {"gold": gold, "pred": pred, "timeout_seconds": timeout_seconds}
                assert worker.stdin is not None and worker.stdout is not None
                worker.stdin.write(json.dumps(request) + "\n")
                worker.stdin.flush()
                grace = STARTUP_SECONDS if worker in fresh else 0.0
                busy[worker] = (index, time.monotonic() + item_seconds + grace)
                selector.register(worker.stdout.fileno(), selectors.EVENT_READ, worker)

        def finish(worker: subprocess.Popen, result: tuple[bool | None, str] | None) -> None:
            index, _ = busy.pop(worker)
            assert worker.stdout is not None
            selector.unregister(worker.stdout.fileno())
            fresh.discard(worker)
            if result is None:
                results[index] = (None, "error")
                self._retire(worker)
            else:
                results[index] = result
                self._idle.append(worker)

        try:
            dispatch()
            while busy:
                wait = min(deadline for _, deadline in busy.values()) - time.monotonic()
                for key, _ in selector.select(timeout=max(0.0, wait)):
                    worker = key.data
                    assert worker.stdout is not None
                    line = worker.stdout.readline()
                    finish(worker, tuple(json.loads(line)) if line else None)
                now = time.monotonic()
                for worker, (index, deadline) in list(busy.items()):
                    if deadline <= now:
                        finish(worker, None)
                        results[index] = (False, "timeout")
                dispatch()
        finally:
            selector.close()
            for worker in list(busy):  # only after an exception: do not reuse a busy worker
                self._retire(worker)
        return results

    def close(self) -> None:
        """Kill every worker."""
        with self._lock:
            self._idle.clear()
            _kill_all(self._all)
