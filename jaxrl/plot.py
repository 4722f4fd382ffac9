"""`python -m jaxrl.plot`: plot runs' metrics (the command lives in `jaxrl.cli.plot`)."""

import sys

from jaxrl.cli.plot import main

if __name__ == "__main__":
  sys.exit(main())
