"""`pdserve kernels`: the C++ kernels on this machine and what an engine here runs, and why;
`pdserve kernels build`: build them (run by `make setup` and the Dockerfile).

    pdserve kernels [--dtype auto|float32|bfloat16] [--no-batch-invariant] [--json]
    pdserve kernels build [--all] [--force] [--json]

`build` prints one line per kernel (built / cached / falls back, and why) and exits 0 even
without a compiler: the fallback of a kernel that is not built works, and is named.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.model.cpp_ext import BuildResult


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "kernels", help="the C++ kernels here and what an engine runs (build: compile them)"
    )
    p.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
        help="the engine dtype the choice is shown for (auto: what a worker here serves)",
    )  # fmt: skip
    p.add_argument(
        "--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
        help="the engine setting the choice is shown for (default: on)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_show)
    sub = p.add_subparsers(dest="action")
    b = sub.add_parser("build", help="build every kernel this CPU runs (cached; never fails)")
    b.add_argument("--all", action="store_true", help="every ISA variant this CPU runs (tests)")
    b.add_argument("--force", action="store_true", help="rebuild even when cached")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.set_defaults(func=run_build, dtype="auto", batch_invariant=True)


def _selection(args: argparse.Namespace) -> tuple[str, Any]:
    import torch

    from pdserve.model.kernel_settings import KernelSettings
    from pdserve.model.kernels import select_kernels
    from pdserve.model.loader import auto_dtype

    dtype = auto_dtype("cpu") if args.dtype == "auto" else getattr(torch, args.dtype)
    name = str(dtype).removeprefix("torch.")
    where = f"{name}, {'batch-invariant' if args.batch_invariant else 'batch-variant'}"
    return where, select_kernels(KernelSettings.from_env(), dtype, "cpu", args.batch_invariant)


def _header() -> dict[str, str]:
    from pdserve.model.cpp_ext import build_dir, compiler, missing_tool
    from pdserve.model.cpu import CpuFeatures

    return {
        "cpu": CpuFeatures.detect().describe(),
        "compiler": f"none: {missing}" if (missing := missing_tool()) else compiler(),
        "cache": str(build_dir("x", "y").parent),
    }


def run_show(args: argparse.Namespace) -> int:
    from pdserve.model.kernels import ALL, FALLBACK

    rows = []
    for kernel in ALL:
        for variant in kernel.runnable_variants() or [None]:
            st = kernel.status(variant)
            rows.append((kernel.name, variant or "-", st.reason or "loads (prebuilt)"))
    where, sel = _selection(args)
    if args.json:
        kernels = [{"kernel": k, "variant": v, "state": s} for k, v, s in rows]
        out = {**_header(), "kernels": kernels, "engine": where, "summary": sel.summary()}
        print(json.dumps({**out, "choices": vars(sel), "fallbacks": FALLBACK}, indent=2))
        return 0
    head = _header()
    print(f"cpu: {head['cpu']}    compiler: {head['compiler']}    cache: {head['cache']}")
    width = max(len(k) for k, _, _ in rows)
    for k, v, state in rows:
        print(f"  {k:<{width}}  {v:<10}  {state}")
    print(f"an engine here ({where}): {sel.summary()}")
    print(sel.table())
    return 0


def run_build(args: argparse.Namespace) -> int:
    import os
    import threading

    from pdserve.model.kernel_settings import KernelSettings
    from pdserve.model.kernels import FALLBACK, build_all, build_targets

    settings = KernelSettings.from_env()
    targets = build_targets(settings, args.all)
    width = max(len(k.name) for k, _ in targets)
    lock = threading.Lock()

    def line(r: BuildResult) -> None:
        if r.state == "built":
            what = f"built in {r.seconds:.0f} s"
        elif r.state == "cached":
            what = "cached"
        elif r.state == "unsupported":
            what = f"not used here: {r.reason}"
        else:
            what = f"falls back to {FALLBACK[r.kernel]}: {r.reason}"
        with lock:
            print(f"  {r.kernel:<{width}}  {r.variant or '-':<10}  {what}", flush=True)

    head = _header()
    if not args.json:
        print(f"pdserve kernels build: cpu {head['cpu']}; compiler: {head['compiler']}")
        todo = [f"{k.name} ({v})" for k, v in targets if v and (args.force or not k.is_built(v))]
        if todo and not head["compiler"].startswith("none"):
            at_once = min(len(todo), os.cpu_count() or 1)
            print(f"  compiling {len(todo)} ({at_once} at a time, ~30 s of CPU each; cached "
                  f"afterwards): {', '.join(todo)}", flush=True)  # fmt: skip
    results = build_all(settings, args.all, args.force, None if args.json else line)
    where, sel = _selection(args)
    if args.json:
        print(json.dumps({**head, "results": [vars(r) for r in results],
                          "engine": where, "summary": sel.summary()}, indent=2))  # fmt: skip
        return 0
    print(f"an engine here ({where}) runs: {sel.summary()}")
    if sel.warning:
        print(f"  warning: {sel.warning}")
    return 0
