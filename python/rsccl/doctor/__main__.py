"""`python -m rsccl.doctor ...`: the command line is in rsccl/doctor/report.py."""

import sys

from .report import main

if __name__ == "__main__":
    sys.exit(main())
