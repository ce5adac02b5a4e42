"""Who may import whom, read from the source: every import counts, lazy ones and those under
TYPE_CHECKING included, since those are exactly where loops and upward imports hide.

- retrieval/ imports nothing of ours; kernels/ nothing of ours; engine/ only kernels/;
  migrations/ only app's core (the ORM models and settings).
- Inside app/, each layer imports only the layers below it (DESIGN.md):
  main > api, cli > startup, state > services > prompt, replicas > schemas > core.
- No import loop among our modules, and no route module imports another.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "engine", "retrieval", "kernels", "migrations")
# The packages of ours each package may import (itself always).
ALLOWED_PACKAGES = {
    "app": {"app", "engine", "retrieval"},
    "engine": {"engine", "kernels"},
    "retrieval": {"retrieval"},
    "kernels": {"kernels"},
    "migrations": {"migrations", "app"},
}
# app's layers, bottom up; a module imports only from its own layer and those below.
APP_LAYERS = {
    "core": 0,
    "schemas": 1,
    "prompt": 2,
    "replicas": 2,
    "services": 3,
    "state": 4,
    "startup": 4,
    "api": 5,
    "cli": 5,
    "main": 6,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return "prefixrag." + ".".join(parts)


def our_modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            found[module_name(path)] = path
    return found


MODULES = our_modules()


def imports_of(path: Path) -> Iterator[str]:
    """Every module of ours that `path` imports, at any depth of its code."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import name` may name a submodule: count it when it is one
            names = [node.module]
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name in MODULES:
                yield name


def package_of(module: str) -> str:
    return module.split(".")[1]


def app_layer(module: str) -> str:
    return module.split(".")[2] if module.count(".") >= 2 else ""


def graph() -> dict[str, set[str]]:
    return {module: set(imports_of(path)) - {module} for module, path in MODULES.items()}


GRAPH = graph()


def test_every_module_is_seen() -> None:
    assert "prefixrag.app.main" in MODULES and "prefixrag.engine.scheduler" in MODULES
    assert "prefixrag.app.api.deps" in GRAPH["prefixrag.app.api.routes.query"]


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_only_what_they_may(package: str) -> None:
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        if package_of(module) == package
        for target in targets
        if package_of(target) not in ALLOWED_PACKAGES[package]
    )
    assert not wrong, "\n".join(wrong)


def test_migrations_read_only_apps_core() -> None:
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        if package_of(module) == "migrations"
        for target in targets
        if package_of(target) == "app" and app_layer(target) != "core"
    )
    assert not wrong, "\n".join(wrong)


def test_app_layers_import_only_downwards() -> None:
    app_modules = [m for m in GRAPH if package_of(m) == "app"]
    for module in app_modules:
        assert app_layer(module) in APP_LAYERS, f"{module} sits in no layer of DESIGN.md"
    upward = sorted(
        f"{module} -> {target}"
        for module in app_modules
        for target in GRAPH[module]
        if package_of(target) == "app"
        and _imports_up_or_across(app_layer(module), app_layer(target))
    )
    assert not upward, "\n".join(upward)


def _imports_up_or_across(layer: str, target: str) -> bool:
    if APP_LAYERS[target] > APP_LAYERS[layer]:
        return True
    # Same rank, different rooms (api and cli, state and startup) may not lean on each
    # other, except that startup fills in the state.
    return APP_LAYERS[target] == APP_LAYERS[layer] and layer != target and layer != "startup"


def test_route_modules_do_not_import_each_other() -> None:
    routes = "prefixrag.app.api.routes."
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        if module.startswith(routes)
        for target in targets
        if target.startswith(routes)
    )
    assert not wrong, "\n".join(wrong)


def test_no_import_loops() -> None:
    loops = [component for component in strongly_connected(GRAPH) if len(component) > 1]
    assert not loops, "\n".join(" <-> ".join(sorted(loop)) for loop in loops)


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit to hit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


def test_the_loop_finder_finds_a_loop() -> None:
    found = strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert {"a", "b", "c"} in found and {"d"} in found
