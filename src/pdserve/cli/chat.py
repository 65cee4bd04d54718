"""`pdserve chat`: an interactive multi-turn session on ChatSession. Reads lines
from stdin until EOF or /exit (works with a pipe), streams each reply."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="interactive multi-turn chat with a running router")
    p.add_argument("--addr", default="127.0.0.1:50051", help="router HOST:PORT")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="per reply (default: the router's, clamped to the context left)",
    )
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--timeout", type=float, default=None, help="per-turn deadline, seconds")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.client import ChatSession, Client, PdserveClientError

    interactive = sys.stdin.isatty()
    out = sys.stdout
    with Client(args.addr, timeout=args.timeout) as client:
        session = ChatSession(
            client, system=args.system, max_tokens=args.max_tokens, temperature=args.temperature
        )
        while True:
            if interactive:
                out.write("> ")
                out.flush()
            line = sys.stdin.readline()
            if not line:
                break  # EOF
            text = line.rstrip("\n")
            if text.strip() == "/exit":
                break
            if not text.strip():
                continue
            try:
                for ev in session.stream(text):
                    out.write(ev.text)
                    out.flush()
            except PdserveClientError as exc:
                print(f"\nerror: {type(exc).__name__}: {exc.message}", file=sys.stderr)
                return 1
            out.write("\n")
            out.flush()
    return 0
