"""`pdserve` command line: a thin dispatcher. Each sub-command lives in its own
module exposing `add_parser(subparsers)`, which sets `func` on its parser.
Modules import heavy dependencies (torch, grpc) inside their functions."""

from __future__ import annotations

import argparse
import importlib
import sys

from pdserve.logging import configure_logging

# sub-command -> module under pdserve.cli
COMMANDS = {
    "up": "up",
    "generate": "generate",
    "chat": "chat",
    "status": "status",
    "bench": "bench",
    "model": "model",
    "certs": "certs",
    "kvstore": "kvstore",
    "profile": "profile",
    "sim": "sim",
    "plan": "plan",
    "predictor": "predictor",
    "kernels": "kernels",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in COMMANDS.values():
        try:
            module = importlib.import_module(f"pdserve.cli.{module_name}")
        except ModuleNotFoundError as exc:  # a module still being written
            if exc.name != f"pdserve.cli.{module_name}":
                raise
            continue
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # library log lines of an in-process command (the attention kernel's build, an engine's
    # warnings) go to stderr, warnings and up only: stdout is the command's output (--json)
    configure_logging("console", level="warning", service="cli")
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
