"""Default recipe: a tiny decoder learns 2-digit addition on a laptop CPU.

Phase 1 (supervised warm-up) teaches the answer format and stops on purpose as soon as greedy
accuracy on the `dev` split reaches `sft.stop_accuracy`, so the RL phase starts with headroom.
Phase 2 is GRPO: `rollout.num_prompts` prompts x `rollout.group_size` samples per step, exact-match
reward. Reported accuracy is greedy exact match on the held-out `val` split, which neither phase
trains or stops on.

Every key here is part of the schema: `jaxrl.config.validate` rejects keys that are not in this
file and values whose type differs from the default's.
"""

from ml_collections import ConfigDict


def get_config() -> ConfigDict:
  c = ConfigDict()
  c.name = "default"  # run name; the run directory is <run_root>/<name>-<timestamp>
  c.seed = 0  # one seed for init, data order and sampling
  c.run_dir = ""  # explicit run directory; "" means ./runs/<name>-<timestamp>
  c.log_every = 10  # progress line / console print period in steps (metrics.jsonl gets every step)
  # Continue from a checkpoint: "auto" (the run directory's latest, if any), "none", or a path
  # (a run directory or its checkpoints/ directory).
  c.resume = "auto"
  # Start over in a run directory that already holds a run (its metrics.jsonl, checkpoints and
  # files are moved aside to <run_dir>/previous-<n>/ first). Without it a run with resume="none"
  # refuses a non-empty run directory instead of mixing two runs in one metrics.jsonl.
  c.overwrite = False
  # Show the Python traceback of an error instead of the one-line `jaxrl: ...` message (also
  # with the environment variable JAXRL_DEBUG=1).
  c.debug = False
  # Persistent compilation cache (jaxrl.runtime.compile_cache): "auto" = $JAX_COMPILATION_CACHE_DIR or
  # ~/.cache/jaxrl/xla; a path; "" = off. A second run of the same config starts in seconds.
  c.compile_cache = "auto"
  # LLVM optimisation level of XLA's CPU programs (XLA_FLAGS --xla_backend_optimization_level)
  # on a CPU-only install, set by `python -m jaxrl.train` unless XLA_FLAGS names it: 0-3, or -1
  # to leave XLA's default (3). Level 1 brought issue 22's workload to its first RL step 25-30%
  # sooner cold, with the same step speed and bit-identical metrics (benchmarks/README.md).
  c.xla_cpu_opt_level = 1
  # XLA's MLIR fusion emitters for CPU programs (XLA_FLAGS --xla_cpu_use_fusion_emitters), set
  # like the level above and only where the installed XLA knows the flag. Off (XLA's LLVM IR
  # emitters) the cold run of issue 22's workload peaked at ~550 MiB instead of ~910 and compiled
  # faster; its train step ran a few ms slower. Metrics agree to float rounding, not bit for bit.
  c.xla_cpu_fusion_emitters = False
  # On a CPU-only install, glibc malloc keeps freed memory mapped (jaxrl.runtime.host_memory): XLA's
  # per-call temporary buffers stop page-faulting afresh every call (issue 22's train step: ~30%
  # faster), for resident memory kept for reuse. Skipped when MALLOC_* or GLIBC_TUNABLES are set.
  c.host_malloc_tuning = True

  c.checkpoint = ConfigDict()
  c.checkpoint.every = 100  # RL steps between checkpoints (also at the end and on SIGTERM/SIGINT)
  c.checkpoint.keep = 2  # newest checkpoints kept
  c.checkpoint.async_save = True  # write in the background while training goes on

  # Where every metrics row goes besides <run_dir>/metrics.jsonl (always written), on process 0
  # (jaxrl.observe.sinks; README "Watching a run").
  c.logging = ConfigDict()
  # Comma list of: jsonl | tensorboard (event files in <run_dir>/tensorboard/<phase>/, pip extra
  # `tensorboard`) | wandb (a Weights & Biases run, files in <run_dir>/wandb/, pip extra `wandb`).
  c.logging.backends = "jsonl"
  c.logging.wandb = ConfigDict()
  c.logging.wandb.project = "jaxrl"  # the W&B project the run is logged to
  c.logging.wandb.entity = ""  # team or user; "" = your W&B default entity
  # "online", "offline" (no network; upload later with `wandb sync <run_dir>/wandb/offline-run-*`),
  # "disabled", or "" = W&B's default (the WANDB_MODE environment variable, else online).
  c.logging.wandb.mode = ""
  c.logging.wandb.tags = ""  # comma-separated tags of the W&B run

  c.model = ConfigDict()
  # A Hugging Face model directory (config.json, *.safetensors, tokenizer.json,
  # tokenizer_config.json; Llama 3 / Qwen2 / Qwen2.5 / Qwen3): the architecture comes from its
  # config.json and the tokenizer from its tokenizer files, so the architecture keys below
  # (vocab_size .. tie_embeddings, init_std) must keep their defaults. "" = a fresh random model
  # of the shape below with the task's character tokenizer.
  c.model.hf_path = ""
  c.model.vocab_size = 0  # 0: taken from the task's tokenizer
  c.model.d_model = 64  # residual stream width
  c.model.num_layers = 2  # decoder layers
  c.model.num_heads = 4  # query heads per layer
  c.model.num_kv_heads = 2  # grouped-query attention: heads share kv heads in groups
  c.model.head_dim = 16  # width of one attention head (even: RoPE rotates pairs)
  c.model.mlp_dim = 192  # SwiGLU hidden width
  c.model.rope_theta = 10000.0  # RoPE base frequency
  c.model.rms_eps = 1e-6  # RMSNorm's epsilon
  c.model.qkv_bias = False  # Qwen2 style
  c.model.qk_norm = False  # Qwen3 style
  c.model.tie_embeddings = False  # the output projection reuses the input embedding
  c.model.param_dtype = "float32"  # dtype the parameters are stored and updated in
  c.model.dtype = "float32"  # compute dtype; logprobs are always float32
  c.model.init_std = 0.02  # std of a fresh model's normal initialisation
  c.model.scan_layers = False  # unrolled: faster for 2 layers on CPU; scan for deep models
  c.model.remat = "none"  # recompute each layer in the backward pass: "none" | "full" | "dots"
  # Training/scoring attention: "auto" (CPU: dense up to 1,024-position rows, else xla) |
  # "dense" | "xla" (blockwise, memory linear in the row) | "cudnn" (CUDA GPU, bf16/f16) |
  # "pallas_tpu" (the Pallas TPU kernel). Packed rows (segments, shared prompts) take any.
  c.model.attention = "auto"
  # Single-token decode's attention over the KV cache: "auto" (CPU: dense, else xla) | "dense"
  # (every slot, f32 keys) | "xla" (filled slots only, in the cache's dtype) | "pallas_tpu" |
  # "pallas_gpu" (Pallas kernels; no TPU or GPU has run them yet).
  c.model.decode_attention = "auto"
  # Mixture of experts (Qwen3-MoE, docs/moe.md): experts per layer; 0 = one dense SwiGLU MLP.
  c.model.num_experts = 0
  # Experts each token goes to: its top-k by float32 router probability.
  c.model.num_experts_per_tok = 2
  # Width of each expert's SwiGLU MLP (mlp_dim is unused when num_experts > 0).
  c.model.moe_intermediate_size = 64
  # Renormalise each token's top-k router probabilities to sum 1 (as Qwen3-MoE checkpoints do).
  c.model.norm_topk_prob = True
  # The experts' grouped matmul: "auto" (CPU: blocked, else ragged_dot) | "ragged_dot" |
  # "blocked" (whole tiles per expert).
  c.model.moe_dispatch = "auto"
  # Expert capacity: > 0 caps each expert at ceil(factor x tokens x k / E) assignments per
  # forward pass, dropping the later tokens' (logged as moe/dropped); 0 = dropless.
  c.model.moe_capacity_factor = 0.0
  # LoRA for the RL phase (rank 0: off, every parameter trains). With a rank, RL trains only
  # low-rank adapters (Flax NNX `nnx.LoRA`, f32) on the `targets` projections of every layer;
  # the base stays frozen, the optimizer holds state for the adapters alone, and a published
  # version moves adapter bytes only. The supervised warm-up (when on) trains the full model:
  # it stands in for the pre-trained checkpoint the adapters start from.
  c.model.lora = ConfigDict()
  c.model.lora.rank = 0  # adapter rank r; 0 = LoRA off (see above)
  c.model.lora.alpha = 32.0  # the adapter's output is scaled by alpha / rank (PEFT's scaling)
  c.model.lora.dropout = 0.0  # dropout on the adapter's input, in training only
  c.model.lora.targets = "q,k,v,o,gate,up,down"  # comma-separated; any of these seven
  # The RL learning rate with LoRA (0 = train.learning_rate). Adapters need a higher rate than
  # full fine-tuning; on this recipe (rank 16, all targets, seeds 0-1) 2e-3 and 3e-3 both gain
  # as much as the full-parameter run at 6e-4, while 6e-3 collapses the policy.
  c.model.lora.learning_rate = 2e-3
  # How the sampler uses the adapters: "apply" (the base weights as they are plus the low-rank
  # product in every matmul) or "merge" (W + scale * A B computed once per published version).
  c.model.lora.rollout = "merge"

  # Mixture-of-experts runs (model.num_experts > 0; docs/moe.md).
  c.moe = ConfigDict()
  # Routing replay: "none" (the train step routes every token itself) | "rollout" (generated
  # tokens go to the experts the sampler chose for them; the router still gets its gradient).
  c.moe.routing_replay = "none"

  # How prompts become tokens with a Hugging Face tokenizer (model.hf_path).
  c.tokenizer = ConfigDict()
  # Render each task prompt as a user message through the model's chat template (with the
  # assistant turn opened), and environment observations as further user turns (an error with a
  # tokenizer that has no template); false: plain text with the tokenizer's own special tokens.
  c.tokenizer.chat_template = True
  c.tokenizer.system_prompt = ""  # a system message before every prompt; "" = the template's own

  c.task = ConfigDict()
  # Built-in task: add | countdown | guess (multi-turn) | math | reasoning_gym:<dataset> (any
  # reasoning-gym dataset, extra `reasoning_gym`); several joined by "+" (e.g. "add+guess") are
  # mixed per row, drawn with task.weights.
  c.task.name = "add"
  c.task.weights = ""  # "" = equal; else comma-separated, one per task (e.g. "3,1")
  c.task.path = ""  # task "math": JSONL file of {"question", "answer"} rows (GSM8K style)
  c.task.val_path = ""  # task "math": held-out JSONL; "" = a seeded 10% of task.path
  c.task.instruction = ""  # task "math": appended to every question on a new line
  # Tasks "reasoning_gym:<dataset>": "" (defaults) or a JSON object keyed by dataset name, each
  # value that dataset's config arguments ("size" = its training rows; the seed is config.seed),
  # e.g. '{"basic_arithmetic": {"max_terms": 3}}'.
  c.task.rg_config = ""
  c.task.num_digits = 2  # operands are zero-padded to this many digits
  c.task.max_operand = 0  # task "word_math": operands from 1 to this; 0 = num_digits-digit numbers
  c.task.dev_size = 1000  # split used only by the warm-up stopping rule
  c.task.val_size = 1000  # held-out split used only for reported accuracy

  c.data = ConfigDict()
  # A task row with an empty prompt, a prompt over rollout.max_prompt_len, text the tokenizer
  # cannot encode, or an unknown task: "skip" (counted as data/skipped/<reason>) or "raise"
  # (an error naming the row).
  c.data.on_bad_row = "skip"
  # Stop before training when more than this fraction of the train (or val) rows would be skipped,
  # naming the longest prompt and rollout.max_prompt_len (checked up front for sources that list
  # their rows, else over the first training draws); 1.0 = never stop.
  c.data.max_skipped_frac = 0.1

  c.sft = ConfigDict()
  c.sft.enabled = True  # run the supervised warm-up before RL
  c.sft.learning_rate = 1e-3  # the warm-up's AdamW learning rate
  c.sft.batch_size = 128  # demonstrations per warm-up step
  c.sft.stop_accuracy = 0.3  # stop warm-up at the first dev greedy accuracy >= this
  c.sft.eval_every = 5  # fine enough that every machine stops near the same accuracy
  c.sft.max_steps = 1500  # hard cap; the run says so if it stopped on the cap
  # Warm-up cache (jaxrl.run.warmup): a run whose warm-up this machine has computed before (same
  # model, data, warm-up keys, code, versions and backend; RL keys may differ) loads its result
  # instead: the same parameters and metrics rows. "auto" = $JAXRL_WARMUP_CACHE_DIR or
  # ~/.cache/jaxrl/warmup; a path; "" = off (always train the warm-up).
  c.sft.cache = "auto"

  c.rollout = ConfigDict()
  c.rollout.num_prompts = 128  # P: groups per step
  c.rollout.group_size = 8  # G: samples per prompt
  c.rollout.max_prompt_len = 6  # prompts are left-padded to this (longer ones are rejected)
  c.rollout.max_new_tokens = 4  # tokens per model turn
  c.rollout.max_turns = 1  # model turns per episode (each environment may stop earlier)
  c.rollout.max_total_tokens = 0  # completion budget over all turns + observations; 0 = max_new_tokens
  c.rollout.temperature = 0.6  # sampling temperature (logprobs are of logits / T)
  c.rollout.top_k = 0  # 0: off
  c.rollout.top_p = 1.0  # 1.0: off
  # The sampler's precision, independent of the trainer's: "auto" (the trainer's
  # model.param_dtype / model.dtype), "float32" or "bfloat16". The sampler's copy is cast when a
  # version is published; its log-probs are then the low-precision policy's, which the mismatch
  # metrics and corrections (loss.correction) see.
  c.rollout.dtype = "auto"
  # The sampler's KV cache storage: "auto" (bfloat16 on a GPU or TPU; on CPU the sampler's
  # compute dtype, as before), "float32", "bfloat16", or "float8_e4m3fn" / "float8_e5m2" (8 bits
  # a value, unscaled; measured in docs/rollouts.md). Attention upcasts what it reads; the
  # sampler's log-probs stay the float32 softmax's.
  c.rollout.kv_cache_dtype = "auto"
  c.rollout.logprobs = True  # keep the sampler's log-probs (corrections, rollout KL, mismatch)
  # Forced lag L: a background worker generates batch t with the params published after step
  # t - L (staleness exactly min(t, L)); 0 = synchronous on-policy training. "auto": the lag
  # tunes itself from the measured generation and train times (docs/training.md).
  c.rollout.lag = 0
  c.rollout.max_lag = 2  # lag "auto": the largest lag it may choose (a ring of max_lag + 1 slots)
  c.rollout.lag_every = 10  # lag "auto": steps between its decisions (each logged with its reason)
  # With a lag, the train step waits for the worker's next sampler call to finish first where
  # the two share the devices ("auto": colocated on a CPU, whose cores two programs would
  # split, without partial rollouts; "on": wherever colocated; "off": never). Only timing
  # changes: the batches, versions and staleness are the same (docs/training.md).
  c.rollout.sampler_first = "auto"
  c.rollout.max_regenerations = 8  # re-samples of filtered groups per batch before failing
  c.rollout.stall_timeout_s = 600.0  # watchdog: fail if no batch arrives for this long
  # Partial rollouts (rollout.engine=continuous): a batch starts on its forced-lag params and
  # switches to newer published params between decode dispatches; tokens carry their version.
  c.rollout.partial_rollouts = False
  # How each params version reaches the rollout processes (mesh.rollout_processes): "full" (the
  # whole version every time) or "delta" (what changed since the version the process holds;
  # a full copy when it holds another; only with mesh.rollout_processes). Either way each
  # version's crc32 is checked on arrival.
  c.rollout.sync = "full"
  # Generation: "static" (every row of a batch decodes until the slowest ends) or "continuous"
  # (a slot engine: a finished row's slot takes the next waiting row at once; same tokens for
  # the same keys).
  c.rollout.engine = "static"
  c.rollout.engine_slots = 0  # continuous: decode slots; 0 = one per row of a batch
  c.rollout.engine_steps = 8  # continuous: decode steps per dispatch between slot refills
  # continuous: also compile decode programs over fewer slots (when at most half are busy) and
  # over a short cache window (short rows next to long ones): same tokens, up to ~7 decode
  # programs to compile instead of 1. False: every dispatch decodes all slots over the whole cache.
  c.rollout.engine_compact = True

  # Dynamic sampling: drop every group whose rewards do not vary (no learning signal) and keep
  # the batch at P groups. Lag 0: whole extra generation batches fill a pending cache; lag > 0:
  # dropped groups are re-sampled into their own slot of the ring.
  c.dynamic_sampling = ConfigDict()
  c.dynamic_sampling.enabled = False  # drop groups with no reward spread (see above)
  c.dynamic_sampling.tol = 0.0  # drop a group when max(r) - min(r) <= tol over its live rows
  c.dynamic_sampling.max_gen_batches = 10  # K: generation attempts per batch; the K-th failure raises
  c.dynamic_sampling.reward_field = "reward"  # the per-row reward it reads: the raw task reward

  c.train = ConfigDict()
  c.train.steps = 600  # RL steps
  c.train.learning_rate = 6e-4  # peak AdamW learning rate of the RL phase
  c.train.warmup_steps = 50  # linear lr ramp: a fresh Adam's first full-rate steps undo warm-up
  # After the ramp: "constant", or "cosine" / "linear" decay to final_lr_frac x the rate at the
  # last RL step (train.steps).
  c.train.lr_schedule = "linear"
  c.train.final_lr_frac = 0.0  # the decay's end, as a fraction of the peak
  c.train.b1 = 0.9  # AdamW's beta1
  c.train.b2 = 0.98  # AdamW's beta2
  c.train.adam_eps = 1e-8  # AdamW's epsilon (also the warm-up's)
  c.train.weight_decay = 0.0  # AdamW's decoupled weight decay
  c.train.grad_clip = 1.0  # global-norm clip
  # Gradient accumulation: the step sums the gradients of this many micro-batches (the gradient is
  # the whole batch's either way). 0 = auto: the fewest that keep each device's micro-batch within
  # microbatch_tokens tokens (rows x (max_prompt_len + completion budget); with share_prompts,
  # groups x (max_prompt_len + G x completion budget)); here 128 groups of 6 + 8 x 4 tokens -> 4
  # micro-batches, faster on CPU than one large pass (jaxrl.config.resolve_microbatches).
  c.train.num_microbatches = 0
  c.train.microbatch_tokens = 2048  # per-device token budget of one micro-batch (see above)
  # Run each group's prompt once in the train step: its G completions attend to one copy of the
  # prompt's keys and values (the same function, ~2x less dense work for the default's 6-token
  # prompts and 4-token completions). Auto micro-batching then counts a group as
  # max_prompt_len + G x completion tokens.
  c.train.share_prompts = True
  # Token-budget packing: the train step lays rows (prompt + completion, each group's prompt once)
  # end to end in packed rows of microbatch_tokens positions, one per batch shard per
  # micro-batch, with no padding to the longest row; micro-batches run until the batch's tokens
  # are used (num_microbatches must stay 0). The loss is the unpacked step's (same global counts).
  # microbatch_tokens must hold one row: max_prompt_len + completion budget.
  c.train.packing = False
  # Cut each batch's padding before its step: prompts and completions run only as wide as the
  # batch's rows use, rounded up to one of this many evenly spaced widths per budget (a compiled
  # step per width used; the update is the same up to float rounding). 0 or 1 = off: every batch
  # at the full budgets, one program. Pays when a batch's longest reply ends well inside its
  # budget (docs/training.md).
  c.train.length_buckets = 0
  # Updates skipped for non-finite gradients before the run stops (with a checkpoint); 0 = never.
  c.train.max_skipped_updates = 0
  # Stop (with a checkpoint) after this many updates in a row were skipped for non-finite
  # gradients: a run that has stopped learning says so instead of running on. 0 = never.
  c.train.max_consecutive_skipped = 10

  c.advantage = ConfigDict()
  # grpo | grpo_batch_std | dr_grpo | rloo (jaxrl.losses.advantages). TRL's scale_rewards:
  # "group" = grpo, "batch" = grpo_batch_std (group mean, batch std), "none" = dr_grpo.
  c.advantage.estimator = "grpo"
  c.advantage.eps = 1e-4  # grpo, grpo_batch_std: (r - mean_group) / (std + eps)
  c.advantage.std_ddof = 0  # that std's ddof: 0 = population, 1 = sample std (TRL's)
  c.advantage.clip = 0.0  # clamp advantages to [-clip, clip]; 0 = off

  c.loss = ConfigDict()
  c.loss.policy = "ppo"  # ppo | gspo | cispo | sapo | reinforce (jaxrl.losses.policy)
  c.loss.eps_low = 0.2  # ratio clip range [1 - eps_low, 1 + eps_high]
  c.loss.eps_high = 0.2  # upper clip: the ratio is clipped at 1 + eps_high
  # The PPO ratio's denominator: "trainer" (the trainer's recompute before the update),
  # "rollout" (the sampler's log-probs: the ratio and its clip then span the lag), or "auto"
  # (rollout when rollout.lag > 0, else trainer).
  c.loss.ratio_base = "auto"
  c.loss.dual_clip = 0.0  # c > 1 caps the loss of negative-advantage tokens at -A c; 0 = off
  # SAPO's soft gate (4 / tau) sigmoid(tau (r - 1)) replaces the clip: tau where A > 0 and where
  # A <= 0 (the paper's defaults; a larger tau narrows the trust region).
  c.loss.sapo_tau_pos = 1.0
  c.loss.sapo_tau_neg = 1.05  # SAPO's tau where A <= 0 (see above)
  # token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm
  # (jaxrl.losses.reductions)
  c.loss.reduction = "token_mean"
  c.loss.norm_len = 0  # seq_mean_token_sum_norm's constant; 0 = rollout.max_new_tokens
  c.loss.entropy_coef = 0.0  # entropy bonus (subtracted from the loss)
  # Mixture-of-experts models: weight of the load-balancing loss (logged as moe/aux_loss always).
  c.loss.moe_aux_coef = 0.0
  # Off-policy corrections against the sampler's log-probs, "+"-joined and applied in order:
  # token_tis | seq_tis | icepop | seq_mask_tis | geo_mask | product_mask | outlier_mask |
  # dppo_tv (jaxrl.losses.corrections); "none" = off.
  c.loss.correction = "none"
  c.loss.token_tis_cap = 2.0  # token_tis: truncation of the token ratio
  c.loss.seq_tis_cap = 5.0  # seq_tis: truncation of the sequence ratio
  c.loss.icepop_low = 0.5  # icepop: lowest token ratio kept
  c.loss.icepop_high = 2.0  # icepop: highest token ratio kept
  c.loss.seq_mask_low = 0.5  # seq_mask_tis: lowest geometric-mean sequence ratio kept
  c.loss.seq_mask_high = 2.0  # seq_mask_tis: highest geometric-mean sequence ratio kept
  c.loss.geo_mask_low = 0.99  # geo_mask: lowest geometric-mean sequence ratio kept
  c.loss.geo_mask_high = 1.01  # geo_mask: highest geometric-mean sequence ratio kept
  c.loss.product_mask_low = 0.5  # product_mask: lowest sequence ratio (product) kept
  c.loss.product_mask_high = 2.0  # product_mask: highest sequence ratio (product) kept
  c.loss.outlier_low = 1e-4  # outlier_mask: a token ratio below this masks its row
  c.loss.outlier_high = 100.0  # outlier_mask: a token ratio above this masks its row
  c.loss.dppo_delta_low = 0.2  # dppo_tv: allowed probability drop where A <= 0
  c.loss.dppo_delta_high = 0.2  # dppo_tv: allowed probability rise where A > 0
  # Drop rows whose mean exp(|lp_gen - lp_old|) exceeds this from the loss; 0 = off (e.g. 1.5).
  c.loss.seq_logprob_error_threshold = 0.0
  c.loss.logprob_impl = "auto"  # fused log-prob kernel: auto | reference | xla | pallas

  c.rollout_kl = ConfigDict()  # KL to the sampler's log-probs on every trained token
  c.rollout_kl.coef = 0.0  # weight of this KL term in the loss; 0 = off
  c.rollout_kl.estimator = "k2"  # k1 | k2 | k3 | abs (jaxrl.losses.kl)
  # token_mean | seq_mean | policy (= loss.reduction, e.g. Dr. GRPO's constant normaliser)
  c.rollout_kl.reduction = "token_mean"

  c.ref_kl = ConfigDict()  # KL to a frozen copy of the starting policy (built only if coef != 0)
  c.ref_kl.coef = 0.0  # weight of this KL term in the loss; 0 = off (no reference copy)
  c.ref_kl.estimator = "k3"  # k1 | k2 | k3 | abs (jaxrl.losses.kl)
  c.ref_kl.reduction = "token_mean"  # token_mean | seq_mean | policy (as rollout_kl.reduction)
  # Multiply the per-token KL by the policy ratio pi / pi_old (the loss's ratio, with gradient):
  # unbiased when samples are off policy (TRL's use_bias_correction_kl).
  c.ref_kl.importance_weighted = False

  # On-policy distillation (jaxrl.losses.distill): a frozen teacher with the student's tokenizer
  # scores every sampled token, and the policy term's advantage becomes per token,
  # coef (log p_teacher - log p_sampler) + reward_weight A_task (the task's own advantage).
  c.distill = ConfigDict()
  # "" = off; a jaxrl run directory (its newest checkpoint's policy, its config.json's model) or
  # a Hugging Face model directory (config.json + safetensors).
  c.distill.teacher = ""
  c.distill.coef = 1.0  # weight of the teacher's term coef (log p_teacher - log p_sampler)
  c.distill.reward_weight = 0.0  # 0 = distillation alone; > 0 mixes in the task reward

  # Validation on the held-out `val` split, through the same multi-turn loop as training.
  c.val = ConfigDict()
  c.val.every = 25  # period in RL steps; each pass uses the params of the step it is logged at
  c.val.at_start = True  # also before the first RL step (step 0)
  c.val.at_end = True  # also after the last step
  c.val.batch_size = 1000  # prompts per generation batch (rows = batch_size * samples_per_prompt)
  c.val.samples_per_prompt = 1  # k of val/pass@k
  c.val.temperature = 0.0  # 0 = greedy; samples_per_prompt > 1 needs > 0
  c.val.asynchronous = True  # generate on a thread while training goes on (1 process only)
  c.val.max_wait_s = 600.0  # the trainer waits at most this long for the previous pass

  c.env = ConfigDict()
  c.env.timeout_s = 60.0  # an environment call slower than this fails its rows for the batch

  # Agent tasks (task.name=agent:<module>:<function>, jaxrl.serving.agents): a user's async
  # function plays each episode through an OpenAI client pointed at the run's own server.
  c.agent = ConfigDict()
  # The built-in task whose rows (prompt and data) the agent function is given.
  c.agent.task = "add"
  # Episodes played at once; 0 = every episode of a batch (the engine then batches them all).
  c.agent.max_concurrency = 0
  # An episode slower than this (seconds) fails and is excluded, like a failed environment row.
  c.agent.timeout_s = 60.0
  # The supervised warm-up's stopping rule (dev accuracy) plays the agent's episodes too; false:
  # it scores agent.task's own single sampler pass, as that task's own run does (the warm-up
  # trains agent.task's demonstrations either way).
  c.agent.warmup_through_agent = False

  # Profiling and the per-step time breakdown (jaxrl.observe.profiling).
  c.profile = ConfigDict()
  # "A:B": a jax.profiler trace of RL steps A..B (inclusive, 1-based) into <run_dir>/profile/,
  # for TensorBoard's profile plugin or Perfetto (process 0 only); "" = off.
  c.profile.steps = ""
  # Peak FLOP/s of one device for perf/mfu; 0 = from the device kind (TPU v4-v6e, A100, H100,
  # H200, B200: dense bf16); unknown kinds (CPU) log perf/mfu as null.
  c.profile.peak_flops = 0.0

  # Several processes (hosts), one program: every process gets the same config but its own
  # process_id; the mesh then spans every process's devices. Explicit keys (num_processes > 1)
  # win over what `auto` detects.
  c.distributed = ConfigDict()
  # Join the processes a launcher started (SLURM srun, torchrun-style env vars WORLD_SIZE/RANK/
  # MASTER_ADDR/MASTER_PORT, multi-host TPU VM via TPU_WORKER_HOSTNAMES); false = only the
  # explicit keys below. Used only with num_processes = 1 and coordinator_address = "".
  c.distributed.auto = True
  c.distributed.coordinator_address = ""  # "host:port" of process 0; "" = a single process
  c.distributed.num_processes = 1  # processes of the run; 1 = this one (or what auto finds)
  c.distributed.process_id = 0  # this process's index, 0 .. num_processes - 1
  c.distributed.init_timeout_s = 300  # give up joining after this long
  # A process silent this long (killed, crashed, hung, cut off) ends every process with a message
  # naming it (exit 1); rerunning the same command on every process resumes from the last
  # checkpoint. Also a failing process makes the others stop at once (jaxrl.parallel.peers).
  c.distributed.peer_timeout_s = 60

  # The train mesh (data x fsdp x tensor). Colocated by default: rollouts are generated on the
  # same devices. Disaggregated: `mesh.rollout` devices generate on their own mesh and
  # `mesh.train` devices (default: all the others) train; each is a count (>= 1) or a fraction of
  # the devices (< 1), and the axes above then describe the train devices.
  c.mesh = ConfigDict()
  c.mesh.data = 1  # -1 on one axis: use all remaining (train) devices
  c.mesh.fsdp = 1  # devices the params and optimizer state are sharded over
  c.mesh.tensor = 1  # devices each layer's matmuls are split over (tensor parallel)
  c.mesh.rollout = 0.0  # devices for rollout generation; 0 = colocated on the train mesh
  c.mesh.train = 0.0  # with mesh.rollout: devices for training; 0 = all the others
  # The rollout mesh is (rollout / rollout_tensor, 1, rollout_tensor); colocated on several
  # processes, each process's own devices are split that way (params tensor-parallel there).
  c.mesh.rollout_tensor = 1
  # Disaggregated across processes (hosts): these processes only generate, on their own devices
  # (tensor-parallel by rollout_tensor), and the others only train; e.g. "0". "" = none.
  c.mesh.rollout_processes = ""
  return c
