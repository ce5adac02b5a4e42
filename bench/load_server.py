"""The server under load: a `prefixrag serve` subprocess on a free loopback port, its
readiness, and the resident memory of its process tree."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

MIB = 1024 * 1024
# argv[0] is "-c", so the CLI's argparse sees only the words after it.
_SERVE = "import sys; from prefixrag.app.cli.main import main; sys.exit(main())"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tree_rss_bytes(pid: int) -> int | None:
    """Resident memory of the process and all its children, or None once it has exited."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue  # a child that exited between listing and reading
    return total


class ServerProcess:
    """`prefixrag serve` in a subprocess with its own data dir; output goes to `log_path`."""

    def __init__(self, data_dir: Path, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._env = {**os.environ, **(env or {})}
        self._env["PREFIXRAG_DATA_DIR"] = str(data_dir)
        self._env.setdefault("HF_HUB_OFFLINE", "1")
        self._env.setdefault("TRANSFORMERS_OFFLINE", "1")
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def create_key(self, name: str) -> str:
        """A new API key for tenant `name` in this server's data dir (`prefixrag keys create`):
        from then on the server refuses requests without it."""
        argv = [sys.executable, "-c", _SERVE, "keys", "create", "--name", name]
        done = subprocess.run(argv, env=self._env, capture_output=True, text=True, check=True)
        return done.stdout.strip()

    def start(self) -> None:
        """Launch the server; returns at once (see `wait_ready`)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        argv = [sys.executable, "-c", _SERVE, "serve", "--host", "127.0.0.1"]
        self._proc = subprocess.Popen(
            [*argv, "--port", str(self.port)],
            env=self._env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def is_alive(self) -> bool:
        """True while the subprocess runs."""
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Ask the server to shut down (SIGTERM), kill it after `timeout_s`; its exit code."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()
        return self._proc.returncode

    def log_tail(self, num_chars: int = 4000) -> str:
        """The end of the server's output so far."""
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except FileNotFoundError:
            return ""


def wait_ready(
    url: str, timeout_s: float, headers: dict[str, str], server: ServerProcess | None = None
) -> dict[str, str]:
    """Poll /readyz until it answers 200; its component map. RuntimeError on timeout or death."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if server is not None and not server.is_alive():
            raise RuntimeError(f"the server exited before it was ready:\n{server.log_tail()}")
        try:
            reply = httpx.get(f"{url}/readyz", headers=headers, timeout=5.0)
            if reply.status_code == 200:
                return dict(reply.json().get("components", {}))
            last = f"{reply.status_code} {reply.text[:300]}"
        except httpx.TransportError as exc:
            last = type(exc).__name__
        # NOTE: polling the readiness contract, not waiting out a race.
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not ready after {timeout_s:.0f} s (last: {last})")


@dataclass(slots=True)
class RssSampler:
    """Samples the RSS of a process tree every `interval_s` while `run()` is awaited.

    Each sample is (seconds since the sampler was made, run label, MiB); `label` is what the
    caller is doing now (a run index, or -1 between runs).
    """

    pid: int
    interval_s: float = 0.5
    label: int = -1
    samples: list[tuple[float, int, float]] = field(default_factory=list)
    _t0: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {self.interval_s}")

    def sample(self) -> float | None:
        """Take one sample now; its MiB, or None if the process is gone."""
        rss = tree_rss_bytes(self.pid)
        if rss is None:
            return None
        mib = rss / MIB
        self.samples.append((time.perf_counter() - self._t0, self.label, mib))
        return mib

    async def run(self) -> None:
        """Sample until cancelled or the process exits."""
        while self.sample() is not None:
            await asyncio.sleep(self.interval_s)

    def peak_mib(self, label: int | None = None) -> float | None:
        """The largest sample (of one label, or of all); None without samples."""
        values = [m for _, lab, m in self.samples if label is None or lab == label]
        return max(values) if values else None
