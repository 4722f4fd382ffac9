"""One run: its parts, topology and publishers, the loop, the warm-up, the loop state, the run directory, signals."""
