"""The project installs as one import namespace, `prefixrag`, from committed locks.

The layout's folders stay at the repo root, where Python puts the working directory first on
sys.path. They carry no __init__.py, so from the root they are at most empty namespace portions,
and a regular package of the same name (Hugging Face's `kernels`, which transformers imports)
always wins over them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
ROOT_PACKAGES = ("app", "engine", "retrieval", "kernels", "migrations")
# Folders of package data, not code packages.
DATA_FOLDERS = {Path("migrations/versions")}


def read_lock(path: Path) -> dict[str, tuple[Version, list[str]]]:
    """{canonical name: (pinned version, hashes)} of a `uv pip compile --generate-hashes` file."""
    pins: dict[str, tuple[Version, list[str]]] = {}
    name = ""
    for line in path.read_text().splitlines():
        pin = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line)
        if pin:
            name = canonicalize_name(pin.group(1))
            pins[name] = (Version(pin.group(2)), [])
        elif name and (digest := re.search(r"--hash=sha256:([0-9a-f]{64})", line)):
            pins[name][1].append(digest.group(1))
    return pins


def assert_lock_satisfies(lock: dict[str, tuple[Version, list[str]]], deps: list[str]) -> None:
    for dep in deps:
        requirement = Requirement(dep)
        name = canonicalize_name(requirement.name)
        assert name in lock, f"{dep} is in pyproject.toml but not in the lock: run `make lock`"
        version = lock[name][0]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"the lock pins {name}=={version}, which {dep} no longer admits: run `make lock`"
        )


def expand_extras(deps: list[str]) -> list[str]:
    """`deps` with each `prefixrag[extra]` replaced by that extra's own requirements."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    expanded = []
    for dep in deps:
        requirement = Requirement(dep)
        if canonicalize_name(requirement.name) != "prefixrag":
            expanded.append(dep)
            continue
        for extra in sorted(requirement.extras):
            expanded += expand_extras(extras[extra])
    return expanded


def test_locks_match_pyproject_and_carry_hashes() -> None:
    runtime = PYPROJECT["project"]["dependencies"]
    dev = expand_extras(PYPROJECT["project"]["optional-dependencies"]["dev"])
    dev_lock = read_lock(REPO / "requirements-dev.lock")
    lock = read_lock(REPO / "requirements.lock")
    assert_lock_satisfies(dev_lock, runtime + dev)
    assert_lock_satisfies(lock, runtime)
    # Ray is an optional extra the tests use; the service's own lock (the image) goes without it
    assert "ray" in dev_lock and "ray" not in lock
    for name, (version, hashes) in (dev_lock | lock).items():
        assert hashes, f"{name}=={version} has no hash"
    # The image runs what the tests ran: the service's lock is cut from the dev lock.
    for name, (version, _) in lock.items():
        assert dev_lock[name][0] == version, f"{name}: {version} vs dev {dev_lock[name][0]}"


def test_the_ray_lock_is_the_service_plus_ray_at_the_dev_locks_versions() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    dev_lock = read_lock(REPO / "requirements-dev.lock")
    ray_lock = read_lock(REPO / "requirements-ray.lock")
    assert_lock_satisfies(ray_lock, PYPROJECT["project"]["dependencies"] + extras["ray"])
    for name, (version, hashes) in ray_lock.items():
        assert hashes, f"{name}=={version} has no hash"
        assert dev_lock[name][0] == version, f"{name}: {version} vs dev {dev_lock[name][0]}"


def test_models_lock_pins_the_makefiles_models() -> None:
    makefile = (REPO / "Makefile").read_text()
    declared = re.search(r"^MODELS := (.+)$", makefile, re.MULTILINE)
    assert declared is not None
    models = read_lock(REPO / "models.lock")
    pinned = {f"{name}=={version}" for name, (version, _) in models.items()}
    assert pinned == set(declared.group(1).split())
    assert all(hashes for _, hashes in models.values())


def test_package_list_names_every_code_folder() -> None:
    tool = PYPROJECT["tool"]["setuptools"]
    mapped = {Path(folder): name for name, folder in tool["package-dir"].items()}
    assert set(mapped) == {Path(root) for root in ROOT_PACKAGES}
    expected = set()
    for root in ROOT_PACKAGES:
        assert not (REPO / root / "__init__.py").exists(), (
            f"{root}/__init__.py would make the repo root's {root}/ shadow installed packages"
        )
        for source in (REPO / root).rglob("*.py"):
            folder = source.parent.relative_to(REPO)
            if folder not in DATA_FOLDERS:
                rest = folder.relative_to(root).parts
                expected.add(".".join((mapped[Path(root)], *rest)))
    assert set(tool["packages"]) == expected


# Run from the repo root, with the root first on sys.path as `python -c` and `python -m` put it.
SAME_PROCESS = """
import importlib.util, pathlib, sys
repo = pathlib.Path.cwd().resolve()
import transformers.activations  # imports Hugging Face's `kernels` when it is installed
import kernels
assert pathlib.Path(kernels.__file__).resolve().parent != repo / "kernels", kernels.__file__
from prefixrag.kernels import rms_norm
assert pathlib.Path(rms_norm.__file__).resolve().parent == repo / "kernels"
for name in {names!r}:
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.origin is not None:  # a namespace portion has no origin
        assert pathlib.Path(spec.origin).resolve().parent != repo / name, (name, spec.origin)
from prefixrag.app.core.settings import packaged_embedder_path
from prefixrag.retrieval.embedder import Embedder
vectors = Embedder(packaged_embedder_path(), device="cpu").encode(["where is the key?"])
print(kernels.__name__, vectors.shape)
"""


def test_transformers_kernels_and_ours_load_together_from_the_repo_root() -> None:
    pytest.importorskip("kernels", reason="transformers no longer pulls in hub kernels")
    code = SAME_PROCESS.format(names=ROOT_PACKAGES)
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["(1,", "384)"]


def dockerfile_pip_steps(dockerfile: str) -> list[str]:
    """The Dockerfile's RUN steps that install Python packages, continuation lines joined."""
    # Docker drops comment lines inside a continued instruction: so must we, before joining.
    lines = [line for line in dockerfile.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    steps = [line[len("RUN ") :] for line in joined.splitlines() if line.startswith("RUN ")]
    return [step for step in steps if "pip install" in step]


@pytest.mark.slow
def test_the_images_install_works_alone_outside_the_repo(tmp_path: Path) -> None:
    """The Docker image's own pip steps, in a fresh venv, used from a folder outside the repo."""
    steps = dockerfile_pip_steps((REPO / "Dockerfile").read_text())
    # The first step takes torch from the PyTorch index, which this machine can't reach: the same
    # pin comes from pip's configured sources instead.
    assert "TORCH_INDEX_URL" in steps[0]
    steps = [f"pip install torch=={torch_pin()}", *steps[1:]]
    workdir = tmp_path / "srv"
    workdir.mkdir()
    for name in (
        "requirements.lock",
        "requirements-ray.lock",
        "models.lock",
        "pyproject.toml",
        "README.md",
    ):
        (workdir / name).write_bytes((REPO / name).read_bytes())
    for root in ROOT_PACKAGES:
        subprocess.run(["cp", "-r", str(REPO / root), str(workdir / root)], check=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env |= {"PATH": f"{venv / 'bin'}:{env['PATH']}", "EXTRAS": "", "WHEELHOUSE": ""}
    for step in steps:
        run = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", step],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert run.returncode == 0, f"{step}\n{run.stderr[-3000:]}"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    check = textwrap.dedent(
        f"""
        import importlib.metadata as md, importlib.util
        owners = {{}}
        for dist in md.distributions():
            for top in {{f.parts[0] for f in dist.files or () if len(f.parts) > 1 or
                         f.suffix == ".py"}}:
                if not top.endswith((".dist-info", ".data")) and top not in ("..", "__pycache__"):
                    owners.setdefault(top.removesuffix(".py"), set()).add(dist.metadata["Name"])
        ours = {{top for top, names in owners.items() if "prefixrag" in names}}
        assert ours == {{"prefixrag"}}, ours
        assert owners["prefixrag"] == {{"prefixrag"}}, owners["prefixrag"]
        for name in {ROOT_PACKAGES!r}:
            assert name == "kernels" or importlib.util.find_spec(name) is None, name
        import transformers.activations, kernels
        import prefixrag.kernels.rms_norm, prefixrag.app.main
        print("ok", kernels.__name__)
        """
    )
    python = str(venv / "bin" / "python")
    result = subprocess.run(
        [python, "-c", check], cwd=outside, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ok", "kernels"]
    cli = subprocess.run(
        [str(venv / "bin" / "prefixrag"), "--help"],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "models" in cli.stdout and "serve" in cli.stdout


def torch_pin() -> str:
    torch = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    return torch.removeprefix("torch==")
