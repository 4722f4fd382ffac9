"""A task source over fixed lists of rows, for tests of row checks and skipping
(tests/test_bad_input.py, tests/test_friction.py)."""


class ListSource:
  name, alphabet = "fake", "ab"

  def __init__(self, train, val=()):
    self._splits = {"train": list(train), "val": list(val)}

  def split(self, name):
    return list(self._splits[name])

  def sample(self, rng, n):
    rows = self._splits["train"]
    return [rows[i] for i in rng.integers(len(rows), size=n)]
