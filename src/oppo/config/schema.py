"""The settings' schema: one dataclass per section, each field with its help text (:func:`opt`),
the :class:`Config` that holds them with its derived values, and the built-in tasks' presets."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from typing import TYPE_CHECKING

from .. import modes
from ..parts import ALGORITHMS, BACKENDS, LEARNERS, PLACEMENTS, REWARD_TERMS

if TYPE_CHECKING:
    from ..algo.core import AlgorithmSpec


class ConfigError(ValueError):
    """A configuration value is invalid. The message says which and how to fix it."""


AUTO_BACKEND = "auto"
"""``generation.backend=auto``: not a backend, resolved per run (``rollout.registry.resolve_backend``)."""


def _backend_choices() -> tuple[str, ...]:
    """``generation.backend``'s values: auto and the registered rollout backends."""
    return (AUTO_BACKEND, *BACKENDS.names())


def choices_of(f) -> tuple:
    c = f.metadata.get("choices")
    return c() if callable(c) else (c or ())


def opt(default: Any, help: str, choices: Sequence | Callable[[], tuple] | None = None,
        more: Callable[[], list[str]] | None = None) -> Any:
    """A dataclass field with its help text (and the allowed values, when closed: a sequence (read
    when a value is checked or the help printed), or a function giving them; ``more``: further help
    lines, asked when the help is printed)."""
    meta: dict[str, Any] = {"help": help}
    if more is not None:
        meta["more"] = more
    if choices is not None:
        meta["choices"] = choices
    if isinstance(default, (list, dict, tuple)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)  # a fresh copy per instance
    return field(default=default, metadata=meta)


def _by_algorithm(value: Any) -> str:
    """``value(spec)`` for each algorithm, algorithms with the same value named together
    (for help texts: "4 for grpo, rloo; 1 for ppo, reinforce_pp")."""
    names: dict[str, list[str]] = {}
    for spec in map(ALGORITHMS.get, ALGORITHMS.names()):
        names.setdefault(str(value(spec)), []).append(spec.name)
    if len(names) == 1:
        return next(iter(names))
    return "; ".join(f"{v} for {', '.join(n)}" for v, n in names.items())


def _kl_estimators(spec: AlgorithmSpec) -> str:
    return f"{spec.reward_kl_estimator} in the reward, {spec.loss_kl_estimator} in the loss"


MODES = modes.NAMES  # (the one table: oppo.modes)

# Settings that the built-in tasks' tiny models (about 2M parameters) need to learn visibly in a
# few CPU minutes. They apply only when no policy is named and the user has not set the key;
# the general defaults below are for real models (1e-5 would barely move the tiny ones).
TASK_PRESETS: dict[str, dict[str, Any]] = {
    "positive": {"ppo.actor_lr": 1e-4, "ppo.critic_lr": 1e-4, "run.steps": 150},
    # arith, from a one-seed CPU sweep of 200-step runs: PPO at 3e-4 with 4 optimizer steps per batch
    # went from 0.24 to 0.43 accuracy (25-step means), at 1e-4 with 2 from 0.29 to 0.36; 1e-3 first
    # lost accuracy. GRPO (G = 4) got to 0.33 with these settings (0.39 with two epochs); the
    # comparison in benchmarks/arith uses one setting for every algorithm.
    "arith": {"ppo.actor_lr": 3e-4, "ppo.critic_lr": 1e-4, "run.steps": 200, "ppo.batch_size": 64,
              "ppo.minibatch_size": 16, "ppo.micro_batch_size": 16},
}


@dataclass
class PolicyConfig:
    path: str | None = opt(None, "Policy (actor) model: local directory or hub name. Empty: the built-in task's SFT policy.")
    device: str = opt("auto", "Device of the policy and its rollout backend: cpu, cuda, cuda:N or auto (cuda if available).")
    dtype: str = opt("auto", "Compute dtype of every role: float32, bfloat16 or auto (float32 on cpu, bfloat16 on "
                             "cuda). Under bfloat16 the actor and critic train fp32 master weights with fp32 AdamW "
                             "state (bf16 autocast forward); rollout and scorers run bf16 copies synced after each "
                             "update. float16 is refused (no loss scaling).",
                     ("auto", "float32", "bfloat16", "float16"))
    trust_remote_code: bool = opt(False, "Allow custom model code from the model directory (Hugging Face trust_remote_code).")
    gradient_checkpointing: bool = opt(False, "Recompute activations in the backward pass of the actor's and the "
                                              "critic's training forward (less memory, about a third more compute).")


@dataclass
class ReferenceConfig:
    path: str | None = opt(None, "Reference model for the KL penalty. Empty: a frozen copy of the initial policy.")
    device: str = opt("auto", "Device of the reference model (auto: the policy's).")


@dataclass
class CriticConfig:
    path: str | None = opt(None, "Critic initialisation: a causal-LM or sequence-classification checkpoint. "
                                 "Empty: the reward model's path, else the policy's (a new value head is created).")
    device: str = opt("auto", "Device of the critic (auto: the policy's).")


@dataclass
class RewardConfig:
    path: str | None = opt(None, "Reward model (AutoModelForSequenceClassification with one label). "
                                 "Empty with no function: the built-in task's reward model.")
    function: str | None = opt(None, "A Python reward function 'module:function' taking (prompts, responses) as "
                                     "lists of str and returning one float each; replaces the reward model. Further "
                                     "parameters by name get the data set's columns (e.g. answer), raw_prompts and "
                                     "formatted_prompts. From Python also the function itself (docs/python-api.md).")
    terms: list[dict] = opt([], "The trained reward as a weighted sum of reward models and functions, each a "
                                "mapping {path: <reward model>} or {function: <module:function or a built-in of "
                                "oppo.rewards>, kwargs: {...}}, with weight (default 1.0) and name (default: the "
                                "function's or the model directory's; metric reward/<name>/mean). Replaces "
                                "reward.path and reward.function (their one-term case). docs/rewards.md. The "
                                "registered reward terms, by bare name:", more=REWARD_TERMS.help_lines)
    new_head: bool = opt(False, "Accept a causal LM as reward.path and put a fresh one-label head on it, as TRL's "
                                "example scripts do (AutoModelForSequenceClassification with num_labels=1; the "
                                "head seeded, the same in every process). Its scores are random: a check that the "
                                "pipeline runs, not a training signal. A reward model already a one-label "
                                "classifier is loaded as it is. examples/trl_ppo.py sets it, as TRL does.")
    judge: str | None = opt(None, "Optional extra scorer 'module:function', logged as judge/mean, never trained on "
                                  "(the built-in task sets its ground-truth judge).")
    device: str = opt("auto", "Device of the reward model (auto: the policy's).")
    retries: int = opt(0, "Times a reward function that raises is called again on the same batch before the run "
                          "stops (for scorers behind a network: a timeout, a rate limit). 0: no retries. The "
                          "reward model is not retried (it runs in this process).")
    retry_backoff_s: float = opt(1.0, "Seconds before the first retry of reward.retries; each further one waits "
                                      "twice as long as the one before (exponential backoff).")


@dataclass
class DataConfig:
    task: str = opt("positive", "Built-in task used when no models are named (see `oppo prepare`).")
    prompts: str | None = opt(None, "Prompt set: a .jsonl file, a local file or directory that `datasets` loads, "
                                    "or a hub dataset name. Empty: the built-in task's prompts. From Python also a "
                                    "datasets.Dataset, a list of str or a list of dicts (docs/python-api.md).")
    field: str = opt("prompt", "Name of the prompt field in each record.")
    split: str = opt("train", "Dataset split to read when the prompt set has splits.")
    chat_template: bool = opt(False, "Wrap each prompt as a user message with the tokenizer's chat template "
                                     "(error if the tokenizer has none).")
    max_prompt_tokens: int | None = opt(None, "Longest prompt, in tokens; longer ones are handled by on_long_prompt "
                                        "(a console line says how many). Empty: the models' positions less "
                                        "generation.max_new_tokens (every prompt that fits is kept whole).")
    on_long_prompt: str = opt("truncate", "What to do with a prompt longer than max_prompt_tokens: "
                                          "truncate (keep BOS and the chat template's framing, cut the start of the text) or "
                                          "skip. Counted in the metrics.",
                              ("truncate", "skip"))
    shuffle: bool = opt(True, "Shuffle the prompts each epoch (seeded).")


@dataclass
class GenerationConfig:
    max_new_tokens: int | None = opt(None, "Longest response, in tokens. Empty: the built-in task's default, else 256.")
    temperature: float = opt(1.0, "Sampling temperature; the behaviour and reference log-probs use the same one.")
    top_p: float = opt(1.0, "Nucleus sampling threshold (1.0: off).")
    top_k: int = opt(0, "Sample among the k most likely tokens (0: off).")
    backend: str = opt("auto", "Rollout backend: auto (static with CUDA graphs when the policy is on CUDA and its "
                               "architecture suits it, else eager; the run's log says which ran and why), or a "
                               "registered backend by name (its own settings are rollout.<name>.*):", _backend_choices,
                     BACKENDS.help_lines)
    kv_budget_mb: float = opt(0.0, "Most memory the actor's KV cache may take, in MiB; a step that would exceed it "
                                    "stops with an error naming the settings to lower (0: no limit). The per-step "
                                    "peak is reported as memory/actor_kv_peak_mb. A backend with a KV cache "
                                    "of its own may read it as that cache's size (its help says).")


@dataclass
class PPOConfig:
    batch_size: int = opt(32, "B: sequences per PPO step (the rollout batch).")
    minibatch_size: int = opt(16, "Sequences per optimizer step; batch_size must be a multiple of it.")
    micro_batch_size: int = opt(8, "Sequences per forward/backward pass (gradient accumulation), on average: "
                                   "minibatch_size must be a multiple of it, and a minibatch makes minibatch_size / "
                                   "micro_batch_size micro-batches. Packed (ppo.packing), each carries about the same "
                                   "token count (so some hold more, shorter sequences); unpacked, each holds "
                                   "micro_batch_size rows, longest first.")
    micro_batch_tokens: int = opt(-1, "Token budget of a forward/backward pass (verl's dynamic batch size); 0: none; "
                                      "-1: sized to the device (oppo.learner.budget): on CUDA a share of the free "
                                      "memory at start over what a token keeps for the backward (tens of thousands "
                                      "of tokens at 1B on an H200), the budget alone cutting a minibatch (as if "
                                      "micro_batch_size were the minibatch), logged; on CPU none. "
                                     "Packed (ppo.packing): a minibatch makes more micro-batches while one of several "
                                     "sequences would hold more than N real tokens, and a micro-batch's rows x width "
                                     "(its widest packed row) stay within N where a layout can. Unpacked: a "
                                     "micro-batch takes rows, longest first, while rows x its width (its longest row: "
                                     "prompt + response) stays within N and it has at most micro_batch_size rows. "
                                     "Either way a sequence longer than N goes alone, and activation memory is bounded "
                                     "by N. The loss is the same either way.")
    micro_batch_padding: float = opt(0.0, "Most padding a forward may compute, as a share of its positions "
                                          "(rows x width); 0: off. Unpacked: a row that would push the micro-batch "
                                          "past it starts the next one (rows longest first), so the whole update "
                                          "computes at most that share of padding (perf/train_padded_frac); 0.1 "
                                          "keeps it under the 10% verl's dynamic batches aim at. Packed: a micro-"
                                          "batch's rows are laid out within it (one row always is: no padding). The "
                                          "loss is the same either way.")
    packing: str = opt("auto", "How every forward over many sequences (actor and critic training, old log-probs, "
                               "one-shot reward, reference and critic scoring) lays them out. auto: whole sequences "
                               "end to end in rows, position ids restarting at 0 for each, the model's own attention "
                               "keeping them apart (transformers' packed-sequence masks; checked once per model by a "
                               "probe forward), micro-batches of balanced token counts; a model that cannot pack is "
                               "named in a warning and runs padded. on: as auto, but a model that cannot pack stops "
                               "the run. off: one sequence a row, padded to the micro-batch's longest, rows longest "
                               "first (the layout before packing). The numbers are each sequence's own forward's "
                               "either way.", ("auto", "on", "off"))
    shape_buckets: str = opt("auto", "Shapes from a small fixed set, so that what the GPU stack keys on shapes "
                                     "(cuDNN attention plans, CUDA graphs, compiled kernels) is paid once per run "
                                     "instead of once per call: the rows and widths of every forward over many "
                                     "sequences (training, old log-probs, one-shot scoring) rounded up to ladders "
                                     "(oppo.shapes), and the streamed chunks scored against a slot cache of "
                                     "bucketed rows and length. auto: on where the model is on CUDA; on; off: exact "
                                     "shapes. The numbers are the same either way (the added positions are padding, "
                                     "counted in perf/train_padded_frac).", ("auto", "on", "off"))
    attention: str = opt("auto", "The attention path of every model (oppo.kernels.attention). auto: on CUDA, a short "
                                 "probe at start times a forward and backward of the policy under each SDPA path (torch's "
                                 "own order with grouped K/V heads not copied, cuDNN, memory-efficient) that keeps "
                                 "packed sequences apart, first calls at several widths and the steady state, refuses "
                                 "a path whose gradients are not finite or differ from the math path, never pins "
                                 "cuDNN where torch itself would not choose it, and every model takes the cheapest "
                                 "(logged); on CPU the models keep the path they loaded with. inherit: as loaded. "
                                 "Or a path by name: sdpa, oppo_sdpa_gqa, oppo_sdpa_cudnn, oppo_sdpa_efficient, "
                                 "oppo_sdpa_math, eager, flex_attention, flash_attention_2, flash_attention_3, a hub "
                                 "kernel (org/repo) (flex and flash take no 4-D mask: the static backend then "
                                 "runs eager and the scorers a dynamic cache).")
    epochs: int = opt(1, "PPO epochs over each batch.")
    actor_lr: float = opt(1e-5, "Actor (policy) learning rate (AdamW).")
    critic_lr: float = opt(5e-5, "Critic learning rate (AdamW).")
    weight_decay: float = opt(0.0, "AdamW weight decay for actor and critic.")
    max_grad_norm: float = opt(1.0, "Gradient clipping by global norm (0: off).")
    lr_warmup_steps: int = opt(0, "Optimizer steps over which each learning rate ramps linearly up to ppo.actor_lr / "
                                  "ppo.critic_lr (0: none). Counted by the optimizer itself, so a resumed run "
                                  "continues the ramp.")
    nonfinite: str = opt("error", "A non-finite loss, gradient norm or advantage (docs/implementation-details.md, "
                                  "the non-finite guard). error: stop the run with a message naming the step, the "
                                  "stage, the tensor and the first rows or parameters, before any optimizer step, "
                                  "weight sync or checkpoint. skip: skip that optimizer step (a minibatch's, actor "
                                  "and critic alike; the whole update for non-finite advantages), warn, and count "
                                  "it in guard/skipped_updates. A non-finite updated weight stops the run in either.",
                         ("error", "skip"))
    kl_coef: float | None = opt(None, "beta: weight of the per-token KL(pi || ref) penalty (in the reward, or in "
                                      "the loss: algo.kl_placement). Empty: the algorithm's default "
                                      f"({_by_algorithm(lambda s: s.kl_coef)}); the value in effect is the "
                                      "kl/coef metric.")
    kl_estimator: str = opt("auto", f"Per-token KL estimator. auto: {_by_algorithm(_kl_estimators)}.",
                            ("auto", "k1", "k2", "k3", "abs"))
    clip_eps: float = opt(0.2, "PPO ratio clip range (lower, and upper unless clip_eps_high is set).")
    clip_eps_high: float | None = opt(None, "Upper ratio clip (decoupled clipping). Empty: clip_eps.")
    dual_clip: float | None = opt(None, "Dual clip (Ye et al. 2020, 'Mastering Complex Control in MOBA Games'): "
                                        "the constant c > 1 that caps the clipped loss of tokens with negative "
                                        "advantage at -c * A, so that a token whose ratio exploded cannot dominate "
                                        "the update (ppo/dual_clipfrac: the share capped). Empty: off.")
    value_clip_eps: float | None = opt(0.2, "Value clip range around the rollout values. Empty: no value clipping.")
    gamma: float = opt(1.0, "GAE discount.")
    lam: float = opt(0.95, "GAE lambda.")
    whiten_advantages: bool = opt(True, "Normalise advantages over the batch (masked mean 0, std 1).")
    entropy_coef: float = opt(0.0, "Entropy bonus weight in the actor loss.")
    missing_eos_penalty: float | None = opt(None, "Subtract this from the score of responses that hit "
                                                  "max_new_tokens without EOS. Empty: off.")
    loss_agg: str = opt("token_mean", "Loss aggregation; token_mean averages over all response tokens of the batch, "
                                      "independent of how it is split.",
                        ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"))
    old_logprobs: str = opt("auto", "Log-probs the PPO ratio is centred on for tokens sampled by the current policy: "
                                    "recompute (the training forward, as OpenRLHF and verl do), sampler (the "
                                    "sampler's own), or auto: recompute when the two can differ (a dtype other "
                                    "than float32, top-k/top-p truncation). Off-policy tokens are always recomputed.",
                            ("auto", "recompute", "sampler"))
    is_truncate: float | None = opt(2.0, "Truncate importance weights pi_old/pi_behaviour of off-policy tokens at this "
                                         "value (carried sequences). Empty: no truncation.")


@dataclass
class OverlapConfig:
    mode: str = opt("oppo", modes.help_text(), MODES)
    chunk_size: int = opt(0, "Tokens per streamed chunk. 0: chosen online among chunk_candidates.")
    chunk_candidates: list = opt([16, 0, 8, 32], "Chunk sizes the controller tries, the first one first; 0 is no "
                                                  "streaming (the scorers score the closed batch one-shot, which "
                                                  "pays where they share the actor's hardware). The reward_slope "
                                                  "rule's chunk tuner skips 0.")
    trial_steps: int = opt(2, "Fewest measured steps per trial of a setting (Delta or chunk), after a warm-up step "
                              "where the change reaches across the step boundary (carried rows, pipeline); the cost "
                              "rule measures up to three times as many while a trial is a close call.")
    retune_every: int = opt(50, "Steps the chosen setting holds before the controller tries its neighbours again "
                                "(cost rule: doubled after a round that changes nothing, up to 4x).")
    delta: int = opt(-1, "Delta: extra sequences (groups) in flight beyond B. -1: adaptive, by overlap.delta_rule.")
    delta_rule: str = opt("cost", "Adaptive Delta: cost: the overlap controller (oppo.scheduler.tuner) keeps a Delta, and a "
                                  "chunk size, only while it lowers the measured seconds per trained token by "
                                  "tune_margin, within max_stale_share, and falls back to delta_min when carrying "
                                  "stops paying; each change is logged with its reason. reward_slope: the OPPO "
                                  "paper's rule, Delta +1 while the mean reward rises over delta_window steps, -1 "
                                  "otherwise (chunk sizes tried in turn, the fastest kept).", ("cost", "reward_slope"))
    tune_margin: float = opt(0.05, "cost rule: the relative saving a change must show over a trial to be kept (a "
                                   "step back to less Delta is kept unless it costs this much more).")
    max_stale_share: float = opt(0.5, "cost rule: the most that carrying may add to the share of trained tokens "
                                      "sampled by an older policy (over the share at delta_min); a Delta that "
                                      "adds more is not kept, however much it saves.")
    delta_init: int = opt(8, "reward_slope rule: starting Delta (kept within the bounds below). The cost rule "
                             "starts at delta_min.")
    delta_min: int = opt(0, "Adaptive Delta: lower bound (capped at delta_max).")
    delta_max: int = opt(16, "Adaptive Delta: upper bound (capped at ppo.batch_size: more carried sequences "
                             "than B could come due at once).")
    delta_window: int = opt(5, "reward_slope rule: steps in the reward-slope window.")
    delta_proportional: bool = opt(False, "reward_slope rule: step by max(1, Delta // 4) instead of 1.")
    max_lag: int = opt(1, "Most steps a sequence may be carried; then the step waits for it. (pipeline: a token "
                          "may be one version older still, sampled while the learner trained.)")
    stale_kv: str = opt("keep", "Policy KV cache of a carried prefix after a weight update: keep or recompute.",
                        ("keep", "recompute"))
    stale_values: str = opt("recompute", "Critic values of a carried prefix after a critic update: keep or recompute.",
                            ("keep", "recompute"))
    refill: bool = opt(False, "Admit a new prompt as soon as a sequence finishes (continuous batching) instead of "
                              "only at step start.")
    partial_groups: str = opt("carry", "Groups (algo.group_size > 1) that are partly finished when a step closes: "
                                       "carry them whole into the next step (their finished members wait, "
                                       "scored), or wait for their running members before closing. Groups with no "
                                       "finished member are carried either way.", ("carry", "wait"))


@dataclass
class LoraConfig:
    r: int = opt(0, "LoRA rank of the policy's adapters (peft). 0: full fine-tuning. With LoRA the base weights "
                    "stay frozen in the compute dtype, only the adapters train (fp32), the reference is the base "
                    "model without adapters (shared weights, no second copy) and checkpoints save the adapter.")
    alpha: float = opt(16.0, "LoRA alpha (the adapter's scale is alpha / r).")
    dropout: float = opt(0.0, "LoRA dropout; must be 0. Every model runs in eval mode (rollout, old log-probs "
                              "and training must see the same function, or the PPO ratio is noise at pi_k), so "
                              "a dropout would never apply: it is refused rather than ignored.")
    target_modules: list = opt([], "Module names to adapt, e.g. [q_proj, v_proj]. Empty: every linear layer but "
                                    "the output head (peft's all-linear).")


def _own_section(section: Any, name: str, what: str, part: str) -> Any:
    """A part's own settings held in ``section.by_name`` (``cfg.placement.ray``, ``cfg.algo.grpo``), as an
    attribute of the section (its ``__getattr__``: asked only for names that are no field)."""
    by_name = section.__dict__.get("by_name")
    if by_name is not None and name in by_name:
        return by_name[name]
    raise AttributeError(f"{what} has no setting or {part} named {name!r}")


def _algo_lines() -> list[str]:
    """``algo.name``'s help: each registered algorithm (``oppo.algo``) with its own settings."""
    cfg = Config()
    return [line for name in ALGORITHMS.names() for line in ALGORITHMS.get(name).help_lines(cfg)]


@dataclass
class AlgoConfig:
    name: str = opt("ppo", "The RL algorithm, one of those registered (oppo.algo.register, or the oppo.algorithms "
                           "entry point group), each listed below with its needs, defaults and own settings. A "
                           "critic-free one loads, scores, trains and checkpoints no critic.", ALGORITHMS.live_names(),
                    more=_algo_lines)
    group_size: int = opt(0, "G: responses sampled per prompt, admitted, scored and trained together. "
                             f"0: the algorithm's default ({_by_algorithm(lambda s: s.group_size)}).")
    kl_placement: str = opt("auto", "Where the KL(pi || ref) penalty goes: reward (per token, subtracted from the "
                                    "rewards) or loss (a term of the actor loss). auto: the algorithm's "
                                    f"({_by_algorithm(lambda s: s.kl_placement)}).", ("auto", "reward", "loss"))
    by_name: dict = field(default_factory=ALGORITHMS.default_settings, metadata={"sections": True})
    """The algorithms' own settings, ``{name: its settings dataclass}`` (``algo.<name>.<field>``: the
    estimator's and the loss's, ``AlgorithmSpec.settings``)."""

    def __getattr__(self, name: str) -> Any:  # cfg.algo.grpo: that algorithm's own settings
        return _own_section(self, name, "algo", "algorithm")


@dataclass
class PlacementConfig:
    """Where each role runs and how much hardware it gets; none of it changes the math (a checkpoint
    resumes under another placement). The overlap mode's behaviour is ``overlap.*``. Each
    registered placement's own settings are ``placement.<name>.*`` (``oppo.placements``)."""

    name: str = opt("local", "Where the roles run: a registered placement (oppo.placements), its own settings "
                             "placement.<name>.*:", PLACEMENTS.names, PLACEMENTS.help_lines)
    learner: str = opt("replicate", "The learner engine: how the learner trains and how its ranks split the "
                                    "trained state (registered engines; oppo.learner.registry), its own settings "
                                    "learner.<engine>.* (how many Ray ranks and what each gets):",
                       LEARNERS.names, LEARNERS.help_lines)
    threads: int = opt(0, "torch CPU threads of this process for sequential work (0: all cores).")
    actor_threads: int = opt(1, "CPU: torch threads of the actor (decoding and, with "
                                "placement.local.critic_on_worker, training) in overlapped modes; also each "
                                "Ray rank's and rollout replica's.")
    scorer_threads: int = opt(1, "CPU: torch threads of the scorer worker (or Ray scorer actor) in overlapped modes.")
    by_name: dict = field(default_factory=PLACEMENTS.default_settings, metadata={"sections": True})
    """The placements' own settings, ``{name: its settings dataclass}`` (``placement.<name>.<field>``)."""

    def __getattr__(self, name: str) -> Any:  # cfg.placement.ray: that placement's own settings
        return _own_section(self, name, "placement", "placement")


@dataclass
class RunConfig:
    steps: int = opt(40, "PPO steps to run.")
    seed: int = opt(0, "Seed for data order, sampling and initialisation.")
    out_dir: str = opt("runs/latest", "Run directory: metrics, trace, checkpoints. A directory named latest (the "
                                      "default runs/latest) is a link: each run gets runs/<date>-<time>-<mode>/ and "
                                      "the link points to the newest. Any other directory is the run directory "
                                      "itself; a new run refuses one that already holds a run.")
    save_every: int = opt(0, "Checkpoint every N steps (0: none on a step count; the last one is run.save_final's).")
    save_final: str = opt("full", "The checkpoint at the end of the run. full: resumable (weights, AdamW state, "
                                  "RNG, sequences in flight). weights: the policy (and critic) in Hugging Face "
                                  "format with the tokenizer, no optimizer state (for a full-parameter model "
                                  "AdamW's state is twice the fp32 weights); a run cannot resume from it. none: "
                                  "no final checkpoint (those written during the run are kept). A stopped run "
                                  "(SIGTERM, Ctrl-C) always saves a full one.", ("full", "weights", "none"))
    save_every_minutes: float = opt(30.0, "Also checkpoint once this many minutes have passed since the last one "
                                          "(0: off); SIGTERM and Ctrl-C checkpoint too, so a crash loses at most this.")
    keep_checkpoints: int = opt(2, "Most recent checkpoints kept (older ones are deleted).")
    samples: int = opt(3, "Sample responses printed at the start and at the end.")
    allow_changed_models: bool = opt(False, "On resume, continue although the reference model, reward model, critic "
                                            "initialisation or tokenizer holds other weights than when the checkpoint "
                                            "was saved (a re-export at the same path), or the prompt set or chat "
                                            "template differs: a warning names them. Without it such a resume is "
                                            "refused.")


@dataclass
class LogConfig:
    tensorboard: bool = opt(False, "Also write TensorBoard event files into the run directory.")
    wandb: bool = opt(False, "Also log to Weights & Biases (needs `pip install wandb`).")
    wandb_project: str = opt("oppo", "Weights & Biases project.")
    trace: bool = opt(True, "Record each lane's busy spans (actor, scorer, learner, ...) to trace.json (Chrome trace format, open in Perfetto).")
    progress: bool = opt(True, "Show a progress bar.")


@dataclass
class Config:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    rollout: dict[str, Any] = field(default_factory=BACKENDS.default_settings)
    """The rollout backends' own settings, ``{backend name: its settings dataclass}``
    (``rollout.<backend>.<field>``; ``oppo.rollout.registry``)."""
    learner: dict[str, Any] = field(default_factory=LEARNERS.default_settings)
    """The learner engines' own settings, ``{engine name: its settings dataclass}``
    (``learner.<engine>.<field>``; ``oppo.learner.registry``)."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    run: RunConfig = field(default_factory=RunConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def uses_builtin_task(self) -> bool:
        return self.policy.path is None

    @property
    def streams(self) -> bool:
        """Intra-step overlap: chunks stream to the scorers while the actor decodes."""
        return modes.get(self.overlap.mode).streams

    @property
    def algo_spec(self) -> AlgorithmSpec:
        """The spec of ``algo.name`` (``oppo.algo``): its defaults, and what it needs."""
        return ALGORITHMS.get(self.algo.name)

    @property
    def group_size(self) -> int:
        return self.algo.group_size or self.algo_spec.group_size

    @property
    def kl_placement(self) -> str:
        if self.algo.kl_placement != "auto":
            return self.algo.kl_placement
        return self.algo_spec.kl_placement

    @property
    def kl_estimator(self) -> str:
        if self.ppo.kl_estimator != "auto":
            return self.ppo.kl_estimator
        return self.algo_spec.kl_estimator_for(self.kl_placement)

    @property
    def kl_coef(self) -> float:
        """beta in effect: ``ppo.kl_coef``, or the algorithm's default when it is empty."""
        return self.ppo.kl_coef if self.ppo.kl_coef is not None else self.algo_spec.kl_coef

    @property
    def needs_critic(self) -> bool:
        return self.algo_spec.needs_critic

    @property
    def carries(self) -> bool:
        """Inter-step overlap: overcommit and carry unfinished sequences across steps."""
        return modes.get(self.overlap.mode).carries

    @property
    def in_flight(self) -> bool:
        """In-flight weight updates (PipelineRL): the learner trains in the background while the
        backend decodes; new weights load between decode steps."""
        return modes.get(self.overlap.mode).in_flight


def sections(cfg: Any) -> list[tuple[str, Any]]:
    """(name, settings object) of every section: ``policy`` ... ``log``, ``rollout.<backend>`` for
    each registered backend with settings of its own, and ``placement.<name>`` for each placement's."""
    out = []
    for s in dataclasses.fields(cfg):
        value = getattr(cfg, s.name)
        if isinstance(value, dict):
            out += [(f"{s.name}.{name}", own) for name, own in value.items()]
            continue
        out.append((s.name, value))
        for f in dataclasses.fields(value):
            if f.metadata.get("sections"):
                out += [(f"{s.name}.{name}", own) for name, own in getattr(value, f.name).items()]
    return out


def fields_of(section: Any) -> list[dataclasses.Field]:
    """A section's settings (not the sections it holds: ``placement.by_name``)."""
    return [f for f in dataclasses.fields(section) if not f.metadata.get("sections")]


def all_keys(cfg: Config | None = None) -> list[str]:
    cfg = cfg or Config()
    return [f"{name}.{f.name}" for name, section in sections(cfg) for f in fields_of(section)]
