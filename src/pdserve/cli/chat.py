"""`pdserve chat`: an interactive multi-turn session on ChatSession. Streams each reply.

In a terminal: line editing and history (readline); Ctrl-C during a reply cancels it (the
request is cancelled on the router, the turn is not kept, the session goes on); Ctrl-C at
the prompt after that, or Ctrl-D, exits cleanly. Lines starting with `/` are commands and
never reach the model (`//text` sends `/text`). Also works with a pipe (reads lines to EOF).
"""

from __future__ import annotations

import argparse
import sys
from contextlib import closing
from dataclasses import dataclass
from typing import TextIO

HELP = """commands:
  /help    this text
  /reset   forget the conversation (new session; the system prompt stays)
  /stats   tokens per turn: prompt, cached (KV reused), completion, time to first token
  /exit    leave (also Ctrl-D, or Ctrl-C twice)
  //text   send "/text" to the model
Ctrl-C while a reply streams cancels it and keeps the session."""


@dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="interactive multi-turn chat with a running router")
    p.add_argument(
        "--addr", default="127.0.0.1:50051", help="router HOST:PORT, or several replicas a:1,b:2"
    )
    p.add_argument(
        "--api-key", default=None, help="API key (default: $PDSERVE_CLIENT_API_KEY, if set)"
    )
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


def format_stats(turns: list[Turn]) -> str:
    if not turns:
        return "no turns yet"
    lines = ["turn  prompt  cached  completion  ttft_ms"]
    for i, t in enumerate(turns, 1):
        lines.append(
            f"{i:>4}  {t.prompt_tokens:>6}  {t.cached_tokens:>6}  {t.completion_tokens:>10}  "
            f"{t.ttft_ms:>7.1f}"
        )
    return "\n".join(lines)


class ChatLoop:
    def __init__(self, session, out: TextIO, err: TextIO, interactive: bool) -> None:
        self.session, self.out, self.err, self.interactive = session, out, err, interactive
        self.turns: list[Turn] = []
        self._interrupted = False  # the last thing that happened was a Ctrl-C

    def read(self) -> str | None:
        """One input line; None = leave (EOF, or Ctrl-C right after a Ctrl-C)."""
        while True:
            try:
                line = input("> ") if self.interactive else sys.stdin.readline()
            except EOFError:
                return None
            except KeyboardInterrupt:
                if self._interrupted:
                    return None
                self._interrupted = True
                self.err.write("\n(Ctrl-C again or Ctrl-D to exit)\n")
                self.err.flush()
                continue
            if not self.interactive and not line:
                return None
            self._interrupted = False
            return line.rstrip("\n")

    def command(self, text: str) -> bool:
        """Handle a /command; False = exit."""
        cmd = text.split()[0].lower()
        if cmd in ("/exit", "/quit"):
            return False
        if cmd == "/help":
            print(HELP, file=self.out)
        elif cmd == "/reset":
            self.session.reset()
            self.turns.clear()
            print("(conversation reset)", file=self.out)
        elif cmd == "/stats":
            print(format_stats(self.turns), file=self.out)
        else:
            print(f"unknown command {cmd}; /help lists them", file=self.err)
        return True

    def reply(self, text: str) -> None:
        usage = None
        try:
            # closing(): on Ctrl-C the call is cancelled here, not whenever the generator is
            # collected (where a second Ctrl-C would be swallowed as "Exception ignored")
            with closing(self.session.stream(text)) as events:
                for ev in events:
                    self.out.write(ev.text)
                    self.out.flush()
                    usage = ev.usage or usage
        except KeyboardInterrupt:
            self._interrupted = True
            self.out.write("\n")
            self.err.write("[reply cancelled; the turn is not kept]\n")
            self.err.flush()
            return
        self.out.write("\n")
        self.out.flush()
        if usage is not None:
            self.turns.append(
                Turn(
                    usage.prompt_tokens,
                    usage.cached_tokens,
                    usage.completion_tokens,
                    usage.ttft_ms,
                )
            )

    def run(self) -> int:
        while True:
            try:
                step = self._step()
            except KeyboardInterrupt:  # between reading and streaming: like one at the prompt
                if self._interrupted:
                    return 0
                self._interrupted = True
                self.err.write("\n(Ctrl-C again or Ctrl-D to exit)\n")
                self.err.flush()
                continue
            if step is not None:
                return step

    def _step(self) -> int | None:
        """One prompt and its reply; an exit status to leave."""
        from pdserve.client import InvalidArgument, ResourceExhausted

        line = self.read()
        if line is None:
            if self.interactive:
                self.out.write("\n")
            return 0
        text = line.strip()
        if not text:
            return None
        if text.startswith("/") and not text.startswith("//"):
            return None if self.command(text) else 0
        if text.startswith("//"):
            text = text[1:]
        try:
            self.reply(text)
        except (InvalidArgument, ResourceExhausted) as exc:  # this turn only
            print(f"\nerror: {type(exc).__name__}: {exc.message}", file=self.err)
        return None


def _readline() -> None:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # e.g. Windows
        pass


def run(args: argparse.Namespace) -> int:
    from pdserve.client import ChatSession, Client, PdserveClientError, Unavailable

    from .interrupt import InterruptGuard

    interactive = sys.stdin.isatty()
    if interactive:
        _readline()
    try:
        with Client(args.addr, timeout=args.timeout, api_key=args.api_key) as client:
            try:
                status = client.status(timeout=5.0)  # fail fast, in one line, when it is down
            except Unavailable as exc:
                print(
                    f"error: cannot reach the router at {args.addr}: {exc.message}",
                    file=sys.stderr,
                )
                return 1
            session = ChatSession(
                client,
                system=args.system,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
            )
            if interactive:
                print(
                    f"pdserve chat: {status.model or 'model'} at {args.addr}; /help for commands",
                    file=sys.stderr,
                )
            with InterruptGuard():  # no Ctrl-C is lost while the main thread blocks
                return ChatLoop(session, sys.stdout, sys.stderr, interactive).run()
    except PdserveClientError as exc:
        print(f"error: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
