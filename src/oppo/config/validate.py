"""Checking a Config: :func:`validate` raises ConfigError on the first invalid value, with a
message that names the fix; it never changes a value. One check per section, in a fixed order."""

from __future__ import annotations

import math

from ..parts import BACKENDS, LEARNERS, PLACEMENTS, REWARD_TERMS
from ..rewards.terms import parse_terms
from .schema import AUTO_BACKEND, Config, ConfigError, choices_of, fields_of, sections


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_choices(cfg: Config) -> None:
    """Every setting with a closed set of values holds one of them."""
    for name, section in sections(cfg):
        for f in fields_of(section):
            choices = choices_of(f)
            v = getattr(section, f.name)
            if choices and v not in choices:
                raise ConfigError(f"{name}.{f.name}={v!r} is not one of {', '.join(map(str, choices))}.")


def _check_ppo_batches(cfg: Config) -> None:
    """ppo's batch sizes divide each other; its step sizes and counts are in range."""
    p = cfg.ppo
    _check(p.batch_size >= 1, f"ppo.batch_size must be >= 1, got {p.batch_size}.")
    _check(p.minibatch_size >= 1 and p.batch_size % p.minibatch_size == 0,
           f"ppo.batch_size={p.batch_size} must be a multiple of ppo.minibatch_size={p.minibatch_size}; "
           f"set ppo.minibatch_size to a divisor of {p.batch_size}.")
    _check(p.micro_batch_size >= 1 and p.minibatch_size % p.micro_batch_size == 0,
           f"ppo.minibatch_size={p.minibatch_size} must be a multiple of ppo.micro_batch_size="
           f"{p.micro_batch_size}; set ppo.micro_batch_size to a divisor of {p.minibatch_size}.")
    _check(0.0 <= p.micro_batch_padding < 1.0 and math.isfinite(p.micro_batch_padding),
           f"ppo.micro_batch_padding must be a share in [0, 1) (0: off; 0.1: at most 10% padding), got "
           f"{p.micro_batch_padding}.")
    _check(p.micro_batch_tokens >= -1, f"ppo.micro_batch_tokens must be >= 0 (0: micro-batches by rows only) or -1 "
                                       f"(sized to the device), got {p.micro_batch_tokens}.")
    _check(p.epochs >= 1, f"ppo.epochs must be >= 1, got {p.epochs}.")
    _check(p.actor_lr >= 0 and p.critic_lr >= 0, "ppo.actor_lr and ppo.critic_lr must be >= 0.")
    _check(p.kl_coef is None or (math.isfinite(p.kl_coef) and p.kl_coef >= 0),
           f"ppo.kl_coef must be a finite number >= 0 (0: no KL penalty; empty: the algorithm's default), "
           f"got {p.kl_coef}.")
    _check(p.lr_warmup_steps >= 0, f"ppo.lr_warmup_steps must be >= 0 (0: no warm-up), got {p.lr_warmup_steps}.")


def _check_lora(cfg: Config) -> None:
    """LoRA's sizes, and what it shares with the reference."""
    _check(cfg.lora.r >= 0 and cfg.lora.alpha > 0, "lora.r must be >= 0 and lora.alpha > 0.")
    _check(cfg.lora.dropout == 0,
           f"lora.dropout={cfg.lora.dropout} would do nothing: oppo runs every model in eval mode, so that "
           f"rollout, old log-probs and training compute the same function (dropout in the training forward "
           f"alone would make the PPO ratio noise at pi_k). Set lora.dropout=0.")
    _check(not (cfg.lora.r and not cfg.reference.path and cfg.reference.device not in ("auto", cfg.policy.device)),
           "With LoRA the reference is the policy's base weights (shared, no copy), on the policy's device: "
           "leave reference.device=auto or set reference.path to a separate reference model.")


def _check_algorithm(cfg: Config) -> None:
    """The group size fits the algorithm and the batch; the KL term can train; the algorithm's own checks."""
    p = cfg.ppo
    a, G = cfg.algo, cfg.group_size
    _check(a.group_size >= 0, f"algo.group_size must be >= 0 (0: the algorithm's default), got {a.group_size}.")
    need = cfg.algo_spec.min_group_size
    _check(G >= need, f"algo.name={a.name} compares the responses to one prompt and needs algo.group_size >= {need}, "
                      f"got {G}.")
    _check(p.batch_size % G == 0, f"ppo.batch_size={p.batch_size} must be a multiple of the group size {G} "
                                  f"(algo.group_size): a step trains whole groups.")
    _check(not (cfg.kl_placement == "loss" and cfg.kl_estimator in ("k1", "abs")),
           f"ppo.kl_estimator={cfg.kl_estimator} as a loss term has no useful gradient (k1's is zero in "
           f"expectation); use k3 (GRPO's) or k2, or algo.kl_placement=reward.")
    for problem in cfg.algo_spec.problems(cfg):  # its own settings and checks
        raise ConfigError(problem)


def _check_ppo_loss(cfg: Config) -> None:
    """The loss's clip, discount and truncation settings, and a dtype that trains."""
    p = cfg.ppo
    _check(0 < p.clip_eps < 1, f"ppo.clip_eps must be in (0, 1), got {p.clip_eps}.")
    _check(p.dual_clip is None or (math.isfinite(p.dual_clip) and p.dual_clip > 1),
           f"ppo.dual_clip must be a finite number > 1 (the cap -c * A on tokens with negative advantage; 3 is "
           f"common), or empty for off; got {p.dual_clip}.")
    _check(0 <= p.gamma <= 1 and 0 <= p.lam <= 1, "ppo.gamma and ppo.lam must be in [0, 1].")
    _check(p.is_truncate is None or p.is_truncate >= 1, "ppo.is_truncate must be >= 1 (or empty for none).")
    _check(cfg.policy.dtype != "float16",
           "policy.dtype=float16 would train without loss scaling (gradients underflow); use bfloat16 "
           "(fp32 master weights, bf16 compute) or float32.")


def _check_generation(cfg: Config) -> None:
    """Sampling settings that make a behaviour policy, and the prompt length."""
    g = cfg.generation
    _check(g.max_new_tokens is None or g.max_new_tokens >= 1, "generation.max_new_tokens must be >= 1.")
    _check(g.temperature > 0, f"generation.temperature must be > 0, got {g.temperature}; "
                              "greedy decoding is not a PPO behaviour policy.")
    _check(0 < g.top_p <= 1, f"generation.top_p must be in (0, 1], got {g.top_p}.")
    _check(g.top_k >= 0, f"generation.top_k must be >= 0, got {g.top_k}.")
    _check(g.kv_budget_mb >= 0, f"generation.kv_budget_mb must be >= 0 (0: no limit), got {g.kv_budget_mb}.")
    _check(cfg.data.max_prompt_tokens is None or cfg.data.max_prompt_tokens >= 1,
           "data.max_prompt_tokens must be >= 1 (or empty: the models' positions less generation.max_new_tokens).")


def _check_overlap(cfg: Config) -> None:
    """The overlap controller's chunk and Delta settings, and what carrying allows."""
    p, o, G = cfg.ppo, cfg.overlap, cfg.group_size
    _check(o.chunk_size >= 0, f"overlap.chunk_size must be >= 0 (0: online tuning), got {o.chunk_size}.")
    _check(bool(o.chunk_candidates) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                                            for c in o.chunk_candidates)
           and len(set(o.chunk_candidates)) == len(o.chunk_candidates),
           f"overlap.chunk_candidates must be a non-empty list of distinct integers >= 0 (0: one-shot scoring), "
           f"got {o.chunk_candidates}.")
    _check(o.delta_rule != "reward_slope" or any(c >= 1 for c in o.chunk_candidates),
           "overlap.delta_rule=reward_slope tunes chunk sizes only: give overlap.chunk_candidates a size >= 1.")
    _check(o.trial_steps >= 1 and o.retune_every >= 1,
           f"overlap.trial_steps and overlap.retune_every must be >= 1, got {o.trial_steps}, {o.retune_every}.")
    _check(0 <= o.tune_margin < 1, f"overlap.tune_margin must be a share in [0, 1) (0.05: 5%), got {o.tune_margin}.")
    _check(0 <= o.max_stale_share <= 1,
           f"overlap.max_stale_share must be a share in [0, 1] (0: never carry), got {o.max_stale_share}.")
    _check(o.max_lag >= 0, f"overlap.max_lag must be >= 0, got {o.max_lag}.")
    _check(o.delta >= -1, f"overlap.delta must be >= 0, or -1 for adaptive, got {o.delta}.")
    _check(min(o.delta_min, o.delta_init, o.delta_max) >= 0,
           f"overlap.delta_min, delta_init and delta_max must be >= 0, got {o.delta_min}, {o.delta_init}, "
           f"{o.delta_max}.")
    if cfg.carries:
        if G == 1:
            _check(o.delta <= p.batch_size, f"overlap.delta={o.delta} must not exceed ppo.batch_size={p.batch_size} "
                                            f"(more carried sequences than B could come due at once); lower it.")
        else:
            _check(o.delta <= p.batch_size // G,
                   f"overlap.delta={o.delta} counts groups of {G} and must not exceed ppo.batch_size / group size = "
                   f"{p.batch_size // G} (more carried groups than a batch could come due at once); lower it.")
        _check(not (o.max_lag == 0 and (o.delta > 0 or (o.delta < 0 and o.delta_max > 0))),
               "overlap.max_lag=0 forbids carrying, so Delta must be 0: set overlap.delta=0 or overlap.max_lag>=1.")


def _check_placement(cfg: Config) -> None:
    """Where the roles run: cores, then the placement's own checks, then that its learner engine
    runs under it and the engine's own checks."""
    pl = cfg.placement
    _check(pl.threads >= 0, f"placement.threads must be >= 0 (0: all cores), got {pl.threads}.")
    _check(pl.actor_threads >= 1 and pl.scorer_threads >= 1,
           "placement.actor_threads and placement.scorer_threads must be >= 1.")
    problems = PLACEMENTS.checks(pl.name, pl.by_name.get(pl.name), cfg)
    spec, engine = PLACEMENTS.get(pl.name), LEARNERS.get(pl.learner)
    if not engine.runs_under(spec.remote):
        fits = [n for n in PLACEMENTS.names() if engine.runs_under(PLACEMENTS.get(n).remote)]
        others = [n for n in LEARNERS.names() if LEARNERS.get(n).runs_under(spec.remote)]
        problems.append(f"placement.learner={engine.name} runs {engine.where()}, not under placement.name={spec.name}: "
                        f"set placement.name={' or '.join(fits) or '(none registered)'}, or placement.learner="
                        f"{' or '.join(others)}.")
    else:
        problems += LEARNERS.checks(pl.learner, cfg.learner.get(pl.learner), cfg)
    _check(not problems, "\n".join(problems))


def _check_rollout_backend(cfg: Config) -> None:
    """The chosen rollout backend's own checks of its settings against the run's."""
    g = cfg.generation
    if g.backend != AUTO_BACKEND:
        problems = BACKENDS.checks(g.backend, cfg.rollout.get(g.backend), cfg)
        _check(not problems, "\n".join(problems))


def _check_run(cfg: Config) -> None:
    """Checkpoint cadence and retention."""
    _check(cfg.run.save_every >= 0, "run.save_every must be >= 0.")
    _check(cfg.run.save_every_minutes >= 0, "run.save_every_minutes must be >= 0.")
    _check(cfg.run.keep_checkpoints >= 1, "run.keep_checkpoints must be >= 1.")


def _check_reward(cfg: Config) -> None:
    """One reward source, well formed, and a reward whenever a policy is named."""
    _check(not (cfg.reward.path and cfg.reward.function),
           "Give either reward.path (a reward model) or reward.function (a Python function), not both.")
    _check(cfg.reward.retries >= 0, f"reward.retries must be >= 0 (0: no retries), got {cfg.reward.retries}.")
    _check(cfg.reward.retry_backoff_s >= 0,
           f"reward.retry_backoff_s must be >= 0 seconds, got {cfg.reward.retry_backoff_s}.")
    for key in ("reward.function", "reward.judge"):
        v = getattr(cfg.reward, key.split(".")[1])
        builtin = REWARD_TERMS.names()
        _check(v is None or (":" in v and all(v.split(":", 1))) or (key == "reward.function" and v in builtin),
               f"{key}={v!r} must look like 'package.module:function'"
               + (f" or be a built-in reward ({', '.join(builtin)})." if key == "reward.function" else "."))
    if cfg.reward.terms:
        _check(cfg.reward.path is None and cfg.reward.function is None,
               "Give either reward.terms or reward.path / reward.function, not both (a one-term list is "
               "reward.terms=[{path: ...}]).")
        try:
            parse_terms(cfg.reward.terms)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.policy.path is not None:
        _check(cfg.reward.path is not None or cfg.reward.function is not None or bool(cfg.reward.terms),
               "policy.path is set but no reward: set reward.path (a reward model), reward.function "
               "('module:function') or reward.terms.")


def _check_devices(cfg: Config) -> None:
    """Each model's device is cpu, cuda, cuda:N or auto."""
    for key in ("policy.device", "reference.device", "critic.device", "reward.device"):
        d = getattr(getattr(cfg, key.split(".")[0]), "device")
        _check(d in ("auto", "cpu", "cuda") or d.startswith("cuda:"),
               f"{key}={d!r} must be cpu, cuda, cuda:N or auto.")


def _check_attention(cfg: Config) -> None:
    """ppo.attention names a path oppo or transformers knows (oppo.kernels.names.check_name: torch-free),
    so a typo stops here, not after the models load with transformers' message."""
    from ..kernels.names import check_name

    why = check_name(cfg.ppo.attention)
    _check(why is None, str(why))


def validate(cfg: Config) -> None:
    """Raise ConfigError on the first invalid value. Never changes a value. The settings that the
    config's own rules decide come first, then the two that ask a lower module (the attention
    kernels' names, the reward terms' registry)."""
    _check_choices(cfg)
    _check_ppo_batches(cfg)
    _check_lora(cfg)
    _check_algorithm(cfg)
    _check_ppo_loss(cfg)
    _check_generation(cfg)
    _check_overlap(cfg)
    _check(cfg.run.steps >= 0, "run.steps must be >= 0.")
    _check_placement(cfg)
    _check_rollout_backend(cfg)
    _check_run(cfg)
    _check_devices(cfg)
    _check_attention(cfg)
    _check_reward(cfg)
