"""Imports point one way: cli → tools → peer → protocol → (aggregation, security); the simulator and the
tasks sit beside the peer (sim → tasks, aggregation, the sync-policy schedules, the group draw) and never import it.
The tools (launcher, doctor, health client, monitor, bench) run beside peers: nothing but the CLI imports
them, and nothing at all imports the CLI. aggregation imports only torch, numpy, the standard library and
the exception tree at the root (`phalanx.errors`), which imports nothing of the project. No module
imports another that imports it back (directly or through others), and nothing outside the `phalanx`
name is imported as the project's own."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOT_MODULES = ROOT / "phalanx"  # the package root: phalanx.errors, phalanx.cli, phalanx.__main__
PACKAGES = ("peer", "protocol", "aggregation", "security", "sim", "tasks", "tools")
ABOVE = {"phalanx.tools", "phalanx.cli"}  # what only the command line (and, for the tools, nobody) imports
FORBIDDEN = {
    "aggregation": {"phalanx.peer", "phalanx.protocol", "phalanx.security", "phalanx.sim", "phalanx.tasks", *ABOVE, "hivemind", "asyncio", "socket"},
    "security": {"phalanx.peer", "phalanx.protocol", "phalanx.sim", "phalanx.tasks", *ABOVE, "asyncio", "hivemind"},
    "protocol": {"phalanx.peer", "phalanx.sim", "phalanx.tasks", *ABOVE},
    "peer": ABOVE,
    "tasks": {"phalanx.peer", "phalanx.protocol", "phalanx.sim", "phalanx.security", *ABOVE, "hivemind"},
    "sim": {"phalanx.peer", "phalanx.security", *ABOVE, "hivemind"},  # and of protocol only the sync-policy schedules
    "tools": {"phalanx.cli"},
}  # fmt: skip


def _imports(path: Path) -> set[str]:
    """Every absolute import of the file, as `phalanx.<package>` for the project's own and the top-level
    name for the rest (imports inside functions count: a cycle through a lazy import is still a cycle)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        modules = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "phalanx":  # from phalanx import cli
            modules = [f"phalanx.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        for module in modules:
            parts = module.split(".")
            names.add(".".join(parts[:2]) if parts[0] == "phalanx" and len(parts) > 1 else parts[0])
    return names


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "phalanx":  # a root module: phalanx/errors.py is phalanx.errors
        parts.pop(0)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["phalanx", *parts])


def _sources() -> dict[str, Path]:
    paths = [*ROOT_MODULES.glob("*.py"), *(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))]
    return {_module_name(p): p for p in paths}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_point_one_way(package):
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imports(path) & FORBIDDEN[package])
        for path in (ROOT / package).rglob("*.py")
        if _imports(path) & FORBIDDEN[package]
    }
    assert not offenders, f"{package}/ must not import these: {offenders}"


def test_aggregation_imports_only_tensor_libraries_and_the_errors():
    allowed = set(sys.stdlib_module_names) | {"torch", "numpy", "phalanx.aggregation", "phalanx.errors"}
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imports(path) - allowed)
        for path in (ROOT / "aggregation").rglob("*.py")
        if _imports(path) - allowed
    }
    assert not offenders, f"aggregation/ is the bottom layer: {offenders}"


def test_the_errors_import_nothing_of_the_project():
    assert not {n for n in _imports(ROOT_MODULES / "errors.py") if n.startswith("phalanx")}


def test_the_simulator_takes_only_the_sync_policy_schedules_and_the_group_draw_from_the_protocol():
    offenders = {}
    for path in (ROOT / "sim").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("phalanx.protocol"):
                if node.module not in ("phalanx.protocol.sync_policy", "phalanx.protocol.groups"):
                    offenders.setdefault(str(path.relative_to(ROOT)), []).append(node.module)
    assert not offenders, f"sim/ runs no round: {offenders}"


def test_the_project_imports_itself_only_as_phalanx():
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imports(path) & set(PACKAGES))
        for path in _sources().values()
        if _imports(path) & set(PACKAGES)
    }
    assert not offenders, f"import these as phalanx.<name>: {offenders}"


def _edges() -> dict[str, set[str]]:
    """module → the project modules it imports (`from phalanx.x import y` counts x.y when y is a module)."""
    sources = _sources()
    edges: dict[str, set[str]] = {}
    for name, path in sources.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in sources)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in sources:
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(sources)
                targets.update(subs or {node.module})
        edges[name] = targets - {name}
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle, or [] (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    for start in sorted(edges):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(edges[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                stack.append((child, iter(sorted(edges.get(child, ())))))
                path.append(child)
    return []


def test_no_module_imports_itself_back():
    cycle = _cycle(_edges())
    assert not cycle, "import cycle: " + " → ".join(cycle)


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []
