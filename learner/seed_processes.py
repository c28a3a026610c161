"""Seed-derived states computed in processes of their own (issue #55).

A state (learner/seed_state.py: a seed's initial parameters, its epoch permutations and their
SHA-256s) is a few dozen numpy and torch calls that each let go of the GIL and take it back. In a
busy service those take-backs wait behind every other thread's Python (the GIL's switch
interval), so a sweep over many distinct seeds waits for the service's one prepare thread
(docs/performance.md, "Seed states in processes of their own"). A child
process has a GIL of its own: it computes the states and sends them back whole, and the service's
thread that waits for them takes its GIL back twice per batch (``MSG_WAITALL``: one read of the
whole batch), not a few dozen times per state.

One ``SeedProcess`` is one child (``python -m learner.seed_processes``, torch on one thread) on a
Unix socket pair: a request is a batch of (config, training count); its answer is the batch's
hashes (pickled) and its arrays' bytes, received in one read; each state's arrays are then copied
into a buffer of the state's own (alive while the state is kept). The child computes with the same functions as
the service (``seed_state.compute_states``): the same bytes (tests/test_seed_processes.py compares
them). A child that is not ready yet (it imports torch as it starts) is not waited for:
``ready`` says so and the caller computes in its own thread meanwhile; one that died raises
``SeedProcessGone`` and is not used again.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from .seed_state import SeedState

_SIZES = struct.Struct("!QQ")  # a message's header and payload lengths
_ALIGN = 64  # each array's offset in the payload
BATCH_TIMEOUT_S = 60.0  # a batch's answer stalled this long: the child is taken for hung


class SeedProcessGone(RuntimeError):
    """The child exited or its socket failed: its batch was not computed."""


class SeedProcess:
    """One child computing seed states for one caller at a time (``states`` holds a lock)."""

    def __init__(self, batch_timeout_s: float = BATCH_TIMEOUT_S) -> None:
        """``batch_timeout_s``: the longest a batch's answer may stall (the kernel's receive
        timeout, SO_RCVTIMEO: the socket stays blocking, one wait a read); past it the child is
        taken for hung, ended, and not used again."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        seconds = int(batch_timeout_s)
        parent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                          struct.pack("ll", seconds, int((batch_timeout_s - seconds) * 1e6)))
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)  # where `learner` is, installed or not
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            self.process = subprocess.Popen([sys.executable, "-m", "learner.seed_processes", str(child.fileno())],
                                            pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
        finally:
            child.close()
        self._sock = parent
        self._lock = threading.Lock()
        self._ready = False
        self.gone = False
        self.batches = self.states_computed = 0

    @property
    def ready(self) -> bool:
        """Whether the child has started (its imports done); never blocks."""
        if self._ready or self.gone:
            return self._ready and not self.gone
        with self._lock:
            try:
                got = self._sock.recv(1, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            except OSError:
                got = b""
            if got != b"R":
                self.gone = True
                return False
            self._ready = True
        return True

    def states(self, wanted: list[tuple]) -> list:
        """The states of ``wanted`` ((config, training count) pairs), in order: a list of
        ``SeedState`` (learner/seed_state.py). Raises ``SeedProcessGone`` if the child is gone."""
        with self._lock:
            if self.gone:
                raise SeedProcessGone("the seed-state process is gone")
            try:
                request = pickle.dumps([(config, int(rows)) for config, rows in wanted])
                self._sock.sendall(_SIZES.pack(len(request), 0) + request)
                header_len, payload_len = _SIZES.unpack(_recv_exactly(self._sock, _SIZES.size))
                header = pickle.loads(_recv_exactly(self._sock, header_len))
                payload = _recv_exactly(self._sock, payload_len)
            except (OSError, EOFError, pickle.UnpicklingError, struct.error) as exc:
                self.gone = True
                self.process.kill()  # (a hung child's answer must not arrive later, mid-message)
                raise SeedProcessGone(f"the seed-state process failed: {exc!r}") from exc
            if isinstance(header, BaseException):  # the child's own error for this batch
                raise header
            if len(header) != len(wanted):  # (a protocol bug: never pair states by guess)
                self.gone = True
                self.process.kill()
                raise SeedProcessGone(f"the seed-state process answered {len(header)} states for {len(wanted)}")
            self.batches += 1
            self.states_computed += len(header)
        out, view = [], memoryview(payload)
        for initial_sha, perm_sha, initial_specs, perm_specs in header:
            # each state in memory of its own (a copy, the GIL held: no wait to take it back), so
            # that the cache's bound counts what it keeps -- a view on the batch's buffer would keep
            # the whole batch alive for one state
            start = min(offset for _, _, offset in initial_specs + perm_specs)
            end = max(offset + _nbytes(dtype, shape) for dtype, shape, offset in initial_specs + perm_specs)
            own = bytearray(view[start:end])
            initial = [_view(own, (dtype, shape, offset - start)) for dtype, shape, offset in initial_specs]
            permutations = [_view(own, (dtype, shape, offset - start)) for dtype, shape, offset in perm_specs]
            out.append(SeedState(initial, permutations, initial_sha, perm_sha))
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """End the child: its socket closed, it exits (killed after ``timeout_s``)."""
        with self._lock:
            self.gone = True
            try:
                self._sock.close()
            except OSError:
                pass
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class SeedProcesses:
    """``count`` seed-state processes (REV88_SEED_PROCESSES), started by ``start``; ``take`` lends
    one that is ready and idle (``give`` it back), ``wait_ready`` waits for their start."""

    def __init__(self, count: int, batch_timeout_s: float = BATCH_TIMEOUT_S) -> None:
        self.count, self.batch_timeout_s = int(count), batch_timeout_s
        self.processes: list[SeedProcess] = []
        self._idle: list[SeedProcess] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            while len(self.processes) < self.count:
                process = SeedProcess(self.batch_timeout_s)
                self.processes.append(process)
                self._idle.append(process)

    def wait_ready(self, timeout_s: float) -> int:
        """How many are ready, waiting up to ``timeout_s`` for the others (a child that exits is not)."""
        deadline = time.monotonic() + timeout_s
        for process in list(self.processes):
            while not process.ready and not process.gone and process.process.poll() is None \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
        return sum(1 for p in self.processes if p.ready)

    def take(self) -> SeedProcess | None:
        """A ready, idle process (lent until ``give``), or None."""
        with self._lock:
            for process in self._idle:
                if process.ready:
                    self._idle.remove(process)
                    return process
        return None

    def give(self, process: SeedProcess) -> None:
        with self._lock:
            if not process.gone:
                self._idle.append(process)

    def snapshot(self) -> dict:
        return {"processes": self.count, "ready": sum(1 for p in self.processes if p.ready),
                "states": sum(p.states_computed for p in self.processes)}

    def close(self) -> None:
        with self._lock:
            processes, self._idle = list(self.processes), []
        for process in processes:
            process.close()


def _recv_exactly(sock: socket.socket, size: int) -> bytearray:
    """``size`` bytes, read with MSG_WAITALL (one wait, not one per socket buffer)."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
        if n == 0:
            raise EOFError("the seed-state process closed its socket")
        got += n
    return buf


def _nbytes(dtype: str, shape: tuple) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _view(payload: bytearray, spec: tuple) -> np.ndarray:
    dtype, shape, offset = spec
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(payload, dtype=np.dtype(dtype), count=count, offset=offset).reshape(shape)


def _pack(states: list) -> tuple[bytes, bytearray]:
    """(header, payload) of computed states: each array's bytes at an aligned offset."""
    specs, arrays, offset = [], [], 0
    for state in states:
        entry = []
        for group in (state.initial, state.permutations):
            group_specs = []
            for arr in group:
                arr = np.ascontiguousarray(arr)
                group_specs.append((arr.dtype.str, arr.shape, offset))
                arrays.append((offset, arr))
                offset += -(-arr.nbytes // _ALIGN) * _ALIGN
            entry.append(group_specs)
        specs.append((state.initial_sha256, state.permutation_sha256, entry[0], entry[1]))
    payload = bytearray(offset)
    for at, arr in arrays:
        payload[at:at + arr.nbytes] = arr.reshape(-1).view(np.uint8).data
    return pickle.dumps(specs), payload


def _serve(fd: int) -> None:
    """The child: states for each request until its socket closes (its parent's close or exit:
    a Ctrl-C at a terminal, sent to the whole group, is the parent's to act on)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    torch.set_num_threads(1)
    from . import seed_state, train  # noqa: F401 - (train binds the cache's functions)
    from .config import Config

    seed_state.compute_state(Config(), 10)  # torch's and numpy's first calls, before any request
    sock = socket.socket(fileno=fd)
    sock.sendall(b"R")
    while True:
        try:
            header_len, _ = _SIZES.unpack(_recv_exactly(sock, _SIZES.size))
            wanted = pickle.loads(_recv_exactly(sock, header_len))
        except (EOFError, OSError):
            return
        try:
            header, payload = _pack(seed_state.compute_states(wanted))
        except Exception as exc:  # noqa: BLE001 - the batch's error, raised in the caller
            header, payload = pickle.dumps(exc), bytearray()
        try:
            sock.sendall(_SIZES.pack(len(header), len(payload)) + header)
            sock.sendall(payload)
        except OSError:
            return


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
