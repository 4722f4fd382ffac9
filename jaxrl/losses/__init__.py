"""Pure loss, advantage, KL and metric functions: arrays in, arrays out; jit, vmap and grad work.

Imports nothing from jaxrl but `types`, so other trainers can use it on their own arrays.
Each name below is selectable by a config string from a small registry:

- advantages: `ADVANTAGE_ESTIMATORS` (`grpo`, `grpo_batch_std`, `dr_grpo`, `rloo`) via
  `compute_advantages`;
- KL estimators: `KL_ESTIMATORS` (`k1`, `k2`, `k3`, `abs`) via `kl_estimate`, importance-weighted
  for off-policy samples by `importance_weighted_kl`;
- policy losses: `POLICY_LOSSES` (`ppo`, `gspo`, `cispo`, `sapo`, `reinforce`) via `policy_loss`;
- off-policy corrections: `CORRECTIONS` via `combine` (names joined by `+` in configs);
- reductions: `REDUCTIONS` via `reduce`, each returning `(sum, count)`;
- on-policy distillation: per-token reverse-KL advantages against a teacher
  (`reverse_kl_advantages`, `reverse_kl`);
- the composed objective (`objective`, `ObjectiveConfig`) and mismatch metrics.
"""

from jaxrl.losses import stats
from jaxrl.losses.advantages import (ADVANTAGE_ESTIMATORS, clip_advantages, compute_advantages,
                                     dr_grpo, grpo, grpo_batch_std, rloo)
from jaxrl.losses.distill import reverse_kl, reverse_kl_advantages
from jaxrl.losses.corrections import (CORRECTIONS, WEIGHTING, Correction, CorrectionParams,
                                      combine, correction, parse_correction)
from jaxrl.losses.kl import (KL_ESTIMATORS, importance_weight, importance_weighted_kl,
                             kl_estimate)
from jaxrl.losses.mismatch import mismatch_metrics
from jaxrl.losses.objective import KL_REDUCTIONS, ObjectiveConfig, global_counts, objective
from jaxrl.losses.policy import (POLICY_LOSSES, PolicyLoss, cispo, gspo, policy_loss, ppo,
                                 reinforce, sapo)
from jaxrl.losses.reductions import REDUCTIONS, count, reduce


def nll(lp, mask):
  """Supervised warm-up loss: the token-mean negative log-likelihood as `(sum, count)`.

  Args:
    lp: `[B, N]` log-probs of the target tokens under the policy being trained, with gradient.
    mask: `[B, N]` bool loss mask.

  Returns:
    `(sum_t m (-lp), sum_t m)`: two float32 scalars (the "token_mean" reduction).
  """
  return reduce("token_mean", -lp, mask)


__all__ = [
    "ADVANTAGE_ESTIMATORS", "CORRECTIONS", "KL_ESTIMATORS", "KL_REDUCTIONS", "POLICY_LOSSES",
    "REDUCTIONS", "WEIGHTING", "Correction", "CorrectionParams", "ObjectiveConfig", "PolicyLoss",
    "cispo", "clip_advantages", "combine", "compute_advantages", "correction", "count", "dr_grpo",
    "global_counts", "grpo", "grpo_batch_std", "gspo", "importance_weight",
    "importance_weighted_kl", "kl_estimate", "mismatch_metrics", "nll", "objective",
    "parse_correction", "policy_loss", "ppo", "reduce", "reinforce", "reverse_kl",
    "reverse_kl_advantages", "rloo", "sapo", "stats",
]
