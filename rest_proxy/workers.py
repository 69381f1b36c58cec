"""`rest-proxy serve --workers N`: N proxy processes on one port, forked and supervised by a small parent.

The proxy is stateless (stored responses excepted: the workers share them), so several event loops
on one node serve several times the streams one loop can. The parent:

    parent (no event loop, no gRPC channel; signals, restarts, the metrics folder)
      |-- fork --> worker 0: uvicorn + the app, accepting on listening socket 0 --+
      |-- fork --> worker 1: uvicorn + the app, accepting on listening socket 1 --+-- one port (SO_REUSEPORT)
      ...

- Sockets: one listening socket per worker, all bound to the port with SO_REUSEPORT, so the kernel spreads
  new connections evenly over the workers. (With one shared socket, the first worker to wake accepts a
  whole burst of connections and the others idle.) The parent keeps every socket open, so a restarted
  worker accepts on the same one and no connection is refused meanwhile; once stopping, it closes them,
  so a worker that has drained takes its socket with it and new connections reach the ones still draining.
- Metrics: prometheus-client's multiprocess mode. The parent makes a fresh PROMETHEUS_MULTIPROC_DIR
  before any worker imports prometheus-client, marks a dead worker's live gauges gone, and deletes the
  folder at exit; any worker's /metrics sums every worker (`ProxyMetrics(multiprocess=True)`).
- Stored responses: the parent makes a private folder for the workers' shared state (the SQLite file of
  `SqliteResponseStore`), handed to each worker, and deletes it at exit.
- Signals: SIGTERM or SIGINT to the parent is passed to every worker as SIGTERM, and each drains as a
  single proxy does (503 to new requests, in-flight streams finish, up to --shutdown-timeout); a second
  one stops them at once. Workers run in their own process group, so a terminal's Ctrl-C reaches the
  parent alone, and die with the parent (PR_SET_PDEATHSIG) if it is killed.
- A worker that dies unexpectedly is replaced; one that keeps dying (a broken config) stops the proxy
  with exit status 1.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

MAX_DEFAULT_WORKERS = 4
# More than this many worker deaths within _CRASH_WINDOW_S (outside a shutdown): give up, exit 1.
_MAX_CRASHES = 5
_CRASH_WINDOW_S = 30.0
_PR_SET_PDEATHSIG = 1


def default_num_workers() -> int:
    """min(4, the CPUs this process may use): one event loop per core it can run on (the affinity mask,
    and a cgroup CPU quota such as a Kubernetes CPU limit), at most 4 since the engine, not the proxy, is
    the bottleneck beyond that."""
    return max(1, min(MAX_DEFAULT_WORKERS, usable_cpus()))


def usable_cpus(cgroup_cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """CPUs in the affinity mask, capped by the cgroup v2 CPU quota (rounded up) where one is set."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open(cgroup_cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota: the affinity mask decides
    return cpus


def listening_sockets(host: str, port: int, num_sockets: int, backlog: int = 2048) -> list[socket.socket]:
    """`num_sockets` sockets listening on host:port with SO_REUSEPORT (port 0: the first one's port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(num_sockets):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
            sock.listen(backlog)
            sock.set_inheritable(True)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class WorkerSupervisor:
    """Forks one worker per socket, replaces the ones that die, and stops them all on a signal.

    `run_worker(sock)` runs in the forked child and returns its exit status."""

    def __init__(self, sockets: list[socket.socket], run_worker: Callable[[socket.socket], int]):
        self.sockets = sockets
        self.run_worker = run_worker
        self.pids: dict[int, int] = {}  # worker pid -> index of its socket
        self.is_stopping = False
        self.crash_times: list[float] = []
        self.exit_status = 0

    def run(self) -> int:
        """Serves until the workers have stopped after a signal (0) or kept crashing (1)."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for index in range(len(self.sockets)):
                self._spawn(index)
            while self.pids:
                try:
                    pid, status = os.wait()
                except ChildProcessError:
                    break
                self._reap(pid, os.waitstatus_to_exitcode(status))
            return self.exit_status
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _spawn(self, index: int) -> None:
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                _become_worker()
                for i, sock in enumerate(self.sockets):
                    if i != index:
                        sock.close()
                status = self.run_worker(self.sockets[index])
            except BaseException:  # noqa: BLE001 - a worker must never return into the parent's loop
                log.exception("proxy worker %d failed", os.getpid())
            finally:
                logging.shutdown()
                os._exit(status)
        self.pids[pid] = index
        log.info("proxy worker %d started (socket %d)", pid, index)

    def _reap(self, pid: int, exit_code: int) -> None:
        index = self.pids.pop(pid, None)
        if index is None:
            return  # not a worker (an MCP server the parent never starts; defensive)
        _mark_metrics_dead(pid)
        if self.is_stopping:
            if exit_code != 0:
                log.warning("proxy worker %d exited with %d while stopping", pid, exit_code)
                self.exit_status = 1
            return
        now = time.monotonic()
        self.crash_times = [t for t in self.crash_times if now - t < _CRASH_WINDOW_S] + [now]
        if len(self.crash_times) > _MAX_CRASHES:
            log.error("proxy workers died %d times in %.0f s (last: %d, exit %d): stopping",
                      len(self.crash_times), _CRASH_WINDOW_S, pid, exit_code)
            self.exit_status = 1
            self._stop_all()
            return
        log.error("proxy worker %d died (exit %d): starting another", pid, exit_code)
        self._spawn(index)

    def _on_signal(self, sig: int, frame) -> None:
        if not self.is_stopping:
            log.info("%s: stopping %d proxy workers (they drain first)", signal.Signals(sig).name, len(self.pids))
        self._stop_all()

    def _stop_all(self) -> None:
        # NOTE: a second signal is passed on too: the workers' drain treats it as "stop now".
        self.is_stopping = True
        # No worker is started from here on: the parent lets go of its copies of the sockets, so each one
        # closes with its worker. (Held here, a drained worker's socket would keep taking connections that
        # nobody accepts, and those clients would hang instead of reaching a worker still draining.)
        for sock in self.sockets:
            sock.close()
        for pid in list(self.pids):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def _become_worker() -> None:
    """In the forked child: own process group (a terminal's Ctrl-C goes to the parent only, which passes
    one SIGTERM on), default signal handlers for uvicorn to replace, death with the parent."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    os.setpgid(0, 0)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: an orphaned worker lives until killed


def _mark_metrics_dead(pid: int) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)


def serve_workers(num_workers: int, host: str, port: int,
                  run_worker: Callable[[socket.socket, str], int]) -> int:
    """Listens on host:port, runs `num_workers` workers (`run_worker(sock, state_dir)` in each, `state_dir`
    a private folder they share) until a signal stops them, with a private prometheus-client multiprocess
    folder; the exit status."""
    sockets = listening_sockets(host, port, num_workers)
    # NOTE: before any worker imports prometheus-client: it picks its multiprocess value class at import.
    metrics_dir = tempfile.mkdtemp(prefix="rest-proxy-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    state_dir = tempfile.mkdtemp(prefix="rest-proxy-state-")
    try:
        return WorkerSupervisor(sockets, lambda sock: run_worker(sock, state_dir)).run()
    finally:
        for sock in sockets:
            sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        shutil.rmtree(state_dir, ignore_errors=True)
