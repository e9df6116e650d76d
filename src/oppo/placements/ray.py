"""``placement.name=ray``: the scorers (reward, reference, critic) in Ray actors, the learner a
group of Ray ranks (the learner engine's ``build_remote``: data-parallel replicas or FSDP2 shards;
how many and what each gets are the engine's own settings, ``learner.<engine>.*``),
and the rollout backend in the controller or in ``rollout_replicas`` Ray replicas that stream their
chunks to the scorer actors themselves. After each update rank 0's actor weights reach the rollout
backend, streamed in buckets over a process group of their own or through the object store
(``weight_sync``), and its critic the scorer actor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..parts import setting
from . import Facts, Placed, PlacementSpec, local_rollout, rollout_settings

if TYPE_CHECKING:
    import torch

    from ..api.placement import Placement
    from ..api.roles import Models
    from ..config import Config


@dataclass
class RaySettings:
    address: str = setting("auto", "Ray cluster to join: auto (the one started by `ray start` on this machine, "
                                   "else a new local one), or host:port / ray://host:port.")
    scorer_cpus: float = setting(1.0, "CPUs of the scorer actor.")
    scorer_gpus: float = setting(0.0, "GPUs of the scorer actor.")
    rollout_replicas: int = setting(0, "Rollout replicas, each a copy of the policy in a Ray actor with its own "
                                       "backend (generation.backend: eager under auto, or a backend that runs in "
                                       "replicas), sharing the B + Delta sequences and streaming their chunks "
                                       "straight to the scorer actors; each computes with placement.actor_threads "
                                       "threads. 0: the backend runs in the controller process.")
    rollout_cpus: float = setting(1.0, "CPUs of each rollout replica (placement.ray.rollout_replicas).")
    rollout_gpus: float = setting(0.0, "GPUs of each rollout replica (placement.ray.rollout_replicas).")
    weight_sync: str = setting(
        "auto", "How the actor's trained weights reach the rollout backend after each update. collective: learner "
                "rank 0 and the rollout replicas (or the controller, when the backend runs there) form a "
                "torch.distributed group of their own and the weights stream in buckets of "
                "placement.ray.weight_sync_bucket_mb (NCCL when every member has a GPU of its own, else gloo), cast "
                "to the serving dtype, with the version checked; an FSDP2 learner gathers one parameter at a time. "
                "object_store: rank 0's whole actor through Ray's object store (shared memory within a node). "
                "auto: collective when the learner ranks and the rollout backend have GPUs, else the object store "
                "(faster on one CPU node: benchmarks/weight_sync); also the object store if the group cannot form "
                "(a warning says why).", ("auto", "collective", "object_store"))
    weight_sync_bucket_mb: float = setting(0.0, "Collective weight sync: bucket size in MiB (0: 256 over NCCL, 4 "
                                                "over gloo). A sync holds two buckets beside the models (one filled "
                                                "while the other is in flight); a larger tensor spans several.")


def checks(own: RaySettings, cfg: Config) -> list[str]:
    from ..rollout import registry

    out = []
    if min(own.scorer_cpus, own.scorer_gpus, own.rollout_cpus, own.rollout_gpus) < 0:
        out.append("placement.ray.*_cpus and *_gpus must be >= 0.")
    if own.rollout_replicas < 0:
        out.append(f"placement.ray.rollout_replicas must be >= 0, got {own.rollout_replicas}.")
    if own.weight_sync_bucket_mb < 0:
        out.append(f"placement.ray.weight_sync_bucket_mb must be >= 0 (MiB; 0: by transport), got "
                   f"{own.weight_sync_bucket_mb}.")
    backend = cfg.generation.backend
    if own.rollout_replicas and backend != registry.AUTO and not registry.get(backend).in_replicas:
        fits = [n for n in registry.names() if registry.get(n).in_replicas]
        out.append(f"placement.ray.rollout_replicas runs generation.backend={backend} in each replica, which that "
                   f"backend does not support yet; set generation.backend=auto (eager in replicas) or one of "
                   f"{', '.join(fits)}.")
    if own.rollout_replicas and cfg.lora.r:
        out.append("placement.ray.rollout_replicas does not carry LoRA adapters yet; set lora.r=0 or "
                   "placement.ray.rollout_replicas=0.")
    if cfg.reward.terms:
        from ..rewards.terms import parse_terms

        try:
            n = sum(t.path is not None for t in parse_terms(cfg.reward.terms))
        except ValueError:
            n = 0  # (malformed: the reward section's check says how)
        if n > 1:
            out.append(f"placement.name=ray hosts one reward model in its scorer actors; reward.terms names {n}: "
                       f"keep one reward model term, or run locally.")
    return out


def decide(cfg: Config, own: RaySettings, facts: Facts) -> Placement:
    import torch

    from ..api.placement import Placement, ThreadBudget

    pl = cfg.placement
    return Placement(scorer="ray", critic_trains_on="learner" if facts.needs_critic else "none", learner="ray",
                     rollout="ray" if own.rollout_replicas else "local",
                     rollout_streams_itself=bool(own.rollout_replicas and cfg.overlap.mode != "sequential"),
                     threads=ThreadBudget(pl.threads or torch.get_num_threads(), pl.actor_threads, pl.actor_threads))


def build(models: Models, placement: Placement, own: RaySettings) -> Placed:
    """The scorer actors (all stage-3 scoring goes to them, streamed or one-shot), the learner ranks
    (started from the controller's models: fresh heads and adapters are initialised per process,
    so rank 0's become everyone's), then the rollout backend and the weight sync."""
    from ..cluster import init_ray
    from ..learner import registry as learners
    from ..learner.group import learner_spec
    from ..scoring.ray import RayScorerWorker
    from ..weights.precision import copy_weights
    from ..weights.sync import load_source

    m, cfg = models, models.cfg
    pl = cfg.placement
    init_ray(own.address)
    specs = scorer_specs(m.paths, m.pad_id, m.compute_dtype, reward_model=m.reward_model is not None,
                         critic=m.critic is not None, packing=cfg.ppo.packing, new_head=cfg.reward.new_head,
                         buckets=cfg.ppo.shape_buckets)
    actors = RayScorerWorker(specs, m.tracer, temperature=cfg.generation.temperature, threads=pl.scorer_threads,
                             num_cpus=own.scorer_cpus, num_gpus=own.scorer_gpus, seed=cfg.run.seed)
    closers = [actors.close]
    engine, group = learners.get(pl.learner), learners.ranks(cfg.learner, pl.learner)
    assert engine.build_remote is not None  # (config validation: the engine runs under this placement)
    learner = engine.build_remote(learners.RemoteRequest(
        learner_spec(cfg.policy, cfg.lora, cfg.ppo, cfg.generation.temperature, cfg.run.seed, m.paths, m.pad_id,
                     m.compute_dtype, m.algorithm, m.recompute_old), group.ranks,
        group.cpus, group.gpus, pl.actor_threads, "STRICT_SPREAD" if group.spread else "PACK",
        actors if m.critic is not None else None, m.tracer, (m.policy, m.critic)))
    closers.insert(0, learner.close)
    load_source(m.policy, learner.weights_out())  # rank 0's initialisation, here too
    copy_weights(m.policy, m.rollout_policy)
    sync: list[Callable[[int], object]] = [learner.push_critic] if isinstance(learner, learners.PushesCritic) else []  # rank 0's critic -> actors
    if placement.rollout == "ray":
        return _with_rollout_replicas(m, placement, own, actors, learner, sync, closers)
    rollout, line = local_rollout(m)
    closers.insert(0, rollout.close)
    link = collective_sync(m, own, learner, local=m.rollout_policy)

    def actor_home(version: int) -> None:  # rank 0's actor -> the rollout backend's model (the policy is
        if link is not None:  # brought home only for checkpoints)
            link(version)
        else:
            load_source(m.rollout_policy, learner.weights_out())
        # (oppo's backends sample with that model: no copy; a backend with weights of its own reloads from it)
        rollout.load_weights(m.rollout_policy, version)
    sync.append(actor_home)
    if link is not None:
        closers.append(link.close)
    return Placed(learner, rollout, actors, sync, closers, line)


def _with_rollout_replicas(m: Models, placement: Placement, own: RaySettings, actors: Any, learner: Any,
                           sync: list[Callable[[int], object]], closers: list[Callable[[], None]]) -> Placed:
    """``build``'s roles with the rollout backend in ``rollout_replicas`` Ray replicas, which stream their
    chunks to the scorer ``actors`` themselves where the mode streams, and load rank 0's weights
    after each update (over a group of their own, or from the object store)."""
    import torch

    from ..api.specs import ModelSpec
    from ..rollout.ray import RayRolloutGroup
    from ..scoring.ray import FedByRollout

    cfg = m.cfg
    settings = rollout_settings(m, torch.device("cpu"))
    policy_spec = ModelSpec("policy", m.paths.policy, m.compute_dtype, pad_id=m.pad_id,
                            trust_remote_code=cfg.policy.trust_remote_code)
    stream = placement.rollout_streams_itself  # (the scorer actors serve every other mode)
    rollout = RayRolloutGroup(policy_spec, settings, own.rollout_replicas, seed=cfg.run.seed, tracer=m.tracer,
                              scorer=actors if stream else None, num_cpus=own.rollout_cpus,
                              num_gpus=own.rollout_gpus, threads=cfg.placement.actor_threads)
    closers.insert(0, rollout.close)
    line = f"{settings.kind} in {own.rollout_replicas} Ray rollout replicas ({settings.reason})"
    rollout.load_weights(m.policy, 0)
    scorer: Any = FedByRollout(actors) if stream else actors
    link = collective_sync(m, own, learner, rollout=rollout)
    if link is not None:  # rank 0 streams to the replicas over a group of their own
        sync.append(link)
        closers.append(link.close)
    else:  # the replicas load rank 0's weights straight from the object store
        sync.append(lambda version: rollout.load_weights(learner.weights_out(), version))
    return Placed(learner, rollout, scorer, sync, closers, line)


def scorer_specs(paths, pad_id: int, dtype: torch.dtype, *, reward_model: bool, critic: bool,
                 device: str = "auto", packing: str = "auto", new_head: bool = False, buckets: str = "auto") -> dict[str, Any]:
    """The streaming scorers' models as the trainer builds them, from its ``ResolvedPaths``: the
    reward model (unless a reward function scores), the reference (its own path, else the initial
    policy: also the LoRA base without adapters) and the critic (unless critic-free), all in the
    compute dtype, their one-shot forwards under ``ppo.packing`` = ``packing``."""
    from ..api.specs import ModelSpec

    specs = {}
    if reward_model:
        specs["reward"] = ModelSpec("reward", paths.reward, dtype, device, pad_id, packing=packing, new_head=new_head,
                                     buckets=buckets)
    specs["reference"] = ModelSpec("reference", paths.reference or paths.policy, dtype, device, pad_id,
                                   packing=packing, buckets=buckets)
    if critic:
        specs["critic"] = ModelSpec("critic", paths.critic, dtype, device, pad_id, packing=packing, buckets=buckets)
    return specs


def collective_sync(models: Models, own: RaySettings, learner, rollout=None, local=None):
    """``weight_sync``: the collective, bucketed sync from the learner to the ``rollout`` replicas
    or the local backend's model (``weights.sync.CollectiveSync``), or None for the object store:
    asked for, or ``auto`` without GPUs on both sides or when the group cannot form (a warning says
    why)."""
    import warnings

    from ..api.protocols import WeightLinkSender
    from ..weights.sync import CollectiveSync, WeightSyncUnavailable

    if own.weight_sync == "object_store":
        return None
    if not isinstance(learner, WeightLinkSender):
        if own.weight_sync == "collective":
            raise RuntimeError(f"placement.ray.weight_sync=collective: the learner engine "
                               f"{models.cfg.placement.learner} has no collective weight link; set "
                               f"placement.ray.weight_sync=object_store (or auto)")
        return None
    if own.weight_sync == "auto":  # collective where NCCL can carry it: every member on a GPU
        if rollout is not None:
            serving_on_gpu = own.rollout_gpus > 0
        else:
            assert local is not None  # (the sink: the replicas, or the local backend's model)
            serving_on_gpu = next(local.parameters()).is_cuda
        from ..learner import registry as learners

        cfg = models.cfg
        if not (learners.ranks(cfg.learner, cfg.placement.learner).gpus > 0 and serving_on_gpu):
            return None  # on CPU the object store (shared memory on a node) beats gloo: benchmarks/weight_sync
    wire = {n: t.dtype for n, t in models.rollout_policy.state_dict().items()}  # the serving side's dtypes
    try:
        return CollectiveSync(learner, rollout, local, bucket_bytes=int(own.weight_sync_bucket_mb * 2**20),
                              wire_dtype=wire)
    except WeightSyncUnavailable as e:
        if own.weight_sync == "collective":
            raise RuntimeError(f"placement.ray.weight_sync=collective: {e}") from e
        warnings.warn(f"{e}; the weights go through Ray's object store instead (placement.ray.weight_sync=auto)")
        return None


SPEC = PlacementSpec(
    "ray", "the scorers (reward, reference, critic) in Ray actors and the learner as a group of Ray ranks "
           "(torch.distributed: gloo on CPU, NCCL on GPU); the rollout backend stays with the controller unless "
           "placement.ray.rollout_replicas is set", decide=decide, build=build, remote=True,
    where="the Ray actors (placement.name=ray), which load their models from a directory",
    settings=RaySettings, checks=checks)
