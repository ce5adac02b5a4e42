"""The compose deployment built and run for real (deploy/smoke.py): slow, and skipped where no
Docker engine can run. `make test-compose` runs it; `make test` does not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _docker_can_run() -> str | None:
    """Why Docker cannot run here, or None when it can (a daemon answers, or we may start one)."""
    if shutil.which("docker") is None:
        return "no docker client (apt-get install -y docker.io)"
    if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return None
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        return "no Docker daemon answers, and this user cannot start dockerd"
    return None


def _smoke(*extra: str) -> None:
    reason = _docker_can_run()
    if reason is not None:
        pytest.skip(reason)
    # --local: the images deploy/local-images.sh makes, for machines without Docker Hub
    local = os.environ.get("PREFIXRAG_COMPOSE_LOCAL", "1") == "1"
    args = [sys.executable, str(REPO / "deploy" / "smoke.py"), *(["--local"] if local else [])]
    subprocess.run([*args, *extra], check=True, timeout=3000, cwd=REPO)


def test_compose_deployment_smoke() -> None:
    _smoke()


def test_ray_profile_comes_up_with_two_replicas() -> None:
    _smoke("--ray")
