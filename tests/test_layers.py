"""Data flows one way (../shared/ARCHITECTURE.md, docs/development.md "Layout"): a module imports
only modules of its own layer or below, and no modules import each other in a circle. Read
from the source's import statements (those under TYPE_CHECKING too), so a new arrow that runs
back up fails here, not in a review."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "speccli"

# Lowest first. A room is a top-level module or package of speccli.
LAYERS = [
    {"errors", "config", "context", "events", "backends"},  # settings, what the loop yields, model backends
    {"text", "coupling", "stats", "prompts", "autok", "verify", "tree", "drafters"},  # the method, no I/O
    {"loop", "models"},  # the decode loop; names to loaded models
    {"api", "calibration"},  # the one way to generate; pass costs measured and kept
    {"pipeline", "chat", "bench", "heads"},  # a loaded pair; each command's logic, no terminal
    {"ui", "serve", "cli"},  # what a person or a client meets
]
RANK = {room: rank for rank, rooms in enumerate(LAYERS) for room in rooms}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """speccli module -> the speccli modules it imports."""
    found: dict[str, set[str]] = defaultdict(set)
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                if target in modules and target != name and target.startswith("speccli."):
                    found[name].add(target)
    return found


def room(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def test_every_room_has_a_layer():
    rooms = {room(module_name(path)) for path in PACKAGE.rglob("*.py")} - {"speccli", "__init__"}
    assert rooms - RANK.keys() == set(), "give each new module or package a layer in LAYERS"


def test_no_import_runs_back_up():
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in imports().items()
        for target in targets
        if RANK[room(target)] > RANK[room(source)]
    )
    assert upward == []


def test_no_modules_import_each_other_in_a_circle():
    graph = imports()
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    circles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                circles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []
