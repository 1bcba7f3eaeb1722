"""`python -m bench`: run the benchmark suite and render docs/performance.md (bench/suite.py)."""

import sys

from bench.suite import main

sys.exit(main())
