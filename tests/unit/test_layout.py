"""The package's floors read top to bottom (docs/INTERNALS.md, "Layout"): every import between
the top-level parts of `pdserve` goes down the table below, no module imports another in a
circle, and the lab (`benchmarks/`) is outside the package: nothing in it is imported by
`pdserve`. Every import counts, also one inside a function or under TYPE_CHECKING.

`tests/unit/test_router_layout.py` holds the router's own directions between its sub-packages.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pdserve

SRC = Path(pdserve.__file__).parent  # src/pdserve
REPO = SRC.parents[1]

# Floors, from the ground up: a part may import the parts of the floors below its own, never
# a part of its own floor or above. (Within a part, the part's own modules are free.)
FLOORS: list[set[str]] = [
    {"v1", "config", "logging", "errors", "dtypes"},  # plumbing with no pdserve imports
    {"rpc", "client", "load"},  # gRPC lifecycle and security; the SDK
    {"kv"},  # KV spec, hashing, block pool, cache manager, UCX transfer, kvstore client
    {"model"},  # model families, loader, attention and linear kernels
    {"engine", "kvstore"},  # the engine; the kvstore service
    {"costmodel"},  # what steps, transfers and copies cost (sim and emulate share it)
    {"emulate", "router"},  # the emulated engine; the router service
    {"worker", "workload"},  # the worker service; workloads and their scoring
    {"launcher"},  # a whole deployment as local processes
    {"bench", "supervisor"},  # user-facing benchmarks; the supervisor of `pdserve up`
    {"sim"},  # the simulator and `plan`
    {"cli"},  # the command line, on top of everything
]
FLOOR = {part: i for i, parts in enumerate(FLOORS) for part in parts}
SERVICES = {"router", "worker", "kvstore", "engine", "kv", "model", "rpc", "emulate"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO / "src" if path.is_relative_to(SRC) else REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> Iterator[Path]:
    yield from SRC.rglob("*.py")
    yield from (REPO / "benchmarks").rglob("*.py")


def _imports(path: Path, known: set[str], source: str | None = None) -> set[str]:
    """Every module of `known` that `path` (or `source`, read as if it were `path`) imports
    (`from a import b`: a.b when that is a module, else a)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([node.module] if node.module else [])])
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for t in targets:
            while t and t not in known:  # a name inside a module: the module
                t = t.rpartition(".")[0]
            if t and t != me:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    paths = list(_sources())
    known = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, known) for p in paths}


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "pdserve" and len(parts) > 1 else None


def test_every_part_has_a_floor() -> None:
    parts = {p.stem if p.is_file() else p.name for p in SRC.iterdir()}
    parts = {p for p in parts if not p.startswith(("__", ".")) and p not in ("py", "pdserve")}
    parts.discard("py.typed")
    assert parts <= set(FLOOR), f"parts without a floor in FLOORS: {parts - set(FLOOR)}"


def test_imports_go_down_the_floors() -> None:
    bad = []
    for module, targets in _graph().items():
        me = _part(module)
        if me is None:
            continue
        for t in targets:
            other = _part(t)
            if other is not None and other != me and FLOOR[other] >= FLOOR[me]:
                bad.append(f"{module} ({me}, floor {FLOOR[me]}) imports {t} (floor {FLOOR[other]})")
    assert not bad, "\n".join(sorted(bad))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    """So that the test above can fail."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_the_floor_check_sees_an_upward_import() -> None:
    """`kv` importing `model` (a floor above it) is caught by the direction test."""
    path = SRC / "kv" / "spec.py"
    known = {_module_name(p) for p in _sources()}
    source = path.read_text() + "\nfrom pdserve.model.config import ModelConfig\n"
    targets = _imports(path, known, source)
    assert "pdserve.model.config" in targets
    assert FLOOR[_part("pdserve.model.config")] > FLOOR["kv"]


def test_no_library_imports_the_cli_and_no_service_imports_the_launcher() -> None:
    bad = []
    for module, targets in _graph().items():
        me = _part(module)
        if me is None:  # benchmarks/: the lab may use anything
            continue
        for t in targets:
            if _part(t) == "cli" and me != "cli":
                bad.append(f"{module} imports the CLI ({t})")
            if _part(t) in ("launcher", "supervisor") and me in SERVICES:
                bad.append(f"service module {module} imports {t}")
    assert not bad, "\n".join(bad)


def test_the_package_never_imports_the_lab() -> None:
    bad = [
        f"{m} imports {t}"
        for m, targets in _graph().items()
        if m.startswith("pdserve")
        for t in targets
        if t.startswith("benchmarks")
    ]
    assert not bad, bad
