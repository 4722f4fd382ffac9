"""`python -m jaxrl.plan`: a run compiled for a TPU or GPU target on this machine (it lives in
`jaxrl.cli.plan`)."""

from jaxrl.cli.plan import main, run  # noqa: F401

if __name__ == "__main__":
  run()
