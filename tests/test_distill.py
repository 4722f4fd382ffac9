"""On-policy distillation's loss (`jaxrl.losses.distill` and the objective's `distill_coef`):
against the NumPy reference (tests/losses_numpy.py) in f32 and bf16, values and gradients; masked
NaN never reaching anything; the golden arithmetic of one row; and a small categorical policy
that learns its teacher from its own samples."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxrl.losses as L
import losses_numpy as ref  # tests/ is on sys.path
from loss_checks import close, rounded, tol

B, N = 6, 5
DTYPES = [jnp.float32, jnp.bfloat16]


def make(seed):
  rng = np.random.default_rng(seed)
  lp = -rng.uniform(0.05, 3.0, (B, N))
  lp_old = lp - rng.choice([-1.0, 1.0], (B, N)) * rng.uniform(0.0, 1.0, (B, N))
  lp_gen = lp_old + rng.normal(0.0, 0.3, (B, N))
  lp_teacher = lp + rng.normal(0.0, 1.0, (B, N))
  mask = rng.random((B, N)) < 0.7
  mask[-1] = False  # a padding row
  mask[0, 0] = True
  return dict(lp=lp, lp_old=lp_old, lp_gen=lp_gen, lp_teacher=lp_teacher,
              adv=rng.normal(size=B), mask=mask)


def test_golden_row():
  # Two tokens: teacher -1 and -3, behaviour -2 and -2, coef 0.5, sequence advantage 2 at
  # weight 0.25: A = 0.5 * (1, -1) + 0.5 = (1.0, 0.0); the masked third token gets 0.
  adv = L.reverse_kl_advantages(jnp.array([[-1.0, -3.0, jnp.nan]]),
                                jnp.array([[-2.0, -2.0, jnp.inf]]),
                                jnp.array([[True, True, False]]), coef=0.5,
                                seq_advantages=jnp.array([2.0]), reward_weight=0.25)
  np.testing.assert_allclose(np.asarray(adv), [[1.0, 0.0, 0.0]])
  # reverse KL of student (-1, -1) against the teacher: (-1 + 1) + (-1 + 3) = 2 for the row.
  s, n = L.reverse_kl(jnp.array([[-1.0, -1.0, 0.0]]), jnp.array([[-1.0, -3.0, 0.0]]),
                      jnp.array([[True, True, False]]))
  assert (float(s), float(n)) == (2.0, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reward_weight", [0.0, 0.5])
def test_advantages_match_numpy_and_carry_no_gradient(dtype, reward_weight):
  x = make(0)
  (t, tr), (g, gr) = rounded(x["lp_teacher"], dtype), rounded(x["lp_gen"], dtype)
  got = L.reverse_kl_advantages(t, g, x["mask"], coef=0.7, seq_advantages=x["adv"],
                                reward_weight=reward_weight)
  want = ref.distill_advantages(tr, gr, x["mask"], 0.7, x["adv"], reward_weight)
  close(got, want, **tol(dtype))
  grad = jax.grad(lambda a, b: L.reverse_kl_advantages(a, b, x["mask"]).sum(), (0, 1))(t, g)
  assert all(float(jnp.abs(v.astype(jnp.float32)).sum()) == 0.0 for v in grad)


CONFIGS = [("ppo", "token_mean", 0.0), ("ppo", "seq_mean_token_mean", 1.0),
           ("reinforce", "token_mean", 0.5), ("cispo", "seq_mean_token_sum", 0.0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy,reduction,reward_weight", CONFIGS)
@pytest.mark.parametrize("with_gen", [True, False])
def test_objective_with_distillation_matches_numpy(policy, reduction, reward_weight, with_gen,
                                                   dtype):
  x = make(3)
  cfg = L.ObjectiveConfig(policy=policy, reduction=reduction, eps_low=0.2, eps_high=0.28,
                          distill_coef=0.8, distill_reward_weight=reward_weight)
  r = {k: rounded(x[k], dtype) for k in ("lp", "lp_old", "lp_gen", "lp_teacher")}
  gen = r["lp_gen"][0] if with_gen else None
  counts = L.global_counts(cfg, x["mask"])
  f = lambda lp: L.objective(cfg, lp, r["lp_old"][0], x["adv"], x["mask"], counts, lp_gen=gen,
                             lp_teacher=r["lp_teacher"][0])
  (loss, s), g = jax.value_and_grad(f, has_aux=True)(r["lp"][0])
  cnt = ref.counts(cfg, x["mask"])
  rf = lambda lp: ref.objective(cfg, lp, r["lp_old"][1], x["adv"], x["mask"], cnt,
                                lp_gen=r["lp_gen"][1] if with_gen else None,
                                lp_sg=r["lp"][1], lp_teacher=r["lp_teacher"][1])
  e_loss, e_metrics = rf(r["lp"][1])
  close(loss, e_loss, **tol(dtype))
  got = L.stats.finalize(s)
  for k in ("loss/policy", "ratio/mean", "distill/reverse_kl"):
    close(got[k], e_metrics[k], err_msg=k, **tol(dtype))
  close(g, ref.fd_grad(lambda z: rf(z)[0], r["lp"][1]), **tol(dtype, grad=True))


def test_objective_requires_the_teacher():
  cfg = L.ObjectiveConfig(distill_coef=1.0)
  mask = jnp.ones((1, 2), bool)
  with pytest.raises(ValueError, match="lp_teacher"):
    L.objective(cfg, jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros(1), mask,
                L.global_counts(cfg, mask))


@settings(max_examples=20, deadline=None, database=None)
@given(seed=st.integers(0, 2**16), bad=st.sampled_from([jnp.nan, jnp.inf, -jnp.inf]))
def test_property_masked_nan_never_reaches_loss_gradient_or_metric(seed, bad):
  x = make(seed)
  poison = lambda a: jnp.where(x["mask"], jnp.asarray(a, jnp.float32), bad)
  cfg = L.ObjectiveConfig(policy="ppo", distill_coef=1.0, distill_reward_weight=0.5)
  counts = L.global_counts(cfg, x["mask"])
  f = lambda lp: L.objective(cfg, lp, poison(x["lp_old"]), x["adv"], x["mask"], counts,
                             lp_gen=poison(x["lp_gen"]), lp_teacher=poison(x["lp_teacher"]))
  (loss, s), g = jax.value_and_grad(f, has_aux=True)(poison(x["lp"]))
  assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(g)))
  assert all(np.isfinite(float(v)) for v in L.stats.finalize(s).values())


def test_a_categorical_student_learns_its_teacher_from_its_own_samples():
  # One position, vocabulary 8: the student (logits, from uniform) samples 256 tokens a step,
  # the teacher scores them, and the PPO loss on the distillation advantages is minimised by
  # SGD. The reverse KL KL(student || teacher) must fall by over 10x in 60 steps.
  teacher = jax.nn.log_softmax(jnp.array([3.0, 1.0, 0.0, -1.0, 2.0, -2.0, 0.5, -0.5]))
  logits = jnp.zeros(8)
  cfg = L.ObjectiveConfig(policy="ppo", distill_coef=1.0)
  mask = jnp.ones((256, 1), bool)
  counts = L.global_counts(cfg, mask)

  def kl(z):
    p = jax.nn.log_softmax(z)
    return float(jnp.sum(jnp.exp(p) * (p - teacher)))

  def loss(z, tokens, lp_gen):
    lp = jax.nn.log_softmax(z)[tokens][:, None]
    return L.objective(cfg, lp, jax.lax.stop_gradient(lp), jnp.zeros(256), mask, counts,
                       lp_gen=lp_gen, lp_teacher=teacher[tokens][:, None])[0]

  grad = jax.jit(jax.grad(loss))
  start = kl(logits)
  key = jax.random.key(0)
  for _ in range(60):
    key, sub = jax.random.split(key)
    tokens = jax.random.categorical(sub, logits, shape=(256,))
    lp_gen = jax.nn.log_softmax(logits)[tokens][:, None]
    logits = logits - 1.0 * grad(logits, tokens, lp_gen)
  assert kl(logits) < start / 10, (start, kl(logits))


# --- the teacher in a run (python -m jaxrl.train) -------------------------------------------------

def _train(args, cwd):
  import subprocess
  import sys

  return subprocess.run([sys.executable, "-m", "jaxrl.train", *args], cwd=cwd,
                        capture_output=True, text=True, timeout=600)


TINY = ["--config.model.d_model=32", "--config.model.head_dim=16", "--config.model.mlp_dim=64",
        "--config.task.dev_size=64", "--config.task.val_size=64", "--config.val.batch_size=64",
        "--config.rollout.num_prompts=4", "--config.val.every=100", "--config.sft.eval_every=10"]


@pytest.mark.slow  # three tiny runs through the CLI (~90 s on 2 busy cores)
def test_a_run_distils_from_a_teacher_run_and_a_foreign_teacher_is_refused(tmp_path):
  import json

  teacher = tmp_path / "teacher"
  proc = _train([*TINY, "--config.sft.max_steps=30", "--config.train.steps=2",
                 f"--config.run_dir={teacher}"], tmp_path)
  assert proc.returncode == 0, proc.stdout + proc.stderr

  student = tmp_path / "student"
  proc = _train([*TINY, "--config.sft.enabled=false", "--config.train.steps=3",
                 "--config.val.at_start=false", f"--config.distill.teacher={teacher}",
                 f"--config.run_dir={student}"], tmp_path)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert f"distillation: teacher {teacher} (jaxrl run, checkpoint 2)" in proc.stdout, proc.stdout
  rows = [json.loads(line) for line in (student / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in rows if r["phase"] == "rl"]
  assert len(rl) == 3
  # A warmed-up teacher and a random student disagree: the sampled reverse KL is positive.
  assert all(np.isfinite(r["distill/reverse_kl"]) and r["distill/reverse_kl"] > 0 for r in rl)
  assert all(r["grad_norm"] > 0 for r in rl)  # dense credit even where rewards do not vary

  # A teacher trained on another task has another tokenizer (countdown's 30 characters against
  # add's 14): refused by name, in one line, before the run directory exists.
  other = tmp_path / "other"
  proc = _train([*TINY, "--config.task.name=countdown", "--config.rollout.max_prompt_len=28",
                 "--config.sft.enabled=false",
                 "--config.train.steps=1", f"--config.run_dir={other}"], tmp_path)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  refused = tmp_path / "refused"
  proc = _train([*TINY, "--config.sft.enabled=false", "--config.train.steps=1",
                 f"--config.distill.teacher={other}", f"--config.run_dir={refused}"], tmp_path)
  assert proc.returncode == 1, proc.stdout + proc.stderr
  assert "config.distill.teacher" in proc.stderr and "30 tokens" in proc.stderr and \
      "14 tokens" in proc.stderr, proc.stderr
  assert "Traceback" not in proc.stderr and not refused.exists()


def test_distill_keys_are_checked_before_anything_is_built(tmp_path):
  from jaxrl.config import ConfigError, validate
  from jaxrl.recipes.default import get_config

  cfg = get_config()
  cfg.distill.teacher = str(tmp_path)  # no config.json there
  with pytest.raises(ConfigError) as info:
    validate(cfg, 8)
  assert any(p.startswith("config.distill.teacher:") and "has no config.json" in p
             for p in info.value.problems), info.value.problems
  (tmp_path / "config.json").write_text("{}")
  cfg.distill.coef = 0.0
  with pytest.raises(ConfigError) as info:
    validate(cfg, 8)
  assert any(p.startswith("config.distill.coef:") for p in info.value.problems)
  cfg.distill.coef = 0.5
  validate(cfg, 8)


@pytest.mark.slow  # two tiny runs through the CLI (~60 s on 2 busy cores)
def test_distillation_with_lag_partial_rollouts_and_multi_turn(tmp_path):
  import json

  # Multi-turn guess mixed with add (one tokenizer for both), teacher and student alike.
  task = ["--config.task.name=guess+add", "--config.task.weights=3,1",
          "--config.rollout.max_turns=4", "--config.rollout.max_prompt_len=32",
          "--config.rollout.max_total_tokens=48", "--config.sft.enabled=false",
          "--config.val.at_start=false", "--config.val.at_end=false"]
  teacher = tmp_path / "teacher"
  proc = _train([*TINY, *task, "--config.train.steps=2", f"--config.run_dir={teacher}"],
                tmp_path)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  student = tmp_path / "student"
  proc = _train([*TINY, *task, "--config.train.steps=4", "--config.rollout.lag=1",
                 "--config.rollout.engine=continuous", "--config.rollout.partial_rollouts=true",
                 "--config.seed=3", "--config.distill.reward_weight=0.5",
                 f"--config.distill.teacher={teacher}", f"--config.run_dir={student}"], tmp_path)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  rows = [json.loads(line) for line in (student / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in rows if r["phase"] == "rl"]
  assert [r["step"] for r in rl] == [1, 2, 3, 4]
  # The forced lag holds with the teacher in the step; the loss saw generated tokens only
  # (observations are context), each scored by the teacher.
  assert [r["staleness/first_token/max"] for r in rl] == [0, 1, 1, 1]
  assert all(np.isfinite(r["distill/reverse_kl"]) for r in rl)
  assert any(r["distill/reverse_kl"] != 0 for r in rl)
  assert all(r["tokens"] <= 4 * 8 * 4 * 4 for r in rl)  # P x G rows x turns x new tokens


@pytest.mark.slow  # fast-suite time budget: a property test that compiles per example (~20-30 s)
@settings(max_examples=15, deadline=None, database=None)
@given(seed=st.integers(0, 2**16), split=st.integers(1, B - 1),
       reduction=st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]))
def test_property_microbatches_sum_to_the_full_batch(seed, split, reduction):
  # The distillation advantage is per token and every denominator is the whole batch's, so two
  # micro-batches (rows [:split] and [split:]) add up to the full batch: loss and gradient.
  x = make(seed)
  cfg = L.ObjectiveConfig(policy="ppo", reduction=reduction, distill_coef=0.7,
                          distill_reward_weight=0.3)
  counts = L.global_counts(cfg, x["mask"])

  def loss(lp, rows):
    take = lambda k: jnp.asarray(x[k][rows], jnp.float32)
    return L.objective(cfg, lp, take("lp_old"), jnp.asarray(x["adv"][rows], jnp.float32),
                       x["mask"][rows], counts, lp_gen=take("lp_gen"),
                       lp_teacher=take("lp_teacher"))[0]

  lp = jnp.asarray(x["lp"], jnp.float32)
  full, g_full = jax.value_and_grad(loss)(lp, slice(None))
  a, g_a = jax.value_and_grad(loss)(lp[:split], slice(0, split))
  b, g_b = jax.value_and_grad(loss)(lp[split:], slice(split, None))
  np.testing.assert_allclose(float(a + b), float(full), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.concatenate([g_a, g_b]), np.asarray(g_full), rtol=1e-5,
                             atol=1e-6)
