"""The default run with a mixture-of-experts model (docs/moe.md): the same task, phases and
settings, each layer's MLP replaced by 4 SwiGLU experts of half the dense width with 2 routed
per token (as many active MLP parameters per token as the dense model), the load-balancing loss
weighted 0.01."""

from jaxrl.recipes import default


def get_config():
  c = default.get_config()
  c.name = "default_moe"
  c.model.num_experts = 4
  c.model.num_experts_per_tok = 2
  c.model.moe_intermediate_size = c.model.mlp_dim // 2
  c.loss.moe_aux_coef = 0.01
  return c
