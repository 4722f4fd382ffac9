"""`python -m jaxrl.train`: the trainer's command (it lives in `jaxrl.cli.train`)."""

from jaxrl.cli.train import main, run  # noqa: F401  (`jaxrl.train.run`: the console script)

if __name__ == "__main__":
  run()
