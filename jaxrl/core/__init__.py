"""The lowest layer: batch and state types, the names of every registry, the errors a user can fix."""
