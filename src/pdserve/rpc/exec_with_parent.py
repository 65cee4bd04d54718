"""`python -m pdserve.rpc.exec_with_parent PROGRAM ARGS...`: run a program that is not a
pdserve service (the shared Redis of `pdserve up --routers N`) so that it, too, dies with
its launcher: the parent-death signal (die_with_parent) survives the exec."""

from __future__ import annotations

import os
import shutil
import sys

from pdserve.rpc.parent import die_with_parent


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m pdserve.rpc.exec_with_parent PROGRAM [ARGS...]")
    program = shutil.which(argv[0]) or argv[0]
    die_with_parent()
    os.execv(program, [program, *argv[1:]])


if __name__ == "__main__":
    main(sys.argv[1:])
