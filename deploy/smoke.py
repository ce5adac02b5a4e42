"""Smoke test of the compose deployment, against real containers:

    python3 deploy/smoke.py [--local] [--ray]
    (--local: docker-compose.local.yml, after local-images.sh; --ray: the Ray profile instead)

Starts dockerd if none answers; `up --build -d` and waits for both health checks; uploads a
document and asks a question with the answer streamed over SSE on 127.0.0.1; restarts the app and
finds the document and its chunk KV disk tier again; stops PostgreSQL and expects 503 (not 500)
from requests and from /readyz, starts it and expects 200 without an app restart; `down -v` and
checks that nothing of the project is left. Standard library only, so it runs on the host's
python3.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT = "prefixrag-smoke"
PORT = int(os.environ.get("APP_PORT", "18000"))
BASE = f"http://127.0.0.1:{PORT}"


def compose_cmd(local: bool, ray: bool = False) -> list[str]:
    """`docker compose` where the plugin is installed, else docker-compose v1."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        cmd = ["docker", "compose"]
    elif shutil.which("docker-compose"):
        cmd = ["docker-compose"]
    else:
        sys.exit("neither `docker compose` nor docker-compose is installed")
    files = ["docker-compose.yml"] + (["docker-compose.ray.yml"] if ray else [])
    files += ["docker-compose.local.yml"] if local else []
    return cmd + ["-p", PROJECT] + [a for f in files for a in ("-f", str(REPO / f))]


def ensure_dockerd() -> None:
    if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return
    log = open("/tmp/prefixrag-dockerd.log", "ab")  # noqa: SIM115 (outlives this function)
    subprocess.Popen(["dockerd"], stdout=log, stderr=log, start_new_session=True)
    wait_for(lambda: subprocess.run(["docker", "info"], capture_output=True).returncode == 0, 60)


def wait_for(check, timeout: float, what: str = "dockerd") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(1)
    raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")


def request(method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(BASE + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=300) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def healthy(compose: list[str], service: str) -> bool:
    cid = subprocess.run([*compose, "ps", "-q", service], capture_output=True, text=True).stdout
    if not cid.strip():
        return False
    state = subprocess.run(
        ["docker", "inspect", "-f", "{{.State.Health.Status}}", cid.strip()],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return state == "healthy"


def ask(question: str) -> str:
    """The answer's text, read from the SSE stream's delta events up to done."""
    body = {"question": question, "stream": True, "max_tokens": 24}
    req = urllib.request.Request(BASE + "/v1/query", data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    text, event = [], ""
    with urllib.request.urlopen(req, timeout=300) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "delta":
                text.append(json.loads(line[6:])["text"])
            elif line.startswith("data: ") and event in ("done", "error"):
                assert event == "done", line
                return "".join(text)
    raise AssertionError("the stream ended without a done event")


def disk_tier_entries() -> float:
    """The chunk KV disk tier's entries, from /metrics (0 when the gauge is absent)."""
    status, body = request("GET", "/metrics")
    assert status == 200, (status, body)
    for line in body.decode().splitlines():
        if line.startswith("prefixrag_chunk_store_entries{") and 'tier="disk"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def assert_nothing_left() -> None:
    # containers, volumes and networks that still carry the project's label
    label = f"label=com.docker.compose.project={PROJECT}"
    left = "".join(
        subprocess.run(
            ["docker", *kind, "-q", "--filter", label], capture_output=True, text=True
        ).stdout
        for kind in (["ps", "-a"], ["volume", "ls"], ["network", "ls"])
    )
    assert not left.strip(), f"left behind: {left}"


def run(local: bool) -> None:
    ensure_dockerd()
    compose = compose_cmd(local)
    env = {**os.environ, "APP_PORT": str(PORT)}
    sh = lambda *a: subprocess.run([*compose, *a], check=True, env=env, cwd=REPO)  # noqa: E731
    try:
        start = time.monotonic()
        sh("build")
        size = subprocess.run(
            ["docker", "image", "inspect", "-f", "{{.Size}}", "prefixrag:latest"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        print(f"built in {time.monotonic() - start:.0f}s; image {int(size) / 2**20:.0f} MiB")
        start = time.monotonic()
        sh("up", "-d")
        wait_for(lambda: healthy(compose, "postgres") and healthy(compose, "app"), 300, "health")
        print(f"up to healthy in {time.monotonic() - start:.0f}s", flush=True)

        doc = {
            "text": "The lighthouse on Vardo island was painted red in 1921. " * 20,
            "title": "lighthouse",
        }
        status, body = request("POST", "/v1/documents?wait=true", doc)
        assert status == 201, (status, body)
        doc_id = json.loads(body)["id"]
        answer = ask("What color was the lighthouse painted?")
        print(f"answer: {answer!r}", flush=True)

        on_disk = disk_tier_entries()
        sh("restart", "app")
        wait_for(lambda: healthy(compose, "app"), 300, "the app after restart")
        status, body = request("GET", f"/v1/documents/{doc_id}")
        assert status == 200, (status, body)
        status, body = request("POST", "/v1/search", {"query": "lighthouse painted red"})
        assert status == 200 and str(doc_id) in body.decode(), (status, body)
        ask("What color was the lighthouse painted?")
        # the disk tier's entries are files on the data volume, found again by the new process
        after = disk_tier_entries()
        print(f"chunk KV disk tier: {on_disk:.0f} entries before the restart, {after:.0f} after")
        assert after >= on_disk

        sh("stop", "postgres")
        status, body = request("GET", "/v1/documents")
        assert status == 503, (status, body)
        print(f"database down: {status} {body.decode()}", flush=True)
        status, body = request("GET", "/readyz")
        assert status == 503 and b'"db":"unavailable' in body, (status, body)
        print(f"/readyz: {status} {body.decode()[:120]}", flush=True)
        sh("start", "postgres")
        wait_for(lambda: healthy(compose, "postgres"), 120, "postgres")
        wait_for(lambda: request("GET", "/v1/documents")[0] == 200, 60, "the app to reconnect")
    finally:
        subprocess.run([*compose, "logs", "--tail", "40", "app"], env=env, cwd=REPO)
        subprocess.run([*compose, "down", "-v"], env=env, cwd=REPO)
    assert_nothing_left()
    print("smoke test passed", flush=True)


def run_ray(local: bool) -> None:
    """The Ray profile: a head and a worker, one engine replica each, and the app joined to
    them; up to healthy, /readyz lists both replicas, a question is answered, down -v."""
    ensure_dockerd()
    compose = compose_cmd(local, ray=True)
    env = {**os.environ, "APP_PORT": str(PORT)}
    sh = lambda *a: subprocess.run([*compose, *a], check=True, env=env, cwd=REPO)  # noqa: E731
    try:
        start = time.monotonic()
        if local:
            # the three services share one image: built once from the local base and wheels
            # (the ray file's build args name no base, so compose itself would pull one)
            build = ["docker", "build", "-t", "prefixrag:ray", "--build-arg", "EXTRAS=ray"]
            build += ["--build-arg", "BASE_IMAGE=local/debian:bookworm"]
            build += ["--build-arg", "WHEELHOUSE=deploy/wheels", "."]
            subprocess.run(build, check=True, cwd=REPO)
        else:
            sh("build")
        print(f"ray image built in {time.monotonic() - start:.0f}s", flush=True)
        start = time.monotonic()
        sh("up", "-d", "--no-build")
        wait_for(lambda: healthy(compose, "app"), 600, "the app and both replicas")
        print(f"ray profile up to healthy in {time.monotonic() - start:.0f}s", flush=True)
        status, body = request("GET", "/readyz")
        assert status == 200, (status, body)
        replicas = json.loads(body)["replicas"]
        print(f"replicas: {[(r.get('name'), r.get('state')) for r in replicas]}", flush=True)
        assert len(replicas) == 2, replicas
        doc = {"text": "The ferry to Hven leaves Landskrona at nine. " * 20, "title": "ferry"}
        status, body = request("POST", "/v1/documents?wait=true", doc)
        assert status == 201, (status, body)
        print(f"answer: {ask('When does the ferry to Hven leave?')!r}", flush=True)
    finally:
        subprocess.run([*compose, "logs", "--tail", "40", "app"], env=env, cwd=REPO)
        subprocess.run([*compose, "down", "-v"], env=env, cwd=REPO)
    assert_nothing_left()
    print("ray smoke test passed", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--local", action="store_true", help="use docker-compose.local.yml")
    parser.add_argument("--ray", action="store_true", help="the Ray profile, 2 replicas")
    args = parser.parse_args()
    (run_ray if args.ray else run)(args.local)
