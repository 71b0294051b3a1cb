"""Thin wrapper: ``python bench/tune.py [options]`` is ``python -m procpipe.bench [options]``."""

import sys

from procpipe.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
