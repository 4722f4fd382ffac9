"""The pure jitted train step, its optimizer and the RL step's config."""
