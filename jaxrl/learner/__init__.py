"""The pure jitted train step, its optimizer, the RL step's config and the distillation teacher."""
