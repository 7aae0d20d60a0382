"""``python -m benchmarks.imbalance``: the imbalance benchmark (see the package's docstring)."""

import sys

from benchmarks.imbalance.runner import main

if __name__ == "__main__":
    sys.exit(main())
