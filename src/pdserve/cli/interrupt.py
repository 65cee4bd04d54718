"""A Ctrl-C that the main thread cannot sleep through.

Why a Ctrl-C can be lost: CPython's C-level SIGINT handler only sets a flag; the Python-level
handler (which raises KeyboardInterrupt) runs when the main thread next executes bytecode, or
when a blocking call returns EINTR. A SIGINT that lands after the thread's last check of the
flag but before it blocks interrupts nothing. At `pdserve chat`'s prompt that window lies in
CPython's readline loop (between its signal check and its select()), so the `^C` is echoed and
then nothing happens until the next key; on a busy machine the window is hit often.

`InterruptGuard` closes it. The C handler also writes each signal's number to a wakeup socket
(`signal.set_wakeup_fd`, from inside the C handler, so it is never lost); the Python SIGINT
handler drains that socket. A watcher thread that finds a SIGINT byte still undrained after
`GRACE_S` knows the main thread sits on a pending Ctrl-C and sends it a "kick": a signal whose
Python handler does nothing. The blocking call returns EINTR, CPython runs the pending
handlers, SIGINT's first, and KeyboardInterrupt is raised where the program expects it. A
spurious kick is harmless (the handler is a no-op and PEP 475 retries the interrupted call).
"""

from __future__ import annotations

import select
import signal
import socket
import threading
import time
from types import FrameType

GRACE_S = 0.05  # a main thread that runs bytecode handles a signal far sooner than this
KICK = signal.SIGUSR1


class InterruptGuard:
    """Context manager; install from the main thread. Does nothing elsewhere."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # the drain (main thread) vs peek/drop (watcher)
        self._stop = threading.Event()
        self._active = False

    def __enter__(self) -> InterruptGuard:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._old_fd = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        self._old_int = signal.signal(signal.SIGINT, self._on_sigint)
        self._old_kick = signal.signal(KICK, _kicked)
        self._main = threading.main_thread().ident
        self._watcher = threading.Thread(target=self._watch, name="sigint-guard", daemon=True)
        self._watcher.start()
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._active:
            return
        self._active = False
        self._stop.set()
        signal.set_wakeup_fd(self._old_fd)
        signal.signal(signal.SIGINT, self._old_int or signal.default_int_handler)
        signal.signal(KICK, self._old_kick or signal.SIG_DFL)
        self._watcher.join(timeout=2)
        self._r.close()
        self._w.close()

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        with self._lock:
            self._drop(-1)
        raise KeyboardInterrupt

    def _drop(self, n: int) -> None:
        """Remove the first n bytes of the wakeup socket (all when n < 0)."""
        while n != 0:
            try:
                got = self._r.recv(4096 if n < 0 else n)
            except (BlockingIOError, OSError):
                return
            if not got:
                return
            n = -1 if n < 0 else n - len(got)

    def _peek(self) -> bytes:
        try:
            return self._r.recv(4096, socket.MSG_PEEK)
        except (BlockingIOError, OSError):
            return b""

    def _watch(self) -> None:
        sigint = bytes([signal.SIGINT])
        while not self._stop.is_set():
            readable, _, _ = select.select([self._r], [], [], 0.5)
            if not readable:
                continue
            with self._lock:
                seen = self._peek()
                if sigint not in seen:  # kicks' and other signals' bytes: not ours to act on
                    self._drop(len(seen))
                    continue
            time.sleep(GRACE_S)
            with self._lock:
                if sigint in self._peek():  # still not handled: the main thread is blocked
                    signal.pthread_kill(self._main, KICK)
            time.sleep(GRACE_S)  # let the kick land before looking again


def _kicked(signum: int, frame: FrameType | None) -> None:
    """The kick's only job is the EINTR it causes."""
