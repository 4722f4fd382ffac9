"""Pure loss, advantage and reduction functions. Imports nothing from jaxrl but `types`."""

from jaxrl.losses.grpo import group_advantages, nll_loss, ppo_clip_loss, LOSSES

__all__ = ["group_advantages", "nll_loss", "ppo_clip_loss", "LOSSES"]
