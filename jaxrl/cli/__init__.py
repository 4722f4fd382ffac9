"""The commands (train, evaluate, export, plot): argument parsing and user messages only; nothing imports this package."""
