"""`python -m jaxrl.serve`: serve a run or a model (the command lives in `jaxrl.cli.serve`)."""

import sys

from jaxrl.cli.serve import main

if __name__ == "__main__":
  sys.exit(main())
