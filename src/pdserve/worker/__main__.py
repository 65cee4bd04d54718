"""`python -m pdserve.worker --role prefill|decode|colocated` / `pdserve-worker`."""

from __future__ import annotations

import sys

from pdserve.worker.main import main

if __name__ == "__main__":
    sys.exit(main())
