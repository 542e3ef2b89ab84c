"""A private `redis-server` on a free port, for the local runner and the tests."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from prorsa.local.processes import Child, free_port


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None, persist: bool = False) -> None:
        """`persist`: an append-only file, so a restarted server keeps its data."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(
                "redis-server not found: install it (Debian: apt-get install redis-server) "
                "or pass the URL of a running Redis"
            )
        self.port = port or free_port()
        self.workdir = workdir
        self.child = Child(
            "redis",
            [
                binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "yes" if persist else "no",
                "--appendfsync", "everysec", "--dir", str(workdir),
            ],
            workdir / "redis.log",
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.child.start()
        self.child.wait_until(self._answers, 20, "PONG")
        return self

    def stop(self) -> None:
        self.child.stop(5)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
