"""Loading what a run decided (``setup.resolve``): the scoring functions, the tokenizer and the
prompts, then every model, cheapest and likeliest to fail first, so that bad input fails before
anything expensive: the functions, the prompts with the columns they ask for, every role's config
and tokenizer, the reward model, then the big models.

Objects given from Python (``inputs.Inputs``) stand in for the paths their settings name by a
marker; they get the checks a loaded model gets and are moved to the role's device and dtype in
place."""

from __future__ import annotations

import copy
import sys
from typing import Any, Callable

import torch

from ..api.roles import Models
from ..config import Config, DataConfig
from ..data import ALL_COLUMNS, DataError, build_prompt_set, read_records, records_from_object
from ..forward import set_packing
from .inputs import Inputs
from ..marker import is_marker
from ..models import (ModelLoadError, apply_lora, base_view, check_roles, context_length, context_problem,
                      critic_from_object, enable_gradient_checkpointing, is_causal_lm_checkpoint, load_causal_lm,
                      load_critic, load_function, load_model_config, load_reward_model, load_tokenizer, prepare_model,
                      reward_function, stop_token_ids, tokenizer_from_object)
from ..rollout import registry
from ..rewards.terms import RewardTerm
from ..scoring.composite import (CompositeReward, check_model_terms, composite_functions, load_model_terms,
                                  one_term)
from ..scoring.reward_fn import KeywordCall, describe, missing_columns, wants
from ..scoring.streaming import RewardFunction
from ..trace import Tracer
from ..weights.precision import serving_copy
from .resolve import Resolved


def load_models(cfg: Config, inputs: Inputs, run: Resolved) -> Models:
    """Everything :class:`~oppo.api.roles.Models` holds, loaded as ``run`` decided."""
    paths, dev, dtype, master = run.paths, run.device, run.dtype, run.master
    tok = tokenizer_from_object(inputs.tokenizer) if inputs.tokenizer is not None else load_tokenizer(paths.policy)
    pad_id = tok.pad_token_id
    # the reward and judge functions (imported: fast), then the prompts with the columns they ask for
    score_fn = _function(inputs.reward_fn, paths.reward_function, "reward.function")
    judge = _function(inputs.judge, paths.judge, "reward.judge")
    accuracy = _function(None, paths.accuracy, "task accuracy")
    terms, term_fns = composite_functions(cfg.reward, inputs.reward_terms) if cfg.reward.terms else (None, {})
    asking = {k: f for k, f in (("reward.function", score_fn), ("reward.judge", judge),
                                ("task accuracy", accuracy)) if f is not None}
    asking.update({f"reward.terms term {name!r}": f.fn for name, f in term_fns.items()})
    configs = _context_configs(cfg.policy.trust_remote_code, inputs, run, terms)  # (configs only: before any weights load)
    limits = [found[0] for c in configs.values() if (found := context_length(c))]
    room = min(limits) - paths.max_new_tokens if limits else None  # (an empty data.max_prompt_tokens' budget)
    prompt_set = _prompt_set(cfg.data, cfg.run.seed, inputs.prompts, paths.prompts, tok, asking,
                             room=room if room is not None and room >= 1 else None)  # (none left: refused below)
    _check_context(cfg.generation.max_new_tokens is None, run, prompt_set, configs)
    new_head, critic_init = _check_roles(cfg.reward.new_head, inputs, run, tok)
    # the reward first: an invalid reward model or function fails before the big models load
    reward, reward_model, extra_rms = _load_reward(cfg, inputs, run, tok, prompt_set, score_fn, terms, term_fns,
                                                   new_head)
    policy, rollout_policy, reference, critic, scoring_critic = _trained_models(cfg, inputs, run, pad_id, critic_init)
    rms = (reward_model, *extra_rms.values())
    for m in (*rms, reference, scoring_critic):  # their one-shot forwards (score_full)
        if m is not None:
            set_packing(m, cfg.ppo.packing, cfg.ppo.shape_buckets)
    _prepare_forwards(cfg, run, policy, critic, (rollout_policy, reference, critic, scoring_critic, *rms),
                      prompt_set.width)
    g = cfg.generation
    recompute = {"recompute": True, "sampler": False}.get(
        cfg.ppo.old_logprobs, dtype != torch.float32 or g.top_k > 0 or g.top_p < 1.0  # auto: when they can differ
        or (g.backend != registry.AUTO and registry.get(g.backend).other_numerics))
    return Models(cfg=cfg, paths=paths, tokenizer=tok, prompt_set=prompt_set, algorithm=run.algorithm, device=dev,
                  compute_dtype=dtype, max_new_tokens=paths.max_new_tokens, pad_id=pad_id,
                  stop_ids=tuple(stop_token_ids(tok, policy)), policy=policy, critic=critic, reference=reference,
                  rollout_policy=rollout_policy, scoring_critic=scoring_critic, reward_model=reward_model,
                  reward=reward, judge_fn=KeywordCall(judge) if judge is not None else None,
                  accuracy_fn=KeywordCall(accuracy) if accuracy is not None else None,
                  extra_reward_models=extra_rms, recompute_old=recompute, tracer=Tracer(enabled=cfg.log.trace))


def _check_roles(new_head: bool, inputs: Inputs, run: Resolved, tok) -> tuple[bool, torch.nn.Module | None]:
    """Every role's config and tokenizer, before any weights load (fast; names the fix). Returns
    whether the reward model gets a new head (``reward.new_head``) and the critic made from an
    object, if one is: made now, before the reward model it may copy is frozen and the policy
    whose backbone it may take is changed (dtype, LoRA)."""
    paths, master, pad_id = run.paths, run.master, tok.pad_token_id
    critic_source = run.critic_source
    objects = {role: m for role in ("reward", "reference") if (m := inputs.model(role)) is not None}
    critic_object = inputs.model(critic_source) if paths.critic is not None else None
    if critic_object is not None and critic_source == "critic":  # (a reward model or policy: checked as such)
        objects["critic"] = critic_object
    critic_path = None if critic_object is not None and critic_source != "critic" else paths.critic
    new_head = new_head and paths.reward is not None and "reward" not in objects
    check_roles(tok, reward=paths.reward, critic=critic_path, reference=paths.reference, objects=objects,
                new_head=new_head)
    if new_head and paths.reward is not None and is_causal_lm_checkpoint(paths.reward):  # said once, here (every process loads the same head)
        print(f"oppo: warning: reward.path={paths.reward} is a causal LM: reward.new_head=true puts a fresh "
              f"one-label head on it (seeded), as TRL's example scripts do. Its scores are random, so this run "
              f"checks that the pipeline runs; it does not learn anything. For a real reward, train a reward model "
              f"(e.g. TRL's RewardTrainer) or use reward.function.", file=sys.stderr)
    if inputs.policy is not None:
        check_roles(tok, policy=inputs.policy)
    critic_dev = run.devices["critic"]
    critic_init = (critic_from_object(critic_object, critic_dev, master, pad_id, copy_it=critic_source != "critic")
                   if critic_object is not None else None)
    return new_head, critic_init


def _trained_models(cfg: Config, inputs: Inputs, run: Resolved, pad_id: int, critic_init: torch.nn.Module | None,
                    ) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module, torch.nn.Module | None,
                               torch.nn.Module | None]:
    """(policy, rollout_policy, reference, critic, scoring_critic), loaded or prepared from objects."""
    paths, dev, dtype, master, critic_dev = run.paths, run.device, run.dtype, run.master, run.devices["critic"]
    # policy / critic: the trained weights; rollout_policy / scoring_critic: what the rollout backend and
    # scorers run, the same objects in fp32, bf16 copies refreshed after each update under mixed
    # precision; LoRA: the frozen base stays in the compute dtype (only the fp32 adapters train)
    lora = cfg.lora
    if inputs.policy is not None:
        policy = prepare_model(inputs.policy, "policy", dev, dtype if lora.r else master)
    else:
        policy = load_causal_lm(paths.policy, "policy", dev, dtype if lora.r else master,
                                cfg.policy.trust_remote_code)
    if lora.r:
        policy = apply_lora(policy, lora.r, lora.alpha, lora.dropout, lora.target_modules)
    inflight = cfg.in_flight  # the learner trains the masters while the copies serve
    rollout_policy = serving_copy(policy, dtype, separate=inflight)
    ref_dev = run.devices["reference"]
    if inputs.reference is not None:
        reference = prepare_model(inputs.reference, "reference", ref_dev, dtype)
    elif paths.reference:
        reference = load_causal_lm(paths.reference, "reference", ref_dev, dtype)
    elif lora.r:  # the base model without adapters: the policy's own frozen weights, no copy
        reference = base_view(policy)
    else:  # a frozen copy of the initial policy
        reference = copy.deepcopy(rollout_policy).to(ref_dev)
    reference.eval().requires_grad_(False)
    critic = scoring_critic = None
    if paths.critic:
        critic = (critic_init if critic_init is not None else load_critic(paths.critic, critic_dev, master, pad_id)
                  ).eval()
        # the scorer worker that trains the critic scores with the one it trains: no separate copy
        beside = run.placement.critic_trains_on == "scorer"
        scoring_critic = serving_copy(critic, dtype, separate=inflight and not beside)
    return policy, rollout_policy, reference, critic, scoring_critic


def _prepare_forwards(cfg: Config, run: Resolved, policy: torch.nn.Module, critic: torch.nn.Module | None,
                      models: tuple[torch.nn.Module | None, ...], prompt_width: int) -> None:
    """The models' forwards as the run uses them: the attention path (``ppo.attention``: probed on
    CUDA) of the policy and the ``models`` beside it, before any layout rule is found for a model;
    gradient checkpointing of the trained models; no dropout anywhere."""
    paths, dtype = run.paths, run.dtype
    from .. import shapes
    from ..kernels import attention

    others = {id(m): m for m in models if m is not None and m is not policy}
    attention.choose(policy, list(others.values()), cfg.ppo.attention, rows=4,
                     width=shapes.width(min(2048, prompt_width + paths.max_new_tokens)),
                     say=lambda line: print(f"oppo: {line}", file=sys.stderr), dtype=dtype)
    if cfg.policy.gradient_checkpointing:  # the trained models; recomputation only while training
        for m in (policy, critic):
            if m is not None:
                enable_gradient_checkpointing(m)
    policy.eval()  # no dropout anywhere: rollout and training see the same function


def _load_reward(cfg: Config, inputs: Inputs, run: Resolved, tok, prompt_set, score_fn: Callable | None,
                 terms: list[RewardTerm] | None, term_fns: dict[str, RewardFunction], new_head: bool,
                 ) -> tuple[CompositeReward, torch.nn.Module | None, dict[str, torch.nn.Module]]:
    """The trained reward as a composite of terms (``reward.terms``; ``reward.function`` or
    ``reward.path`` as its one term: ``scoring.composite.one_term``), the ``reward`` scorer's model
    (None where no model term scores) and the further reward models by scorer role."""
    paths, pad_id, dtype = run.paths, tok.pad_token_id, run.dtype
    if terms is not None:
        check_model_terms(terms, tok)
        rms = load_model_terms(terms, run.devices["reward"], dtype, pad_id)
        reward_model = rms.pop("reward", None)
        fns = {name: ByRecord(f, prompt_set) for name, f in term_fns.items()}
        return CompositeReward(terms, fns), reward_model, rms
    if score_fn is not None:
        assert paths.reward_function is not None  # (a function given as an object has its marker there)
        name = describe(score_fn) if is_marker(paths.reward_function) else paths.reward_function
        fn = ByRecord(RewardFunction(reward_function(score_fn, name), name, retries=cfg.reward.retries,
                                     backoff_s=cfg.reward.retry_backoff_s), prompt_set)
        return one_term(function=paths.reward_function, fn=fn), None, {}
    assert paths.reward is not None, "resolve_paths gives a reward model where no function scores"
    reward_dev = run.devices["reward"]
    reward_model = (prepare_model(inputs.reward_model, "reward", reward_dev, dtype, pad_id)
                    if inputs.reward_model is not None
                    else load_reward_model(paths.reward, reward_dev, dtype, pad_id, new_head=new_head))
    return one_term(path=paths.reward), reward_model, {}


class ByRecord(RewardFunction):
    """A reward function whose errors name each prompt's record in the prompt set (its line of a
    JSONL file, its row of a data set: ``data.PromptSet.record_numbers``), not the data-stream
    position the controller passes as ``indices`` (past the set's end after an epoch)."""

    def __init__(self, fn: RewardFunction, prompt_set):
        self.__dict__.update(fn.__dict__)
        self.prompt_set = prompt_set

    def __call__(self, prompts, responses, step=None, indices=None, context=None):
        records = None if indices is None else self.prompt_set.record_numbers(indices)
        return super().__call__(prompts, responses, step, records, context)


def _context_configs(trust_remote_code: bool, inputs: Inputs, run: Resolved, terms) -> dict:
    """'role (setting)' -> the config of each model the run reads (an object's, else its
    directory's): whose positions bound a prompt and its response."""
    paths = run.paths
    sources = {"policy (policy.path)": inputs.policy if inputs.policy is not None else paths.policy,
               "reference (reference.path)": inputs.reference if inputs.reference is not None else paths.reference,
               "critic": inputs.model(run.critic_source) if paths.critic and inputs.model(run.critic_source) is not None
               else paths.critic,
               "reward (reward.path)": inputs.reward_model if inputs.reward_model is not None else paths.reward}
    sources.update({f"reward term {t.name!r}": t.path for t in terms or [] if t.path is not None})
    configs = {}
    for who, src in sources.items():
        if src is None or (isinstance(src, str) and is_marker(src)):
            continue
        try:
            configs[who] = src.config if hasattr(src, "config") else load_model_config(
                src, who.split()[0], trust_remote_code=trust_remote_code)
        except ModelLoadError:
            continue  # (check_roles names a config it cannot read)
    return configs


def _check_context(default_new: bool, run: Resolved, prompt_set, configs: dict) -> None:
    """Raise ModelLoadError when the longest prompt and its response do not fit a model's positions
    (``models.context_problem``; ``configs``: :func:`_context_configs`)."""
    paths = run.paths
    problem = context_problem([len(ids) for ids in prompt_set.ids], paths.max_new_tokens, configs, prompt_set.texts,
                              default_new=default_new)
    if problem:
        raise ModelLoadError(problem)


def _function(obj: Callable | None, spec: str | None, key: str) -> Callable | None:
    """The reward function (judge, ...) given as an object, else imported from its spec."""
    if obj is not None:
        return obj
    return load_function(spec, key) if spec else None


def _prompt_set(d: DataConfig, seed: int, obj: Any, source: str, tok, fns: dict[str, Callable],
                room: int | None = None):
    """The prompts, tokenised, with the columns the functions ``fns`` (setting -> function) ask
    for; a column one of them needs that the prompt set lacks is refused here, before any model
    loads (preflight refuses it earlier where the columns can be known without reading the data).
    ``obj``: the prompts given as an object, else None (``source`` is read)."""
    asked = [wants(f) for f in fns.values()]
    columns = ALL_COLUMNS if any(w.everything for w in asked) else tuple(dict.fromkeys(
        c for w in asked for c in w.columns))
    records = (records_from_object(obj, d.field, d.split, columns) if obj is not None
               else read_records(source, d.field, d.split, columns))
    lacking = [line for key, f in fns.items() if (line := missing_columns(key, f, records.available))]
    if lacking:
        raise DataError("\n".join(lacking))
    return build_prompt_set(records.texts, tok, d, seed, columns=records.columns, room=room)
