import sys

from benchmarks.plan_check.check import main

sys.exit(main())
