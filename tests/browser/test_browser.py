"""The web page end to end: a real server with the LLM, driven in Debian's chromium.

The browser part is tests/browser/run.mjs (playwright-core); this test starts the server on a
free loopback port with a temporary data dir, runs the script, and keeps its screenshot and the
server log in test-output/browser/.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
OUTPUT_DIR = REPO / "test-output" / "browser"
# Converted model weights outlive the temporary data dir, so only the first run pays for them.
MODEL_CACHE = REPO / "test-output" / "model-cache"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
READY_TIMEOUT_S = 300
SCRIPT_TIMEOUT_S = 600

DOCUMENT = (
    "Keeping a lighthouse\n\n"
    "The keeper climbed the spiral stairs every evening at dusk to light the lamp. The lamp "
    "burned paraffin oil and its beam turned once every ten seconds, so that ships could tell "
    "this light from the one on the next headland.\n\n"
    "Each morning the keeper trimmed the wick, polished the great glass lens and wrote the "
    "weather and the passing ships into a leather logbook.\n\n"
    "In winter storms the keeper stayed awake all night, because a stopped lamp could send a "
    "ship onto the rocks below the tower."
)
QUESTION = "What did the keeper write into the logbook?"


def _missing_tools() -> str | None:
    if shutil.which("node") is None or shutil.which("npm") is None:
        return "node and npm are not installed (apt-get install -y nodejs npm)"
    if not Path(CHROMIUM).exists():
        return f"chromium is not installed at {CHROMIUM} (apt-get install -y chromium)"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _install_node_packages() -> None:
    if (HERE / "node_modules" / "playwright-core").is_dir():
        return
    # package-lock.json pins playwright-core, which brings no browser of its own.
    subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=HERE, check=True, timeout=300)


def _share_model_cache(data_dir: Path) -> None:
    # Settings.cache_dir / "models" is where the engine keeps its conversions.
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    (data_dir / "cache").mkdir(parents=True)
    (data_dir / "cache" / "models").symlink_to(MODEL_CACHE, target_is_directory=True)


def _prefixrag() -> str:
    beside_python = Path(sys.executable).parent / "prefixrag"
    found = str(beside_python) if beside_python.exists() else shutil.which("prefixrag")
    if found is None:
        pytest.fail("the prefixrag command is not installed (pip install -e .)")
    return found


def _server_env(data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXRAG_")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PREFIXRAG_DATA_DIR=str(data_dir),
        PREFIXRAG_LOAD_LLM="1",
        PREFIXRAG_KV_CACHE_GB="0.25",
        PREFIXRAG_MAX_NUM_SEQS="4",
        PREFIXRAG_RERANK_MODEL=str(data_dir / "no-such-cross-encoder"),
        PREFIXRAG_INDEX_USE_GPU="no",
    )
    return env


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    """`prefixrag serve` on a free loopback port, ready (LLM loaded); yields its base URL."""
    reason = _missing_tools()
    if reason:
        pytest.skip(reason)
    _install_node_packages()
    port = _free_port()
    OUTPUT_DIR.mkdir(parents=True, exist_ok=True)
    data_dir = tmp_path / "data"
    _share_model_cache(data_dir)
    log_path = OUTPUT_DIR / "server.log"
    command = [_prefixrag(), "serve", "--host", "127.0.0.1", "--port", str(port)]
    # a key makes the server refuse anonymous requests: the page must ask for it
    created = subprocess.run(
        [_prefixrag(), "keys", "create", "--name", "browser"],
        env=_server_env(data_dir),
        capture_output=True,
        text=True,
        check=True,
    )
    (tmp_path / "api-key").write_text(created.stdout.strip())
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, cwd=REPO, env=_server_env(data_dir), stdout=log, stderr=log
        )
        try:
            base_url = f"http://127.0.0.1:{port}"
            _wait_ready(process, base_url, log_path)
            yield base_url
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_ready(process: subprocess.Popen[bytes], base_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{_tail(log_path)}")
        try:
            if httpx.get(f"{base_url}/readyz", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        _wait_exit(process, 0.5)
    pytest.fail(f"the server was not ready in {READY_TIMEOUT_S}s:\n{_tail(log_path)}")


def _wait_exit(process: subprocess.Popen[bytes], seconds: float) -> None:
    # the poll interval, cut short if the server dies
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=seconds)


def _tail(path: Path, num_chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-num_chars:]


def test_upload_ask_and_read_citations_in_chromium(server: str, tmp_path: Path) -> None:
    document = tmp_path / "lighthouse-keeping.txt"
    document.write_text(DOCUMENT)
    screenshot = OUTPUT_DIR / "page.png"
    screenshot.unlink(missing_ok=True)
    result = subprocess.run(
        [
            "node",
            str(HERE / "run.mjs"),
            server,
            str(OUTPUT_DIR),
            str(document),
            QUESTION,
            (tmp_path / "api-key").read_text(),
        ],
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )
    print(result.stdout)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert screenshot.is_file(), "the script saved no screenshot"
    print(f"screenshot: {screenshot}")
