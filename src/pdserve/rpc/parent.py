"""A service started by `pdserve up` (pdserve.launcher) exits with its launcher."""

from __future__ import annotations

import os
import signal

PARENT_PID_ENV = "PDSERVE_PARENT_PID"  # set for the children: see die_with_parent()


def die_with_parent() -> None:
    """In a service started by the launcher (env PDSERVE_PARENT_PID): ask the kernel for
    SIGTERM when the launcher dies, even by SIGKILL, so a killed `pdserve up` never leaves
    orphan services behind; exit at once if it is already gone. Called by every service at
    start (pdserve.rpc.server.serve). Linux only; elsewhere a no-op.

    Done in the child after exec rather than in a `preexec_fn`: running Python between fork
    and exec is unsafe in a multi-threaded parent (the supervisor thread of a test process
    with torch and gRPC threads crashed that way now and then)."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent:
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the launcher died before prctl: we are an orphan
        os._exit(0)
