"""The trainer: build the roles from a Config, then run PPO steps in the configured mode.

``Trainer.sequential_step`` is the reference loop (``overlap.mode=sequential``): the numbered
stages of ``shared/DESIGN.md`` section 2, one after another. ``Trainer.overlapped_step`` runs
the same stages in another order:

- ``intra``: chunks stream from the rollout engine to the scorer worker while decoding;
- ``inter``: B + Delta sequences in flight, the step closes when B have finished, the rest are
  carried (scored one-shot after the step closes);
- ``oppo``: both.

``Trainer.pipeline_step`` (``pipeline``) is the ``oppo`` step with in-flight weight updates
(PipelineRL): the update runs in a learner thread (or on the Ray learner group) while the
engine goes on decoding the next step's sequences with the weights it has, and the new weights
load between two decode steps with those sequences in flight.

With Delta = 0 and max_lag = 0 every overlapped mode trains exactly the batches of
``sequential`` (tested step for step).
"""

from __future__ import annotations

import copy
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from . import ppo_math as pm
from .algo import get_algorithm
from .config import Config
from .data import PromptSet, build_prompt_set, read_prompts
from .learner import CriticBatch, Experience, Learner, attach_scores, build_experience, compute_advantages
from .models import (apply_lora, base_view, check_model_path, check_roles, enable_gradient_checkpointing,
                     load_causal_lm, load_critic, load_function, load_reward_model, load_tokenizer, resolve_device,
                     resolve_dtype, stop_token_ids)
from .rollout import Rollout, RolloutEngine
from .scheduler import ChunkSizeTuner, DeltaController, Scheduler
from .scoring import RewardFunction, ScoredOutputs, StreamingScorer, score_full
from .trace import Tracer
from .weights import copy_weights, master_dtype, serving_copy
from .workers import ProcessScorerWorker, ScorerWorker

DEFAULT_MAX_NEW_TOKENS = 256


@dataclass
class ResolvedPaths:
    policy: str
    reward: str | None
    reward_function: str | None
    critic: str
    reference: str | None
    prompts: str
    judge: str | None
    max_new_tokens: int
    accuracy: str | None = None
    """The built-in task's right-answer function (``task/accuracy``), if it has one."""


def resolve_paths(cfg: Config, progress: bool = True) -> ResolvedPaths:
    """Fill in the built-in task's models and prompts where the config names none.

    Checks user paths before anything expensive; prepares the built-in task if needed.
    """
    max_new = cfg.generation.max_new_tokens
    if cfg.uses_builtin_task:
        from .task import get_task, prepare

        task = get_task(cfg.data.task)
        prepared = prepare(task=cfg.data.task, progress=progress)
        reward_fn = cfg.reward.function or task.reward_function
        reward_path = cfg.reward.path or (None if reward_fn else str(prepared.reward_path))
        return ResolvedPaths(
            policy=str(prepared.policy_path), reward=reward_path, reward_function=reward_fn,
            critic=cfg.critic.path or reward_path or str(prepared.policy_path),
            reference=cfg.reference.path, prompts=cfg.data.prompts or str(prepared.prompts_path),
            judge=cfg.reward.judge or task.judge_function, max_new_tokens=max_new or task.max_new_tokens,
            accuracy=None if cfg.data.prompts else task.accuracy_function)  # it knows only the task's prompts
    if cfg.data.prompts is None:
        raise ValueError("policy.path is set but data.prompts is not: give a prompt set (data.prompts=path.jsonl).")
    for role, path in (("policy", cfg.policy.path), ("reward", cfg.reward.path), ("critic", cfg.critic.path),
                       ("reference", cfg.reference.path)):
        if path:
            check_model_path(path, role)
    return ResolvedPaths(
        policy=cfg.policy.path, reward=cfg.reward.path, reward_function=cfg.reward.function,
        critic=cfg.critic.path or cfg.reward.path or cfg.policy.path, reference=cfg.reference.path,
        prompts=cfg.data.prompts, judge=cfg.reward.judge, max_new_tokens=max_new or DEFAULT_MAX_NEW_TOKENS)


@dataclass
class StepResult:
    """What a step hands to metrics: the trained batch and its stats."""

    exp: Experience
    stats: dict[str, float]
    texts: list[tuple[str, str]]


def build_algorithm(cfg: Config):
    """The configured ``algo.Algorithm`` (its settings are derived once, in the config)."""
    settings = dict(group_size=cfg.group_size, kl_coef=cfg.ppo.kl_coef, kl_estimator=cfg.kl_estimator,
                    kl_placement=cfg.kl_placement)
    if cfg.algo.name == "ppo":
        settings.update(gamma=cfg.ppo.gamma, lam=cfg.ppo.lam, whiten=cfg.ppo.whiten_advantages)
    elif cfg.algo.name == "reinforce_pp":
        settings.update(gamma=cfg.ppo.gamma)
    elif cfg.algo.name == "grpo":
        settings.update(std_normalize=cfg.algo.std_normalize)
    return get_algorithm(cfg.algo.name, **settings)


class Trainer:
    def __init__(self, cfg: Config, progress: bool = True):
        self.cfg = cfg
        threads = cfg.run.threads or torch.get_num_threads()
        self.threads = threads
        torch.set_num_threads(threads)
        _seed_everything(cfg.run.seed)
        paths = resolve_paths(cfg, progress=progress)
        self.paths = paths
        if cfg.generation.engine == "vllm":  # before any model loads: vLLM installed, the policy servable
            from .roles.vllm_rollout import check_vllm

            check_vllm(paths.policy, cfg.policy.device)
        self.tokenizer = tok = load_tokenizer(paths.policy)
        self.eos_id, self.pad_id = tok.eos_token_id, tok.pad_token_id
        dev = resolve_device(cfg.policy.device)
        self.device = dev
        # compute dtype (rollout, scoring, the training forward) and the trained weights' dtype:
        # fp32 masters under bf16 (weights.py)
        dtype = self.compute_dtype = resolve_dtype(cfg.policy.dtype, dev)
        master = master_dtype(dtype)
        self.prompt_set: PromptSet = build_prompt_set(
            read_prompts(paths.prompts, cfg.data.field, cfg.data.split), tok, cfg.data, cfg.run.seed)
        # every role's config and tokenizer, before any weights load (fast; names the fix)
        self.algorithm = build_algorithm(cfg)
        if not self.algorithm.needs_critic:
            paths.critic = None  # critic-free: no critic is loaded, scored, trained or checkpointed
        check_roles(tok, reward=paths.reward, critic=paths.critic, reference=paths.reference)
        # Reward first: an invalid reward model or function fails before the big models load.
        self.reward_fn = None
        self.reward_model = None
        if paths.reward_function:
            self.reward_fn = RewardFunction(load_function(paths.reward_function), paths.reward_function)
        else:
            self.reward_model = load_reward_model(paths.reward, resolve_device(cfg.reward.device, str(dev)),
                                                  dtype, self.pad_id)
        self.judge_fn = load_function(paths.judge, "reward.judge") if paths.judge else None
        self.accuracy_fn = load_function(paths.accuracy, "task accuracy") if paths.accuracy else None
        # self.policy / self.critic: the trained weights (what the learner steps and checkpoints
        # save); self.rollout_policy / self.scoring_critic: what the engine and scorers run, the
        # same objects in fp32, bf16 copies refreshed after each update under mixed precision
        lora = cfg.lora
        # LoRA: the frozen base stays in the compute dtype (only the fp32 adapters train)
        self.policy = load_causal_lm(paths.policy, "policy", dev, dtype if lora.r else master,
                                     cfg.policy.trust_remote_code)
        if lora.r:
            self.policy = apply_lora(self.policy, lora.r, lora.alpha, lora.dropout, lora.target_modules)
        inflight = cfg.in_flight  # the learner trains the masters while the copies serve
        self.rollout_policy = serving_copy(self.policy, dtype, separate=inflight)
        ref_dev = resolve_device(cfg.reference.device, str(dev))
        if paths.reference:
            self.reference = load_causal_lm(paths.reference, "reference", ref_dev, dtype)
        elif lora.r:  # the base model without adapters: the policy's own frozen weights, no copy
            self.reference = base_view(self.policy)
        else:  # a frozen copy of the initial policy
            self.reference = copy.deepcopy(self.rollout_policy).to(ref_dev)
        self.reference.eval().requires_grad_(False)
        self.critic = self.scoring_critic = None
        # the critic trains on the scorer worker (local placements), which scores with it in the
        # same message order; otherwise the learner (in-flight: its thread) trains it
        self.critic_on_worker = bool(cfg.streams and cfg.overlap.critic_on_worker and paths.critic
                                     and cfg.placement.backend != "ray")
        if paths.critic:
            self.critic = load_critic(paths.critic, resolve_device(cfg.critic.device, str(dev)), master,
                                      self.pad_id).eval()
            self.scoring_critic = serving_copy(self.critic, dtype, separate=inflight and not self.critic_on_worker)
        if cfg.policy.gradient_checkpointing:  # the trained models; recomputation only while training
            for m in (self.policy, self.critic):
                if m is not None:
                    enable_gradient_checkpointing(m)
        self.policy.eval()  # no dropout anywhere: rollout and training see the same function
        self.max_new_tokens = paths.max_new_tokens
        g = cfg.generation
        self.stop_ids = stop_token_ids(tok, self.policy)
        if g.engine == "static":
            from .fastdecode import StaticRolloutEngine

            B = cfg.ppo.batch_size
            self.engine = StaticRolloutEngine(self.rollout_policy, self.stop_ids, self.pad_id, self.max_new_tokens,
                                              g.temperature, g.top_k, g.top_p, seed=cfg.run.seed,
                                              max_rows=2 * B if cfg.carries else B,  # B + Delta, refill: <= 2B
                                              max_len=cfg.data.max_prompt_tokens + self.max_new_tokens,
                                              capture="cuda_graph" if dev.type == "cuda" else "none")
        elif g.engine == "vllm":
            from .roles.vllm_rollout import build_vllm_backend

            self.engine = build_vllm_backend(cfg, paths.policy, self.stop_ids, self.pad_id, self.max_new_tokens,
                                             weights=self.rollout_policy)
        else:
            self.engine = RolloutEngine(self.rollout_policy, self.stop_ids, self.pad_id, self.max_new_tokens,
                                        g.temperature, g.top_k, g.top_p, seed=cfg.run.seed)
        if g.kv_budget_mb:
            self.engine.kv_budget_mb = g.kv_budget_mb
        recompute = {"recompute": True, "sampler": False}.get(
            cfg.ppo.old_logprobs, dtype != torch.float32 or g.top_k > 0 or g.top_p < 1.0  # auto: when they can differ
            or g.engine == "vllm")
        self.learner = Learner(self.policy, self.critic, cfg.ppo, g.temperature, cfg.run.seed,
                               compute_dtype=dtype, recompute_old=recompute, algorithm=self.algorithm)
        o = cfg.overlap
        carries = cfg.carries
        B = cfg.ppo.batch_size
        G = cfg.group_size
        dmax = min(o.delta_max, B // G)  # derived once: the adaptive bounds never exceed B (groups: B / G)
        dmin = min(o.delta_min, dmax)
        delta = (DeltaController(min(max(o.delta_init, dmin), dmax), dmin, dmax, o.delta_window,
                                 o.delta_proportional)
                 if carries and o.delta < 0 else (o.delta if carries else 0))
        self.scheduler = Scheduler(cfg.ppo.batch_size, o.max_lag if carries else 0, delta,
                                   refill=o.refill and carries, group_size=G, partial_groups=o.partial_groups)
        self.tuner = ChunkSizeTuner(tuple(o.chunk_candidates), o.chunk_trial_steps, o.chunk_retune_every,
                                    fixed=o.chunk_size or None)
        self.tracer = Tracer(enabled=cfg.log.trace)
        self.rollouts: dict[int, Rollout] = {}  # admitted, not yet trained
        self.worker: ScorerWorker | None = None
        self._learner_thread = ThreadPoolExecutor(1, thread_name_prefix="oppo-learner") if inflight else None
        self._next_begun = False  # pipeline: the next step's prompts were admitted while the learner trained
        self.rollout_group = None  # placement.rollout_workers: the engine is a group of Ray rollout workers
        self.streams_direct = False  # ...which admit and feed the scorer actors themselves
        if cfg.streams:
            scorers = {"reference": StreamingScorer("reference", self.reference, self.pad_id, g.temperature)}
            if self.critic is not None:
                scorers["critic"] = StreamingScorer("critic", self.scoring_critic, self.pad_id)
            if self.reward_model is not None:
                scorers = {"reward": StreamingScorer("reward", self.reward_model, self.pad_id), **scorers}
            on_cpu = all(s.device.type == "cpu" for s in scorers.values())
            # the child process shares the scorers' weights in place (the controller refreshes the
            # critic's copy only after a barrier); when the critic trains in the child, it trains the
            # copy it scores with, so that must be the fp32 master: a bf16 run then uses the thread worker
            use_process = o.scorer_process and on_cpu and (self.scoring_critic is self.critic
                                                           or not self.critic_on_worker)
            worker_cls = ProcessScorerWorker if use_process else ScorerWorker
            trainer = (self.learner.critic_opt, cfg.ppo) if self.critic_on_worker else None
            self.worker = worker_cls(scorers, o.scorer_threads, self.tracer, critic_trainer=trainer)
            if not use_process:
                self.worker.critic_master, self.worker.compute_dtype = self.critic, dtype
        if cfg.placement.backend == "ray":
            self._place_on_ray(dtype, recompute)
        self.step = 0
        self.wallclock = 0.0
        self.step_windows: dict[int, tuple[float, float]] = {}  # perf_counter bounds of each step
        self.length_sampler = None  # benchmarks: (prompt_index, member of its group) -> forced response length
        self.last_result: StepResult | None = None

    def _place_on_ray(self, dtype: torch.dtype, recompute_old: bool) -> None:
        """``placement.backend=ray``: the scorers become Ray actors (all stage-3 scoring goes to them,
        streamed or one-shot) and the learner a data-parallel group of Ray ranks that trains actor
        and critic; after each update rank 0's actor weights are copied into ``self.policy`` (the
        rollout engine's, ``time/weight_sync``) and its critic's to the scorer actor. The step code
        is the same: both are drop-ins (``placement/``)."""
        from .placement.cluster import init_ray
        from .placement.dp import DPLearnerGroup, learner_spec
        from .placement.ray_scorer import RayScorerWorker
        from .placement.specs import scorer_specs

        pl, o = self.cfg.placement, self.cfg.overlap
        init_ray(pl.address)
        if self.worker is not None:
            self.worker.close()
        specs = scorer_specs(self.paths, self.pad_id, dtype, reward_model=self.reward_model is not None,
                             critic=self.critic is not None)
        self.worker = RayScorerWorker(specs, self.tracer, temperature=self.cfg.generation.temperature,
                                      threads=o.scorer_threads, num_cpus=pl.scorer_cpus, num_gpus=pl.scorer_gpus,
                                      seed=self.cfg.run.seed)
        spec = learner_spec(self.cfg, self.paths, self.pad_id, dtype, self.algorithm, recompute_old)
        self.learner = DPLearnerGroup(spec, pl.learner_workers, num_cpus=pl.learner_cpus, num_gpus=pl.learner_gpus,
                                      threads=o.actor_threads, strategy="STRICT_SPREAD" if pl.spread else "PACK",
                                      # rollout workers load rank 0's weights themselves (_load_weights)
                                      rollout=None if pl.rollout_workers else self.policy,
                                      critic_scorer=self.worker if self.critic is not None else None,
                                      tracer=self.tracer)
        self.learner.sync_actor(self.policy)  # fresh heads/adapters are initialised per process: rank 0's rule
        copy_weights(self.policy, self.rollout_policy)
        if pl.rollout_workers:
            from .placement.ray_rollout import EngineSettings, RayRolloutGroup
            from .placement.specs import ModelSpec

            g = self.cfg.generation
            settings = EngineSettings(tuple(self.stop_ids), self.pad_id, self.max_new_tokens, g.temperature, g.top_k,
                                      g.top_p, g.kv_budget_mb or None)
            spec = ModelSpec("policy", self.paths.policy, dtype, pad_id=self.pad_id,
                             trust_remote_code=self.cfg.policy.trust_remote_code)
            stream = self.cfg.overlap.mode != "sequential"  # (the scorer actors serve every other mode)
            self.engine = self.rollout_group = RayRolloutGroup(
                spec, settings, pl.rollout_workers, seed=self.cfg.run.seed, tracer=self.tracer,
                scorer=self.worker if stream else None, num_cpus=pl.rollout_cpus, num_gpus=pl.rollout_gpus,
                threads=o.actor_threads)
            self.streams_direct = stream
            self.rollout_group.chunk = self.tuner.current()  # (then the size of each step's take_chunks)
            self.rollout_group.load_weights(self.policy)

    @property
    def on_ray(self) -> bool:
        return self.cfg.placement.backend == "ray"

    def learner_state(self) -> dict:
        """The optimizer states a checkpoint saves (``{"actor", "critic"}``); on Ray, also brings the
        ranks' trained weights into ``self.policy`` / ``self.critic``, which checkpoints save."""
        if not self.on_ray:
            out = {"actor": self.learner.actor_opt.state_dict()}
            if self.critic is not None:
                out["critic"] = self.learner.critic_opt.state_dict()
            return out
        st = self.learner.state_dict()
        self.policy.load_state_dict(st["actor"])
        out = {"actor": st["actor_opt"]}
        if self.critic is not None:
            self.critic.load_state_dict(st["critic"])
            out["critic"] = st["critic_opt"]
        return out

    def load_learner_state(self, optim: dict) -> None:
        """Inverse of :meth:`learner_state`, after ``self.policy`` / ``self.critic`` hold the
        checkpoint's weights. A checkpoint of any placement loads into any other."""
        from .workers import load_optimizer_state_in_place

        if self.on_ray:
            st = {"actor": self.policy.state_dict(), "actor_opt": optim["actor"]}
            if self.critic is not None:
                st.update(critic=self.critic.state_dict(), critic_opt=optim["critic"])
            self.learner.load_state_dict(st)
            return
        self.learner.actor_opt.load_state_dict(optim["actor"])
        if self.critic is not None:
            # in place: with overlap.critic_on_worker its state tensors are shared with the scorer process
            load_optimizer_state_in_place(self.learner.critic_opt, optim["critic"])

    def _score_full(self, role: str, model, prompts, responses, temperature: float = 1.0):
        """One-shot scoring of one role: on its Ray actor, or here."""
        if self.on_ray:
            return self.worker.score_full(role, prompts, responses)
        return score_full(role, model, prompts, responses, self.pad_id, temperature)

    # ================================================================== stages

    def _start(self, tickets) -> list[Rollout]:
        """Stage 1: turn admitted tickets into rollouts (prompt text and ids from the data stream)."""
        new = []
        for t in tickets:
            text, ids = self.prompt_set.at(t.prompt_index)
            r = Rollout(t.uid, t.prompt_index, text, list(ids), t.start_version, group=t.group)
            if self.length_sampler is not None:
                r.target_length = self.length_sampler(t.prompt_index, t.uid - t.group)  # (its place in its group)
            self.rollouts[t.uid] = r
            new.append(r)
        return new

    def _score(self, batch: list[Rollout], texts: list[str], step: int
               ) -> tuple[list[float], list[ScoredOutputs], list[ScoredOutputs]]:
        """Stage 3, one-shot: reward score, reference log-probs, critic values of whole sequences."""
        prompts, responses = [r.prompt_ids for r in batch], [r.response_ids for r in batch]
        with self.tracer.span("scorer", "score_reward", step):
            scores = self._reward_scores(batch, texts) if self.reward_fn else [
                o.score for o in self._score_full("reward", self.reward_model, prompts, responses)]
        with self.tracer.span("scorer", "score_reference", step):
            ref = self._score_full("reference", self.reference, prompts, responses, self.cfg.generation.temperature)
        values = None
        if self.critic is not None:
            with self.tracer.span("scorer", "score_critic", step):
                values = self._score_full("critic", self.scoring_critic, prompts, responses)
        return scores, ref, values

    def _reward_scores(self, batch: list[Rollout], texts: list[str]) -> list[float]:
        return self.reward_fn([r.prompt for r in batch], texts)

    def _texts(self, batch: list[Rollout]) -> list[str]:
        """Each response decoded once per step (reward function, judge and samples share it)."""
        return self.tokenizer.batch_decode([r.response_ids for r in batch], skip_special_tokens=True)

    def _experience(self, batch: list[Rollout], step: int) -> Experience:
        """The batch as tensors, with the off-policy correction of carried tokens (needs no scores)."""
        with self.tracer.span("learner", "experience", step):
            exp = build_experience(batch, self.pad_id, self.device)
            self.learner.old_logprobs(exp, step)
        return exp

    def _learn(self, exp: Experience, texts: list[str], scores, ref, values, step: int) -> StepResult:
        """Stages 4-6 (KL-shaped rewards, GAE, PPO epochs), then the weight sync."""
        result = self._update(exp, texts, scores, ref, values, step)
        self._load_weights(result.stats, step)
        return result

    def _update(self, exp: Experience, texts: list[str], scores, ref, values, step: int) -> StepResult:
        """Stages 4-6: KL-shaped rewards, GAE, PPO epochs. Changes the trained weights only (the
        pipeline's learner thread runs it while the engine decodes with the serving copies)."""
        batch = exp.rollouts
        with self.tracer.span("learner", "advantages", step):
            exp = compute_advantages(attach_scores(exp, scores, ref, values), self.cfg.ppo, self.algorithm)
        if self.critic_on_worker:
            # the critic trains on the scorer worker (its own core or stream) while the actor trains here
            # (in-flight: from the learner thread, while the controller goes on feeding it chunks)
            self.worker.train_critic(CriticBatch.of(exp), self.learner.minibatches(len(batch), step), step)
            threads = not self.cfg.in_flight  # (torch's thread count is per process: the decoding's too)
            if threads:
                torch.set_num_threads(self.cfg.overlap.actor_threads)
            with self.tracer.span("learner", "train", step):
                stats = self.learner.update(exp, step, critic=False)
            if threads:
                torch.set_num_threads(self.threads)
            with self.tracer.span("controller", "wait_critic", step):
                self.worker.barrier()
            stats.update(self.worker.take_train_stats())
        else:
            with self.tracer.span("learner", "train", step):
                # on Ray the group pulls rank 0's weights into self.policy and sends its critic to
                # the scorer actor, here or (in-flight updates) in _load_weights
                stats = (self.learner.update(exp, step, sync=False) if self.on_ray and self.cfg.in_flight
                         else self.learner.update(exp, step))
        stats.update(exp.stats or {})
        return StepResult(exp, stats, [(r.prompt, t) for r, t in zip(batch, texts)])

    def _load_weights(self, stats: dict[str, float], step: int) -> None:
        """The weight sync: the serving copies (engine, critic scorer) := the trained weights; adds
        the seconds it took to ``time/weight_sync`` (on Ray: with the pull from rank 0)."""
        t = time.perf_counter()
        with self.tracer.span("learner", "weight_sync", step):
            if self.on_ray and self.cfg.in_flight:
                self.learner.sync(step)  # (timed below, with the local copies)
            if not self.critic_on_worker:  # (the worker refreshes the copy it scores with)
                copy_weights(self.critic, self.scoring_critic)
            if self.rollout_group is not None:  # (self.policy is brought home only for checkpoints)
                self.rollout_group.load_weights(self.learner.actor_weights())
            else:
                copy_weights(self.policy, self.rollout_policy)
                if self.cfg.generation.engine == "vllm":  # into the running engine, between two of its steps
                    self.engine.load_weights(self.rollout_policy, step + 1)
        stats["time/weight_sync"] = stats.get("time/weight_sync", 0.0) + time.perf_counter() - t

    def sync_weights(self) -> None:
        """Refresh the serving copies from the trained weights (after a checkpoint load)."""
        copy_weights(self.policy, self.rollout_policy)
        copy_weights(self.critic, self.scoring_critic)
        if self.rollout_group is not None:
            self.rollout_group.load_weights(self.policy)
        if self.cfg.generation.engine == "vllm":
            self.engine.load_weights(self.rollout_policy, self.engine.version)

    # ================================================================== the reference loop

    def sequential_step(self, step: int) -> tuple[StepResult, dict[str, float]]:
        """One PPO step, stage after stage (overlap.mode=sequential)."""
        times: dict[str, float] = {}
        # 1. take B prompts
        batch = self._start(self.scheduler.begin_step().seqs)
        # 2. generate: sample responses from pi_k with their behaviour log-probs and version
        t = time.perf_counter()
        self.engine.set_version(step)
        with self.tracer.span("actor", "generate", step):
            self.engine.admit(batch)
            self.engine.generate_all()
        times["time/generate"] = time.perf_counter() - t
        for r in batch:
            self.scheduler.on_finished(r.uid)
        close = self.scheduler.try_close()
        # 3. score: reward at the last token, reference log-probs, critic values
        t = time.perf_counter()
        texts = self._texts(batch)
        scores, ref, values = self._score(batch, texts, step)
        times["time/score"] = time.perf_counter() - t
        # 4-6. rewards, advantages, PPO epochs
        t = time.perf_counter()
        result = self._learn(self._experience(batch, step), texts, scores, ref, values, step)
        times["time/train"] = time.perf_counter() - t
        self._finish(close.uids)
        return result, times

    # ================================================================== the overlapped runtime

    def overlapped_step(self, step: int) -> tuple[StepResult, dict[str, float]]:
        """The same stages with intra-step streaming and/or inter-step carrying."""
        times: dict[str, float] = {}
        t_gen = time.perf_counter()
        # The actor decodes on its own core(s); the scorer worker has its own thread count.
        torch.set_num_threads(self.cfg.overlap.actor_threads if self.worker else self.threads)
        self._new_weights(step)
        chunk = self.tuner.current() if self.worker else 0
        self._admit(self.scheduler.begin_step().seqs, step)
        close = self._decode_until_close(step, chunk)
        times["time/generate"] = time.perf_counter() - t_gen
        torch.set_num_threads(self.threads)
        t = time.perf_counter()
        exp, texts, scores, ref, values = self._close_batch(close, step, chunk)
        times["time/score"] = time.perf_counter() - t
        t = time.perf_counter()
        result = self._learn(exp, texts, scores, ref, values, step)
        times["time/train"] = time.perf_counter() - t
        result.stats.update(self._overlap_stats(close, result.exp, chunk))
        self._finish(close.uids)
        return result, times

    def pipeline_step(self, step: int) -> tuple[StepResult, dict[str, float]]:
        """``overlap.mode=pipeline``: the ``oppo`` step with in-flight weight updates (PipelineRL).

        Once the batch is closed and scored, the update runs in the learner thread (or on the Ray
        learner group) while this thread admits the next step's prompts and goes on decoding with
        the weights it has, tagging each token with that version. When the update is done, the new
        weights load between two decode steps; the sequences in flight keep their KV cache
        (``stale_kv=keep``, their later tokens count as the older version) or have it recomputed.
        A token is at most ``max_lag + 1`` versions old when trained. Not bitwise reproducible: how
        far decoding gets during an update depends on timing. No next step starts before a
        checkpoint (``run.save_every``) or after the run's last step: a checkpoint would drop it.
        """
        cfg, eng, sched = self.cfg, self.engine, self.scheduler
        times: dict[str, float] = {}
        t_gen = time.perf_counter()
        torch.set_num_threads(cfg.overlap.actor_threads)
        if eng.version != step:  # the first step of a run or of a resume (otherwise loaded at the last one's end)
            self._new_weights(step)
        chunk = self.tuner.current()
        if not self._next_begun:
            self._admit(sched.begin_step().seqs, step)
        self._next_begun = False
        close = self._decode_until_close(step, chunk)
        times["time/generate"] = time.perf_counter() - t_gen
        t = time.perf_counter()
        exp, texts, scores, ref, values = self._close_batch(close, step, chunk)
        times["time/score"] = time.perf_counter() - t
        t = time.perf_counter()
        stats = self._overlap_stats(close, exp, chunk)  # before the next step is admitted
        update = self._learner_thread.submit(self._update, exp, texts, scores, ref, values, step)
        sched.end_step(sum(scores) / len(scores))
        nxt, decoded = step + 1, 0
        if nxt < cfg.run.steps and not (cfg.run.save_every and nxt % cfg.run.save_every == 0):
            self._admit(sched.begin_step().seqs, step)  # the next step's sequences, sampled by this step's weights
            self._next_begun = True
            t_span = time.perf_counter()
            while not update.done() and eng.active:
                decoded += eng.active
                t_span = self._decode_once(step, chunk, t_span, stage="decode_inflight")
            self.tracer.add("actor", "decode_inflight", step, t_span, time.perf_counter())
        times["time/inflight_decode"] = time.perf_counter() - t
        with self.tracer.span("controller", "wait_learner", step):
            result = update.result()
        times["time/train"] = time.perf_counter() - t
        in_flight = eng.active
        if self.critic is not None and not self.critic_on_worker and not self.on_ray:
            self.worker.barrier()  # no chunk is being scored with the critic copy while it changes
        self._load_weights(result.stats, step)
        self._new_weights(nxt)
        result.stats.update(stats, **{"pipeline/inflight_tokens": decoded, "pipeline/rows_at_load": in_flight})
        self._finish(close.uids)
        return result, times

    def _new_weights(self, version: int) -> None:
        """The engine samples as ``version`` from now on; with ``stale_kv=recompute`` the rows in
        flight get their KV cache rebuilt by it."""
        self.engine.set_version(version)
        if self.cfg.carries and self.cfg.overlap.stale_kv == "recompute" and self.engine.active:
            with self.tracer.span("actor", "recompute_kv", version):
                self.engine.recompute()

    def _decode_until_close(self, step: int, chunk: int):
        """Decode (streaming chunks to the scorers) until the scheduler closes the step."""
        close, t_span = None, time.perf_counter()
        while close is None:
            if self.engine.active == 0:  # (pipeline: the batch may have finished while the learner trained)
                close = self.scheduler.try_close()
                if close is None:
                    raise RuntimeError("internal error: the step cannot close but nothing is decoding")
                break
            t_span = self._decode_once(step, chunk, t_span)
            close = self.scheduler.try_close()
        self.tracer.add("actor", "decode", step, t_span, time.perf_counter())
        return close

    def _decode_once(self, step: int, chunk: int, t_span: float, stage: str = "decode") -> float:
        """One decode step: finished rows go to the scheduler (refills are admitted), chunks of
        ``chunk`` tokens to the scorer worker. Returns the start of the open trace span."""
        for r in self.engine.step():
            refill = self.scheduler.on_finished(r.uid)
            if refill is not None:
                self._admit(refill.seqs, step)
        if self.worker:
            chunks = self.engine.take_chunks(chunk)
            if chunks:
                now = time.perf_counter()
                self.tracer.add("actor", stage, step, t_span, now)
                t_span = now
                self.worker.feed(chunks, step)
        else:
            self.engine.finished.clear()  # no scorer to stream final chunks to
        return t_span

    def _close_batch(self, close, step: int, chunk: int):
        """The closed step's batch with its scores: (experience, texts, scores, reference
        log-probs, values)."""
        cfg, worker = self.cfg, self.worker
        uids = sorted(close.uids)  # admission order, as the sequential loop trains them
        batch = [self.rollouts[u] for u in uids]
        if not worker:
            texts = self._texts(batch)
            exp = self._experience(batch, step)
            return (exp, texts, *self._score(batch, texts, step))
        worker.feed(self.engine.take_chunks(chunk), step)  # rows retired since the last boundary
        # While the scorers finish the last chunks, this process does the batch's own work on its
        # core: texts, the off-policy correction, and the values of carried prefixes (reading
        # the critic alongside the scorer is safe: nothing writes it until the update).
        torch.set_num_threads(cfg.overlap.actor_threads)
        texts = self._texts(batch)
        exp = self._experience(batch, step)
        # the critic changed since their prefix was scored
        stale = [i for i, r in enumerate(batch) if r.scored_version is not None and r.scored_version < step]
        fresh = []
        if stale and self.critic is not None and cfg.overlap.stale_values == "recompute":
            with self.tracer.span("learner", "recompute_values", step):
                fresh = self._score_full("critic", self.scoring_critic, [batch[i].prompt_ids for i in stale],
                                         [batch[i].response_ids for i in stale])
        torch.set_num_threads(self.threads)
        with self.tracer.span("controller", "wait_scorers", step):  # waiting: not actor work
            worker.barrier()  # also: no scorer work may touch the critic while it trains
        out = worker.take(uids)
        scores = self._reward_scores(batch, texts) if self.reward_fn else [o.score for o in out["reward"]]
        ref, values = out["reference"], out.get("critic")
        for i, v in zip(stale, fresh):
            values[i] = v
        return exp, texts, scores, ref, values

    def _admit(self, tickets, step: int) -> None:
        new = self._start(tickets)
        if not new:
            return
        for r in new:
            r.scored_version = self.engine.version
        with self.tracer.span("actor", "prefill_prompt", step):
            self.engine.admit(new)
        if self.worker and not self.streams_direct:
            self.worker.admit([r.uid for r in new], [r.prompt_ids for r in new], step)

    def _finish(self, uids) -> None:
        for u in uids:
            self.rollouts.pop(u, None)

    def _overlap_stats(self, close, exp: Experience, chunk: int) -> dict[str, float]:
        lags = close.lags
        trained = set(close.uids)
        mask = exp.mask > 0
        off = (exp.versions < close.step) & mask
        w = exp.is_weights[off]
        return {
            "overlap/delta": self.scheduler.delta, "overlap/carried": len(self.scheduler.in_flight),
            "overlap/waiting_members": self.scheduler.waiting_members,
            "overlap/lag_max": max(lags), "overlap/lag_mean": sum(lags) / len(lags),
            "overlap/offpolicy_token_frac": off.sum().item() / max(1, mask.sum().item()),
            "overlap/is_weight_mean": w.mean().item() if w.numel() else 1.0,
            "overlap/is_weight_max": w.max().item() if w.numel() else 1.0,
            "overlap/chunk_size": chunk,
            **{f"overlap/lag_{lag}": n for lag, n in close.lag_histogram().items()},
            "overlap/in_flight_length_mean": _mean([len(r.response_ids) for u, r in self.rollouts.items()
                                                    if u not in trained] or [0]),
        }

    # ================================================================== the loop

    def run_step(self) -> dict[str, float]:
        step = self.step
        t0, c0 = time.perf_counter(), time.process_time()
        torch.set_num_threads(self.cfg.overlap.actor_threads if self.cfg.overlap.mode != "sequential"
                              else self.threads)
        if self.cfg.overlap.mode == "sequential":
            result, times = self.sequential_step(step)
        elif self.cfg.in_flight:
            result, times = self.pipeline_step(step)  # (ends the scheduler's step itself)
        else:
            result, times = self.overlapped_step(step)
        t1 = time.perf_counter()
        dt = t1 - t0
        self.step_windows[step] = (t0, t1)
        self.wallclock += dt
        self.tuner.record(dt)
        metrics = self._metrics(result, times, dt)
        # share of the machine's CPU capacity this process used during the step
        metrics["perf/cpu_util"] = (time.process_time() - c0) / (dt * (os.cpu_count() or 1))
        if not self.cfg.in_flight:
            self.scheduler.end_step(metrics["reward/mean"])
        self.step += 1
        self.last_result = result
        return metrics

    def _metrics(self, result: StepResult, times: dict[str, float], dt: float) -> dict[str, float]:
        exp = result.exp
        lengths = exp.mask.sum(1)
        kl_seq = (exp.kl * exp.mask).sum(1)
        m = {
            "reward/mean": exp.scores.mean().item(), "reward/std": exp.scores.std().item() if len(exp.scores) > 1 else 0.0,
            "kl/mean": kl_seq.mean().item(),
            "response_length/mean": lengths.mean().item(), "response_length/max": lengths.max().item(),
            "response_length/eos_frac": _mean([float(r.ended_with_eos) for r in exp.rollouts]),
            "time/step": dt, "time/wallclock": self.wallclock,
            "perf/tokens_per_s": lengths.sum().item() / dt,
            "data/prompts_truncated": self.prompt_set.truncated, "data/prompts_skipped": self.prompt_set.skipped,
            **times,
        }
        if exp.values is not None and exp.returns is not None:
            m["value/explained_var"] = pm.explained_variance(exp.values, exp.returns, exp.mask).item()
        m.update({k: v for k, v in result.stats.items() if not k.startswith("_")})
        m.update(self._memory())
        prompts, responses = [p for p, _ in result.texts], [r for _, r in result.texts]
        if self.judge_fn is not None:
            m["judge/mean"] = _mean(self.judge_fn(prompts, responses))
        if self.accuracy_fn is not None:
            m["task/accuracy"] = _mean(self.accuracy_fn(prompts, responses))
        return m

    def _memory(self) -> dict[str, float]:
        """Memory of this step (MiB): the actor's KV-cache peak, the streaming scorers' (peak so
        far), on GPU each device's peak allocation during the step (reset after reading), and the
        process's peak resident memory (all roles of this process; the scorer process apart)."""
        import resource

        mb = 1024 * 1024
        out = {"memory/actor_kv_peak_mb": self.engine.peak_cache_bytes / mb}
        self.engine.peak_cache_bytes = 0  # per step
        if self.worker:
            for role, s in self.worker.scorers.items():
                out[f"memory/{role}_kv_peak_mb"] = s.peak_cache_bytes / mb
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                out[f"memory/cuda{i}_peak_mb"] = torch.cuda.max_memory_allocated(i) / mb
                torch.cuda.reset_peak_memory_stats(i)
        out["memory/host_rss_peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        return out

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def between_steps(self) -> None:
        """Bring the run to a state a checkpoint saves: a pipeline run's next step, begun while
        the learner trained, is un-begun (its sequences stay admitted, for the checkpoint to drain)."""
        if self._next_begun:
            self.scheduler.suspend()
            self._next_begun = False

    def close(self) -> None:
        if self._learner_thread is not None:
            self._learner_thread.shutdown(wait=True)
        if self.rollout_group is not None:
            self.rollout_group.close()
        if self.cfg.generation.engine == "vllm":
            self.engine.close()
        if self.on_ray:
            self.learner.close()
        if self.worker:
            self.worker.close()


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
