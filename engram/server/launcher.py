"""A real `engram serve` subprocess on 127.0.0.1 and a free port, for tests and load benches:
``wait_ready()`` returns once /health answers 200, ``stop()`` sends SIGTERM and waits. Logs at warning level unless
``args`` name a --log-level.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], cache_dir: Path | None, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if cache_dir is not None:
            env["ENGRAM_CACHE_DIR"] = str(cache_dir)
        self.log_path = log_path
        self._log = open(log_path, "w")
        quiet = [] if "--log-level" in args else ["--log-level", "warning"]
        self.proc = subprocess.Popen([sys.executable, "-m", "engram.cli", "serve", *args, "--port", str(self.port),
                                      *quiet], env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 180.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def __enter__(self) -> "ServerProcess":
        """``with ServerProcess(...) as s``: ready (``wait_ready``) inside the block, stopped after it."""
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def metric(url: str, name: str, labels: str = "") -> float:
    """Value of one sample on /metrics (0.0 when absent)."""
    text = httpx.get(url + "/metrics").text
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0
