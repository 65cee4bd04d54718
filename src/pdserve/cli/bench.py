"""`pdserve bench <tool>`: dispatcher for the benchmark tools. Each tool is a module
`pdserve.bench.<name>` exposing `add_parser(subparsers)` (which sets `func`), imported here
only when the command line is built; tools not present (yet) are skipped."""

from __future__ import annotations

import importlib
from typing import Any

TOOLS = (
    "engine",
    "transfer",
    "serve",
    "compare",
    "multiturn",
    "admission",
    "rescore",
    "frontdoor",
    "tls",
    "emulated_lag",
    "router_saturation",
)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="benchmarks: " + ", ".join(TOOLS))
    tools = p.add_subparsers(dest="bench_tool", required=True, metavar="TOOL")
    for name in TOOLS:
        module_name = f"pdserve.bench.{name}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:  # a tool still being written
            if exc.name != module_name:
                raise
            continue
        if hasattr(module, "add_parser"):
            module.add_parser(tools)
