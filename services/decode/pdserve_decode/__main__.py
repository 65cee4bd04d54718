"""`python -m pdserve_decode`: a pdserve worker that starts in the decode role.

Prefill and decode run the same worker (pdserve.worker): a role is state the router may flip,
so every worker can play both. This package chooses the starting role.
"""

from __future__ import annotations

import sys

from pdserve.worker.main import main as worker_main


def main() -> int:
    return worker_main(default_role="decode", prog="pdserve-decode")


if __name__ == "__main__":
    sys.exit(main())
