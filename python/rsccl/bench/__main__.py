"""`python -m rsccl.bench ...`: the command line is in rsccl/bench/cli.py."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
