"""`python -m jaxrl.evaluate`: evaluate a run or a model (the command lives in `jaxrl.cli.evaluate`)."""

import sys

from jaxrl.cli.evaluate import main

if __name__ == "__main__":
  sys.exit(main())
