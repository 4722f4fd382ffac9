"""`python -m jaxrl.export`: export a run to Hugging Face files (the command lives in `jaxrl.cli.export`)."""

import sys

from jaxrl.cli.export import main

if __name__ == "__main__":
  sys.exit(main())
