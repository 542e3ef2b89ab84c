"""Child processes the local runner and the end-to-end tests start, and always stop.

Each child runs in its own session (process group), so stopping it also stops what it started
(a worker agent's vLLM engine). Output goes to a log file whose tail is shown when a child
fails, so a failed start explains itself.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

# Below Linux's ephemeral range (32768-60999 by default), from which the kernel picks ports for
# bind(0): vLLM opens internal sockets that way, so a port of ours taken from that range could be
# handed to a restarting engine's internals in the moment between its old process releasing it
# and its new one binding it (seen: a NIXL side-channel port taken by a new engine's worker).
_OUR_PORTS = (20000, 32000)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, outside the kernel's ephemeral range."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(*_OUR_PORTS)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range is crowded: let the kernel choose
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Child:
    def __init__(
        self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Child:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(self.env or {})},
                start_new_session=True,
            )
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (a worker drains), then SIGKILL the whole group if it lingers."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def wait_until(self, check: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if check():
                return
            if not self.alive:
                raise RuntimeError(f"{self.name} exited while waiting for {what}:\n{self.tail()}")
            time.sleep(0.25)
        raise TimeoutError(f"{self.name}: no {what} after {timeout_s:.0f}s:\n{self.tail()}")
