import sys

from benchmarks.evidence.run import main

sys.exit(main())
