"""`python -m services.perf ...`: the same as `trireme perf ...`."""
import sys

from services.perf.main import main

if __name__ == "__main__":
    sys.exit(main())
