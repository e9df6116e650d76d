"""``placement.name=local``: every role in this process, the scorers inline (sequential mode), on
a thread or in a child process that shares their weights (overlapped modes), the critic trained by
the learner or by the scorer worker beside its scoring."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..parts import setting
from . import Facts, Placed, PlacementSpec, local_rollout

if TYPE_CHECKING:
    from ..api.placement import Placement
    from ..api.roles import Models
    from ..config import Config


@dataclass
class LocalSettings:
    scorer_process: bool = setting(True, "CPU: run the scorer worker in its own process (no GIL shared with the "
                                         "actor) instead of a thread. Ignored on GPU.")
    critic_on_worker: bool = setting(True, "Overlapped modes: the scorer worker, which holds the critic, runs the "
                                           "critic's PPO update while the actor trains (same weights as one after "
                                           "the other).")


def decide(cfg: Config, own: LocalSettings, facts: Facts) -> Placement:
    import torch

    from ..api.placement import Placement, ThreadBudget

    pl = cfg.placement
    critic_on_scorer = bool(cfg.streams and own.critic_on_worker and facts.needs_critic)
    if not cfg.streams:
        scorer = "inline"
    else:
        # the child process shares the scorers' weights in place; when the critic trains in the
        # child, it trains the copy it scores with, so that must be the fp32 master: a bf16 run
        # then uses the scorer worker on a thread
        process = own.scorer_process and facts.scorers_on_cpu and (facts.computes_in_master or not critic_on_scorer)
        scorer = "process" if process else "thread"
    full = pl.threads or torch.get_num_threads()
    return Placement(scorer=scorer,
                     critic_trains_on="none" if not facts.needs_critic else "scorer" if critic_on_scorer else "learner",
                     learner="local", rollout="local", rollout_streams_itself=False,
                     threads=ThreadBudget(full, pl.actor_threads if cfg.streams else full, pl.actor_threads))


def build(models: Models, placement: Placement, own: LocalSettings) -> Placed:
    from ..learner import registry as learners
    from ..learner.critic import CriticBesideScorer, CriticTrainer
    from ..learner.local import Learner
    from ..scoring.inline import InlineScorer
    from ..scoring.streaming import StreamingScorer
    from ..scoring.worker import ScorerWorker
    from ..weights.precision import copy_weights

    import sys

    from ..learner.budget import sized

    m, cfg = models, models.cfg
    # the micro-batches' token budget, sized to the device once (ppo.micro_batch_tokens=-1): every
    # party that cuts a minibatch (learner, the critic's trainer) reads this one
    ppo = sized(cfg.ppo, [x for x in (m.policy, m.critic) if x is not None], cfg.policy.gradient_checkpointing,
                say=lambda line: print(f"oppo: {line}", file=sys.stderr))
    learner = Learner(m.policy, m.critic, ppo, cfg.generation.temperature, cfg.run.seed,
                      compute_dtype=m.compute_dtype, recompute_old=m.recompute_old, algorithm=m.algorithm)
    engine = learners.get(cfg.placement.learner)
    assert engine.build_local is not None  # (config validation: the engine runs under this placement)
    trained: Any = engine.build_local(learners.LocalRequest(learner, cfg))
    rollout, line = local_rollout(m)
    scorers = {"reference": StreamingScorer("reference", m.reference, m.pad_id, cfg.generation.temperature)}
    if m.critic is not None:
        scorers["critic"] = StreamingScorer("critic", m.scoring_critic, m.pad_id)
    if m.reward_model is not None:
        scorers = {"reward": StreamingScorer("reward", m.reward_model, m.pad_id),
                   **{role: StreamingScorer("reward", rm, m.pad_id) for role, rm in m.extra_reward_models.items()},
                   **scorers}
    trains_beside = placement.critic_trains_on == "scorer"
    scorer: Any
    if placement.scorer == "inline":
        scorer = InlineScorer(scorers)
    else:
        critic_trainer = None
        if trains_beside:  # (a critic, so its optimizer)
            assert learner.critic_opt is not None
            critic_trainer = CriticTrainer(learner.critic_opt, learner.critic_settings,
                                           None if placement.scorer == "process" else m.critic, m.compute_dtype)
        scorer = ScorerWorker(scorers, cfg.placement.scorer_threads, m.tracer, trainer=critic_trainer,
                              transport=placement.scorer)
        if trains_beside:
            trained = CriticBesideScorer(learner, scorer, m.tracer, placement.threads, cfg.in_flight, trained)
    sync: list[Callable[[int], object]] = []
    critic, serving = m.critic, m.scoring_critic
    if critic is not None and serving is not None and not trains_beside and serving is not critic:
        def critic_copy(version: int) -> None:
            scorer.barrier()  # no chunk is being scored with the critic copy while it changes
            copy_weights(critic, serving)
        sync.append(critic_copy)
    sync.append(lambda version: rollout.load_weights(m.policy, version))
    return Placed(trained, rollout, scorer, sync, closers=[rollout.close, scorer.close], backend=line)


SPEC = PlacementSpec(
    "local", "every role in this process; in overlapped modes the scorers (reward, reference, critic) in a worker "
             "beside the actor: a child process sharing their weights on CPU, else a thread",
    decide=decide, build=build, settings=LocalSettings)
