"""The router's tree is its architecture (docs/INTERNALS.md, "Router layout"): at most 8
modules at the top of router/, and imports between its sub-packages go one way only.

    frontdoor -> lifecycle -> scheduling -> cluster.registry
    flip      -> scheduling, cluster
    app.py    -> everything (it wires the planes together)

The front door reaches the cluster only through the lifecycle: it may read the registry
(Status) and nothing else of cluster/. scheduling/ has no gRPC and no protos (the simulator
imports it). Nothing in the router imports the client SDK (pdserve.client).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pdserve.router

ROUTER = Path(pdserve.router.__file__).parent
TOP_LEVEL = {"__init__", "__main__", "app", "settings", "metrics", "job"}

# sub-package -> router parts it may import ("job", "metrics", "settings" are the shared
# top-level modules; "cluster.registry" is a module, "cluster" the whole package).
ALLOWED: dict[str, set[str]] = {
    "cluster": {"job", "cluster"},
    "scheduling": {"job", "scheduling", "cluster.registry"},
    "lifecycle": {"job", "lifecycle", "scheduling", "cluster"},
    "flip": {"flip", "scheduling", "cluster"},
    # (cluster.peers: the router replicas the workers report, read for Status like the registry)
    "frontdoor": {
        "job",
        "metrics",
        "frontdoor",
        "lifecycle",
        "scheduling",
        "cluster.registry",
        "cluster.peers",
    },
    "replicas": {"replicas"},  # the shared store: per-key limits, the flip leader
    "job": set(),
    "metrics": set(),
    "settings": {"scheduling.overload_queue"},  # (its one default)
}
# (module, name) pairs allowed across a boundary the table above closes.
EXCEPTIONS = {("cluster.workers", "cancelled_under_us")}  # an asyncio helper, no gRPC call


def _modules() -> list[Path]:
    return sorted(ROUTER.rglob("*.py"))


def _dotted(path: Path) -> list[str]:
    return list(path.relative_to(ROUTER).with_suffix("").parts)


def _imports(path: Path, source: str | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """(absolute module imported, names) for every import in `path` (or `source`, read as
    if it were `path`)."""
    tree = ast.parse(path.read_text() if source is None else source)
    here = ["pdserve", "router", *_dotted(path)[:-1]]  # the package the file is in
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = tuple(a.name for a in node.names)
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                mod = ".".join([*base, *([node.module] if node.module else [])])
                if not node.module:  # from . import x: x may be a module
                    out += [(f"{mod}.{n}", ()) for n in names]
                    continue
            else:
                mod = node.module or ""
            out.append((mod, names))
    return out


def _part(path: Path) -> str:
    return _dotted(path)[0]  # sub-package, or top-level module name


def test_at_most_eight_modules_at_the_top() -> None:
    top = {p.stem for p in ROUTER.glob("*.py")}
    assert len(top) <= 8, top
    assert top <= TOP_LEVEL, f"new top-level router module(s): {top - TOP_LEVEL}"


def test_import_directions_between_sub_packages() -> None:
    bad = []
    for path in _modules():
        part = _part(path)
        if part in ("app", "__main__", "__init__"):
            continue
        allowed = ALLOWED[part]
        for mod, names in _imports(path):
            if not mod.startswith("pdserve.router."):
                continue
            target = mod.removeprefix("pdserve.router.")
            ok = any(target == a or target.startswith(a + ".") for a in allowed)
            ok = ok or (all((target, n) in EXCEPTIONS for n in names) and bool(names))
            if not ok:
                bad.append(f"{path.relative_to(ROUTER)} imports {target} {names or ''}")
    assert not bad, "\n".join(bad)


def test_nothing_in_the_router_imports_the_client_sdk() -> None:
    bad = [
        f"{p.relative_to(ROUTER)}: {mod}"
        for p in _modules()
        for mod, _ in _imports(p)
        if mod == "pdserve.client" or mod.startswith("pdserve.client.")
    ]
    assert not bad, bad


def test_scheduling_has_no_grpc_and_no_protos() -> None:
    """The simulator imports policies, length scheduling, demand and the predictor."""
    bad = []
    for p in (ROUTER / "scheduling").rglob("*.py"):
        for mod, _ in _imports(p):
            if mod.split(".")[0] == "grpc" or mod.startswith("pdserve.v1"):
                bad.append(f"{p.relative_to(ROUTER)}: {mod}")
    assert not bad, bad


def test_the_checker_sees_a_forbidden_import() -> None:
    """The AST walk resolves relative imports: a frontdoor module reaching into the worker
    clients is caught (so the direction test above can fail)."""
    probe = ROUTER / "frontdoor" / "probe.py"  # never written: parsed from a string
    [(mod, names)] = _imports(probe, "from ..cluster.workers import WorkerClients\n")
    assert (mod, names) == ("pdserve.router.cluster.workers", ("WorkerClients",))
    target = mod.removeprefix("pdserve.router.")
    assert not any(target == a or target.startswith(a + ".") for a in ALLOWED["frontdoor"])
    [(mod, _)] = _imports(ROUTER / "scheduling" / "predictor" / "x.py", "from . import base\n")
    assert mod == "pdserve.router.scheduling.predictor.base"
