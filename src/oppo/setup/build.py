"""``build_roles(cfg)`` loads the models and builds every role once, as the plan says.

Where each role runs is decided once, before any model loads, as a :class:`~oppo.api.placement.Placement`
(``setup.decide.decide_placement``): the scorer inline, on a thread, in a child process or in Ray
actors; the critic trained by the learner or beside its scoring; the learner local or
data-parallel on Ray; the rollout backend local or N Ray workers that stream to the scorers
themselves; the torch thread budgets. This module builds what the plan names; the controller
(``oppo.control``) receives the roles behind their Protocols (``api/protocols.py``) and never
asks where one runs.

Order of work, so that bad input fails before anything expensive: paths, the reward and judge
functions, prompts, every role's config and tokenizer, the reward model, then the big models.

Objects given from Python (``inputs.Inputs``: models, a tokenizer, callables, prompts) stand in
for the paths and specs their settings name by a marker (``inputs.marker``); they get the checks a
loaded model gets, and are moved to the role's device and dtype in place. A role that loads its
model in another process reads the copy :func:`~oppo.inputs.save_for_elsewhere` saved.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from ..algo import build_algorithm
from ..api.protocols import RolloutBackend
from ..api.roles import Roles
from ..api.specs import ModelSpec
from ..config import Config
from ..data import ALL_COLUMNS, DataError, build_prompt_set, read_records, records_from_object
from ..forward import set_packing
from ..inputs import Inputs, save_for_elsewhere
from ..learner import registry as learners
from ..learner.critic import CriticBesideScorer, CriticTrainer
from ..marker import is_marker
from ..learner.local import Learner
from ..models import (apply_lora, base_view, check_roles, critic_from_object, enable_gradient_checkpointing,
                     load_causal_lm, load_critic, load_function, load_reward_model, load_tokenizer, prepare_model,
                     resolve_device, resolve_dtype, reward_function, stop_token_ids, tokenizer_from_object)
from ..rollout import registry
from ..scoring.composite import CompositeReward, check_model_terms, composite_functions, load_model_terms
from ..scoring.inline import InlineScorer
from ..scoring.reward_fn import KeywordCall, describe, missing_columns, wants
from ..scoring.streaming import RewardFunction, StreamingScorer
from ..scoring.worker import ScorerWorker
from ..trace import Tracer
from ..weights.plan import WeightSync
from ..weights.precision import copy_weights, master_dtype, serving_copy
from ..weights.sync import load_source
from .decide import decide_placement, engine_settings, resolve_paths

# Roles is built in two phases: the models first, then the placement's builders fill in the rollout
# backend and the scorer (they read the models from it). This stands in until then.
_BUILT_NEXT: Any = None


def build_roles(cfg: Config, progress: bool = True, inputs: Inputs | None = None) -> Roles:
    """Load every model and build every role (module docstring). ``inputs``: the objects given
    from Python in place of paths (their settings hold markers: ``inputs.split_inputs``)."""
    inputs = inputs or Inputs()
    paths = resolve_paths(cfg, progress=progress)
    saved = save_for_elsewhere(cfg, inputs, log=progress)  # objects a role loads in another process
    # the critic starts from critic.path, else the reward model's, else the policy's (resolve_paths)
    critic_source = "critic" if cfg.critic.path else "reward" if cfg.reward.path else "policy"
    for role in ("policy", "reward", "reference"):
        if role in saved:
            setattr(paths, role, saved[role])
    if paths.critic is not None and is_marker(paths.critic) and critic_source in saved:
        paths.critic = saved[critic_source]
    check_backend(cfg.generation.engine, paths.policy, cfg.policy.device)  # before any model loads
    tok = tokenizer_from_object(inputs.tokenizer) if inputs.tokenizer is not None else load_tokenizer(paths.policy)
    pad_id = tok.pad_token_id
    dev = resolve_device(cfg.policy.device)
    # compute dtype (rollout, scoring, the training forward) and the trained weights' dtype:
    # fp32 masters under bf16 (weights.py)
    dtype = resolve_dtype(cfg.policy.dtype, dev)
    master = master_dtype(dtype)
    # the reward and judge functions (imported: fast), then the prompts with the columns they ask for
    reward_fn = reward_model = None
    score_fn = _function(inputs.reward_fn, paths.reward_function, "reward.function")
    judge = _function(inputs.judge, paths.judge, "reward.judge")
    accuracy = _function(None, paths.accuracy, "task accuracy")
    terms, term_fns = composite_functions(cfg.reward) if cfg.reward.terms else (None, {})
    asking = {k: f for k, f in (("reward.function", score_fn), ("reward.judge", judge),
                                ("task accuracy", accuracy)) if f is not None}
    asking.update({f"reward.terms term {name!r}": f.fn for name, f in term_fns.items()})
    prompt_set = _prompt_set(cfg, inputs, paths.prompts, tok, asking)
    # every role's config and tokenizer, before any weights load (fast; names the fix)
    algorithm = build_algorithm(cfg)
    if not algorithm.needs_critic:
        paths.critic = None  # critic-free: no critic is loaded, scored, trained or checkpointed
    objects = {role: m for role in ("reward", "reference") if (m := inputs.model(role)) is not None}
    critic_object = inputs.model(critic_source) if paths.critic is not None else None
    if critic_object is not None and critic_source == "critic":  # (a reward model or policy: checked as such)
        objects["critic"] = critic_object
    critic_path = None if critic_object is not None and critic_source != "critic" else paths.critic
    check_roles(tok, reward=paths.reward, critic=critic_path, reference=paths.reference, objects=objects)
    if inputs.policy is not None:
        check_roles(tok, policy=inputs.policy)
    # a critic started from an object: made now, before the reward model it may copy is frozen and the
    # policy whose backbone it may take is changed (dtype, LoRA)
    critic_dev = resolve_device(cfg.critic.device, str(dev))
    critic_init = (critic_from_object(critic_object, critic_dev, master, pad_id, copy_it=critic_source != "critic")
                   if critic_object is not None else None)
    # Reward first: an invalid reward model or function fails before the big models load.
    composite = None
    extra_rms: dict[str, torch.nn.Module] = {}  # composite: the reward models after the first, by scorer role
    if terms is not None:
        check_model_terms(terms, tok)
        rms = load_model_terms(terms, resolve_device(cfg.reward.device, str(dev)), dtype, pad_id)
        reward_model = rms.pop("reward", None)
        extra_rms, composite = rms, CompositeReward(terms, term_fns)
    elif score_fn is not None:
        assert paths.reward_function is not None  # (a function given as an object has its marker there)
        name = describe(score_fn) if is_marker(paths.reward_function) else paths.reward_function
        fn = reward_function(score_fn, name)  # (a tensor: .tolist())
        reward_fn = RewardFunction(fn, name, retries=cfg.reward.retries, backoff_s=cfg.reward.retry_backoff_s)
    else:
        assert paths.reward is not None, "resolve_paths gives a reward model where no function scores"
        reward_dev = resolve_device(cfg.reward.device, str(dev))
        reward_model = (prepare_model(inputs.reward_model, "reward", reward_dev, dtype, pad_id)
                        if inputs.reward_model is not None else load_reward_model(paths.reward, reward_dev, dtype, pad_id))
    judge_fn = KeywordCall(judge) if judge is not None else None
    accuracy_fn = KeywordCall(accuracy) if accuracy is not None else None
    # policy / critic: the trained weights; rollout_policy / scoring_critic: what the engine and
    # scorers run, the same objects in fp32, bf16 copies refreshed after each update under mixed precision
    lora = cfg.lora
    # LoRA: the frozen base stays in the compute dtype (only the fp32 adapters train)
    if inputs.policy is not None:
        policy = prepare_model(inputs.policy, "policy", dev, dtype if lora.r else master)
    else:
        policy = load_causal_lm(paths.policy, "policy", dev, dtype if lora.r else master,
                                cfg.policy.trust_remote_code)
    if lora.r:
        policy = apply_lora(policy, lora.r, lora.alpha, lora.dropout, lora.target_modules)
    inflight = cfg.in_flight  # the learner trains the masters while the copies serve
    rollout_policy = serving_copy(policy, dtype, separate=inflight)
    ref_dev = resolve_device(cfg.reference.device, str(dev))
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
    wants_critic_on_scorer = bool(cfg.streams and cfg.placement.critic_on_worker and paths.critic
                                  and cfg.placement.backend != "ray")
    if paths.critic:
        critic = (critic_init if critic_init is not None else load_critic(paths.critic, critic_dev, master, pad_id)
                  ).eval()
        scoring_critic = serving_copy(critic, dtype, separate=inflight and not wants_critic_on_scorer)
    for m in (reward_model, *extra_rms.values(), reference, scoring_critic):  # their one-shot forwards (score_full)
        if m is not None:
            set_packing(m, cfg.ppo.packing)
    if cfg.policy.gradient_checkpointing:  # the trained models; recomputation only while training
        for m in (policy, critic):
            if m is not None:
                enable_gradient_checkpointing(m)
    policy.eval()  # no dropout anywhere: rollout and training see the same function
    g = cfg.generation
    max_new = paths.max_new_tokens
    stop_ids = stop_token_ids(tok, policy)
    recompute = {"recompute": True, "sampler": False}.get(
        cfg.ppo.old_logprobs, dtype != torch.float32 or g.top_k > 0 or g.top_p < 1.0  # auto: when they can differ
        or (g.engine != registry.AUTO and registry.get(g.engine).other_numerics))
    learner = Learner(policy, critic, cfg.ppo, g.temperature, cfg.run.seed, compute_dtype=dtype,
                      recompute_old=recompute, algorithm=algorithm)
    engine = learners.get(cfg.placement.learner_sharding)  # (config.validate checked where it runs)
    scorers = {"reference": StreamingScorer("reference", reference, pad_id, g.temperature)}
    if critic is not None:
        scorers["critic"] = StreamingScorer("critic", scoring_critic, pad_id)
    if reward_model is not None:
        scorers = {"reward": StreamingScorer("reward", reward_model, pad_id),
                   **{role: StreamingScorer("reward", m, pad_id) for role, m in extra_rms.items()}, **scorers}
    placement = decide_placement(cfg, critic is not None, all(s.device.type == "cpu" for s in scorers.values()),
                                 scoring_critic is critic)
    placement.threads.use(placement.threads.full)
    tracer = Tracer(enabled=cfg.log.trace)
    roles = Roles(cfg=cfg, paths=paths, placement=placement, tokenizer=tok, prompt_set=prompt_set,
                  algorithm=algorithm, device=dev, compute_dtype=dtype, max_new_tokens=max_new, pad_id=pad_id,
                  stop_ids=tuple(stop_ids), policy=policy, critic=critic, reference=reference,
                  rollout_policy=rollout_policy, scoring_critic=scoring_critic, reward_model=reward_model, reward_fn=reward_fn, judge_fn=judge_fn,
                  accuracy_fn=accuracy_fn, composite=composite, extra_reward_models=extra_rms, rollout=_BUILT_NEXT,
                  scorer=_BUILT_NEXT, learner=_BUILT_NEXT,
                  sync=WeightSync([]), tracer=tracer)
    if placement.learner == "ray":
        _place_on_ray(roles, stop_ids, recompute, engine)
        return roles
    assert engine.build_local is not None  # (config.validate: it runs in this process)
    roles.learner = engine.build_local(learners.LocalRequest(learner, cfg))
    roles.rollout = local_rollout(roles, stop_ids)
    trains_here = placement.critic_trains_on == "scorer"
    if placement.scorer == "inline":
        roles.scorer = InlineScorer(scorers)
    else:
        trainer = None
        if trains_here:  # (a critic, so its optimizer)
            assert learner.critic_opt is not None
            trainer = CriticTrainer(learner.critic_opt, cfg.ppo, None if placement.scorer == "process" else critic,
                                    dtype)
        worker = ScorerWorker(scorers, cfg.placement.scorer_threads, tracer, trainer=trainer,
                              transport=placement.scorer)
        roles.scorer = worker
        if trains_here:
            roles.learner = CriticBesideScorer(learner, worker, tracer, placement.threads, inflight, roles.learner)
    roles.closers.append(roles.scorer.close)
    if critic is not None and scoring_critic is not None and not trains_here and scoring_critic is not critic:
        serving = scoring_critic

        def critic_copy(version: int) -> None:
            roles.scorer.barrier()  # no chunk is being scored with the critic copy while it changes
            copy_weights(critic, serving)
        roles.sync.steps.append(critic_copy)
    roles.sync.steps.append(lambda version: roles.rollout.load_weights(policy, version))
    return roles

def _function(obj: Callable | None, spec: str | None, key: str) -> Callable | None:
    """The reward function (judge, ...) given as an object, else imported from its spec."""
    if obj is not None:
        return obj
    return load_function(spec, key) if spec else None


def _prompt_set(cfg: Config, inputs: Inputs, source: str, tok, fns: dict[str, Callable]):
    """The prompts, tokenised, with the columns the functions ``fns`` (setting -> function) ask
    for; a column one of them needs that the prompt set lacks is refused here, before any model
    loads (preflight refuses it earlier where the columns can be known without reading the data)."""
    asked = [wants(f) for f in fns.values()]
    columns = ALL_COLUMNS if any(w.everything for w in asked) else tuple(dict.fromkeys(
        c for w in asked for c in w.columns))
    d = cfg.data
    records = (records_from_object(inputs.prompts, d.field, d.split, columns) if inputs.prompts is not None
               else read_records(source, d.field, d.split, columns))
    lacking = [line for key, f in fns.items() if (line := missing_columns(key, f, records.available))]
    if lacking:
        raise DataError("\n".join(lacking))
    return build_prompt_set(records.texts, tok, d, cfg.run.seed, columns=records.columns)


def check_backend(engine: str, policy_path: str | None, device: str) -> None:
    """Raise :class:`~oppo.rollout.registry.BackendUnavailable` naming every reason the rollout
    backend ``engine`` cannot serve the policy here (``Backend.problems``: not installed, an
    architecture it lacks), with the fixes; nothing for ``auto`` and oppo's own engines."""
    if engine == registry.AUTO:
        return
    backend = registry.get(engine)
    problems = backend.problems(policy_path, device) if backend.problems else []
    if problems:
        raise registry.BackendUnavailable("\n".join(problems))

def local_rollout(roles: Roles, stop_ids) -> RolloutBackend:
    """The rollout backend in this process (``generation.engine``, from ``rollout.registry``),
    sampling with (or, for a backend that loads the policy itself, starting from) the serving
    policy's weights."""
    cfg = roles.cfg
    settings = engine_settings(cfg, stop_ids, roles.pad_id, roles.max_new_tokens, roles.device,
                               model=roles.rollout_policy)
    backend = registry.build(registry.BuildRequest(
        settings, roles.rollout_policy, roles.paths.policy, roles.compute_dtype, roles.device.type))
    roles.closers.insert(0, backend.close)
    roles.engine = settings.reason
    return backend

def _place_on_ray(roles: Roles, stop_ids, recompute_old: bool, engine: learners.Engine) -> None:
    """``placement.backend=ray``: the scorers become Ray actors (all stage-3 scoring goes to them,
    streamed or one-shot) and the learner a group of Ray ranks that trains actor and critic
    (replicas, or FSDP2 shards: ``placement.learner_sharding``); after each update rank 0's actor
    weights go to the rollout backend (the local engine's model, or every rollout worker), streamed
    in buckets over a process group of their own or through the object store
    (``placement.weight_sync``), and its critic to the scorer actor (``time/weight_sync``)."""
    from ..cluster import init_ray
    from ..learner.group import learner_spec
    from ..scoring.ray import FedByRollout, RayScorerWorker

    cfg, pl = roles.cfg, roles.cfg.placement
    dtype, pad_id = roles.compute_dtype, roles.pad_id
    init_ray(pl.address)
    specs = _scorer_specs(roles.paths, pad_id, dtype, reward_model=roles.reward_model is not None,
                         critic=roles.critic is not None, packing=cfg.ppo.packing)
    scorer = RayScorerWorker(specs, roles.tracer, temperature=cfg.generation.temperature, threads=pl.scorer_threads,
                             num_cpus=pl.scorer_cpus, num_gpus=pl.scorer_gpus, seed=cfg.run.seed)
    roles.closers.append(scorer.close)
    spec = learner_spec(cfg, roles.paths, pad_id, dtype, roles.algorithm, recompute_old)
    assert engine.build_remote is not None  # (config.validate: it runs on Ray)
    learner = engine.build_remote(learners.RemoteRequest(
        spec, pl.learner_workers, pl.learner_cpus, pl.learner_gpus, pl.actor_threads,
        "STRICT_SPREAD" if pl.spread else "PACK", scorer if roles.critic is not None else None, roles.tracer,
        (roles.policy, roles.critic)))
    roles.learner = learner
    roles.closers.insert(0, learner.close)
    load_source(roles.policy, learner.weights_out())  # fresh heads/adapters are initialised per process: rank 0's rule
    copy_weights(roles.policy, roles.rollout_policy)
    if isinstance(learner, learners.PushesCritic):
        roles.sync.steps.append(learner.push_critic)  # rank 0's critic -> the scorer actor
    if roles.placement.rollout == "ray":
        from ..rollout.ray import RayRolloutGroup

        settings = engine_settings(cfg, stop_ids, pad_id, roles.max_new_tokens, torch.device("cpu"))
        mspec = ModelSpec("policy", roles.paths.policy, dtype, pad_id=pad_id,
                          trust_remote_code=cfg.policy.trust_remote_code)
        stream = roles.placement.rollout_streams_itself  # (the scorer actors serve every other mode)
        group = RayRolloutGroup(mspec, settings, pl.rollout_workers, seed=cfg.run.seed, tracer=roles.tracer,
                                scorer=scorer if stream else None, num_cpus=pl.rollout_cpus,
                                num_gpus=pl.rollout_gpus, threads=pl.actor_threads)
        roles.closers.insert(0, group.close)
        roles.engine = f"{settings.kind} in {pl.rollout_workers} Ray rollout workers ({settings.reason})"
        group.load_weights(roles.policy, 0)
        roles.rollout = group
        roles.scorer = FedByRollout(scorer) if stream else scorer
        link = _collective_sync(roles, learner, rollout=group)
        if link is not None:  # rank 0 streams to the workers over a group of their own
            roles.sync.steps.append(link)
        else:  # rollout workers load rank 0's weights straight from the object store
            roles.sync.steps.append(lambda version: group.load_weights(learner.weights_out(), version))
    else:
        roles.rollout = local_rollout(roles, stop_ids)
        roles.scorer = scorer
        link = _collective_sync(roles, learner, local=roles.rollout_policy)

        def actor_home(version: int) -> None:  # rank 0's actor -> the engine's model (the policy is
            if link is not None:  # brought home only for checkpoints)
                link(version)
            else:
                load_source(roles.rollout_policy, learner.weights_out())
            # (oppo's engines sample with that model: no copy; a backend with weights of its own reloads from it)
            roles.rollout.load_weights(roles.rollout_policy, version)
        roles.sync.steps.append(actor_home)

def _scorer_specs(paths, pad_id: int, dtype: torch.dtype, *, reward_model: bool, critic: bool,
                 device: str = "auto", packing: str = "auto") -> dict[str, ModelSpec]:
    """The streaming scorers' models as the trainer builds them, from its ``ResolvedPaths``: the
    reward model (unless a reward function scores), the reference (its own path, else the initial
    policy: also the LoRA base without adapters) and the critic (unless critic-free), all in the
    compute dtype, their one-shot forwards under ``ppo.packing`` = ``packing``."""
    specs = {}
    if reward_model:
        specs["reward"] = ModelSpec("reward", paths.reward, dtype, device, pad_id, packing=packing)
    specs["reference"] = ModelSpec("reference", paths.reference or paths.policy, dtype, device, pad_id,
                                   packing=packing)
    if critic:
        specs["critic"] = ModelSpec("critic", paths.critic, dtype, device, pad_id, packing=packing)
    return specs

def _collective_sync(roles: Roles, learner, rollout=None, local: torch.nn.Module | None = None):
    """``placement.weight_sync``: the collective, bucketed sync from the learner to the ``rollout``
    workers or the ``local`` engine's model (``weights.sync.CollectiveSync``), or None for
    the object store: asked for, or ``auto`` without GPUs on both sides or when the group cannot
    form (a warning says why)."""
    import warnings

    from ..weights.sync import CollectiveSync, WeightSyncUnavailable

    from ..api.protocols import WeightLinkSender

    pl = roles.cfg.placement
    if pl.weight_sync == "object_store":
        return None
    if not isinstance(learner, WeightLinkSender):
        if pl.weight_sync == "collective":
            raise RuntimeError(f"placement.weight_sync=collective: the learner engine "
                               f"{pl.learner_sharding} has no collective weight link; set "
                               f"placement.weight_sync=object_store (or auto)")
        return None
    if pl.weight_sync == "auto":  # collective where NCCL can carry it: every member on a GPU
        if rollout is not None:
            serving_on_gpu = pl.rollout_gpus > 0
        else:
            assert local is not None  # (the sink: the workers, or the local engine's model)
            serving_on_gpu = next(local.parameters()).is_cuda
        if not (pl.learner_gpus > 0 and serving_on_gpu):
            return None  # on CPU the object store (shared memory on a node) beats gloo: benchmarks/weight_sync
    wire = {n: t.dtype for n, t in roles.rollout_policy.state_dict().items()}  # the serving side's dtypes
    try:
        link = CollectiveSync(learner, rollout, local, bucket_bytes=int(pl.weight_sync_bucket_mb * 2**20),
                              wire_dtype=wire)
    except WeightSyncUnavailable as e:
        if pl.weight_sync == "collective":
            raise RuntimeError(f"placement.weight_sync=collective: {e}") from e
        warnings.warn(f"{e}; the weights go through Ray's object store instead (placement.weight_sync=auto)")
        return None
    roles.closers.append(link.close)
    return link

__all__ = ["Roles", "build_roles", "check_backend", "local_rollout"]
