"""The FSDP2 learner (``learner/fsdp.py``): 2 ranks (gloo, CPU, fp32), spawned with
``torch.multiprocessing``, train the single learner's weights and AdamW state (within 1e-5) over
several updates, under every loss aggregation, KL in the loss (PPO's k3 term; GRPO, critic-free),
entropy, active gradient clipping, tied embeddings, and uneven micro-batch shares (3 + 1 rows, and
3 micro-batches on 2 ranks: one rank pads with a zero-weight micro-step), the critic-free
algorithms (GRPO, RLOO, REINFORCE++), LoRA (the frozen base and the adapters sharded together) and
gradient checkpointing (each layer's forward is seen to run again in backward). Each rank computes
its share of the old log-probs (one rank has none and pads); merged, they are the single learner's.
bf16 (FSDP2 mixed precision: bf16 compute, fp32 masters, fp32 gradient reduction) matches one
learner's bf16 autocast within looser bounds (``BF16_*``, with what was measured).

One spawn (2 processes) runs every case; each rank also runs the single learner (tiny models).
"""

from __future__ import annotations

import dataclasses
import math
import random
import socket

import pytest
import torch

from oppo.algo import get_algorithm
from oppo.config import PPOConfig
from oppo.algo.stage import AdvantageSettings, compute_advantages
from oppo.learner.batch import (OldLogprobSettings, attach_scores, build_experience, old_logprob_targets,
                                set_old_logprobs)
from oppo.models import backbone_and_head, load_tokenizer
from oppo.learner.group import LearnerSpec, learner_state
from oppo.api.specs import ModelSpec
from oppo.rollout.eager.backend import Rollout
from oppo.api.records import ScoredOutputs
from oppo.scoring.streaming import score_full
from oppo.api.records import Scores
from validated import load_valid

BASE = PPOConfig(batch_size=8, minibatch_size=4, micro_batch_size=3, epochs=2, actor_lr=1e-3, critic_lr=1e-3,
                 weight_decay=0.01, entropy_coef=0.01, max_grad_norm=0.05)  # clipping active (norms ~0.3-1)


@dataclasses.dataclass(frozen=True)
class Case:
    """One learner setting the sharded ranks must train as one learner does."""

    name: str
    ppo: dict
    algo: tuple[str, dict]  # get_algorithm's (name, settings); critic-free ones have no critic
    tied: bool = False  # the actor's output head tied to its input embedding
    lora: bool = False  # peft adapters on the actor (frozen base, sharded with them)
    checkpointing: bool = False  # policy.gradient_checkpointing (actor and critic)
    dtype: torch.dtype = torch.float32  # bfloat16: FSDP2 mixed precision (bf16 compute, fp32 masters)
    checkpoints: bool = False  # also: DCP checkpoints across rank counts (``_checkpoints``)


CASES = [  # every loss aggregation; KL in the loss; critic-free; LoRA; gradient checkpointing; bf16
    Case("token_mean, ppo with k3 KL in the loss, minibatch 4 = micro 3 + 1",
         dict(loss_agg="token_mean"), ("ppo", dict(kl_placement="loss", kl_estimator="k3", kl_coef=0.1)),
         checkpoints=True),
    Case("seq_mean_token_mean, 3 micro-batches on 2 ranks (a zero-weight pad)",
         dict(loss_agg="seq_mean_token_mean", minibatch_size=8, epochs=1), ("ppo", {})),
    Case("seq_mean_token_sum, grpo (critic-free, KL in the loss), tied embeddings",
         dict(loss_agg="seq_mean_token_sum"), ("grpo", dict(group_size=2)), tied=True),
    Case("LoRA and gradient checkpointing (actor and critic), ppo, 3 micro-batches on 2 ranks (a pad)",
         dict(loss_agg="token_mean", minibatch_size=8, epochs=1), ("ppo", {}), lora=True, checkpointing=True,
         checkpoints=True),
    Case("rloo (critic-free), gradient checkpointing, tied embeddings",
         dict(loss_agg="token_mean"), ("rloo", dict(group_size=2)), tied=True, checkpointing=True),
    Case("reinforce++ (critic-free), LoRA", dict(loss_agg="token_mean"), ("reinforce_pp", {}), lora=True),
    Case("bf16 compute over fp32 masters, ppo", dict(loss_agg="token_mean"), ("ppo", {}), dtype=torch.bfloat16),
    Case("bf16, LoRA (bf16 frozen base, fp32 adapters), grpo, 3 micro-batches on 2 ranks (a pad)",
         dict(loss_agg="token_mean", minibatch_size=8, epochs=1), ("grpo", dict(group_size=2)), lora=True,
         dtype=torch.bfloat16),
]
# bf16: FSDP2 mixed precision (bf16 parameters per module) against one learner's autocast (bf16 per
# op over fp32 weights) round differently. Bounds, and what the bf16 cases below measured (torch
# 2.13, CPU): old log-probs |diff| <= 5e-3 (3.4e-4); per-step statistics within 10% (losses and
# gradient norms 0.6%, the sampler-mismatch max 4%); each model's update (after - before) within 5%
# of its size (actor 1.9%, critic 2.4%; with LoRA the adapters' < 0.01%: the norms and embedding
# are frozen bf16 in both, so the two compute the same bf16 ops).
BF16_LOGPROB_ATOL, BF16_STATS_RTOL, BF16_UPDATE_RTOL = 5e-3, 0.1, 0.05


def _experience(actor, critic, pad: int, cfg: PPOConfig, algo, seed: int):
    rng = random.Random(seed)
    rollouts = []
    for i in range(cfg.batch_size):
        resp = [rng.randrange(3, 30) for _ in range(rng.randint(1, 12))]
        ended = rng.random() < 0.6
        if ended:
            resp[-1] = 1
        rollouts.append(Rollout(i, i // 2, "", [rng.randrange(3, 30) for _ in range(rng.randint(2, 6))], 0,
                                response_ids=resp, logprobs=[0.0] * len(resp), versions=[0] * len(resp),
                                finished=True, ended_with_eos=ended, group=2 * (i // 2)))
    prompts, responses = [r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts]
    with torch.no_grad():
        old = score_full("reference", actor, prompts, responses, pad, 0.9)
        values = score_full("critic", critic, prompts, responses, pad) if critic is not None else None
    for r, o in zip(rollouts, old):
        r.logprobs = o.logprobs
    exp = build_experience(rollouts, pad, torch.device("cpu"))
    ref = [ScoredOutputs(logprobs=[x - 0.05 * rng.random() for x in o.logprobs]) for o in old]
    return compute_advantages(attach_scores(exp, Scores([rng.gauss(0, 1) for _ in rollouts], ref, values)),
                              AdvantageSettings.of(cfg), algo)


def _close(got: dict, want: dict, what: str, atol: float):
    assert got.keys() == want.keys(), what
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=atol, rtol=atol, msg=f"{what}.{k}")


def _compare(got: dict, want: dict, before: dict, bf16: bool = False) -> None:
    """fp32: every weight and AdamW moment within 1e-5. bf16 (the sharded ranks all-gather and
    compute with bf16 parameters, the single learner autocasts its fp32 ones op by op: roundings
    differ): each model's update (after - before) within ``BF16_UPDATE_RTOL`` of the single
    learner's, relative to its size (norms over all weights)."""
    for part in ("actor", "critic"):
        if part not in want:
            continue
        gap = max((want[part][k] - before[part][k]).abs().max().item() for k in want[part])
        assert gap > 1e-3, f"{part} barely moved ({gap}): the comparison would be vacuous"
        opt = f"{part}_opt"
        assert got[opt]["param_groups"] == want[opt]["param_groups"]
        assert got[opt]["state"].keys() == want[opt]["state"].keys()
        if bf16:
            assert got[part].keys() == want[part].keys()
            err = sum(((got[part][k] - want[part][k]).float() ** 2).sum() for k in want[part]) ** 0.5
            size = sum(((want[part][k] - before[part][k]).float() ** 2).sum() for k in want[part]) ** 0.5
            assert err <= BF16_UPDATE_RTOL * size, f"{part}: update differs by {float(err / size):.4f} of its size"
            continue
        _close(got[part], want[part], part, 1e-5)
        for i, st in want[opt]["state"].items():
            _close(got[opt]["state"][i], st, f"{opt}[{i}]", 1e-5)


def _rank_main(rank: int, world: int, port: int, paths: dict) -> None:
    import torch.distributed as dist

    from oppo.learner.fsdp import build_sharded, fsdp_old_logprobs, fsdp_update, full_model_state, \
        full_optim_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    pad = load_tokenizer(paths["policy"]).pad_token_id
    for i, case in enumerate(CASES):
        cfg = dataclasses.replace(BASE, **case.ppo)
        algo = get_algorithm(case.algo[0], **case.algo[1])
        bf16 = case.dtype == torch.bfloat16
        critic = ModelSpec("critic", paths["reward"], pad_id=pad, device="cpu") if algo.needs_critic else None
        actor = ModelSpec("policy", paths["tied" if case.tied else "policy"], case.dtype if case.lora else
                          torch.float32, device="cpu")  # as learner_spec: LoRA's frozen base in the compute dtype
        spec = LearnerSpec(actor=actor, critic=critic, ppo=cfg, temperature=0.9, seed=3, algorithm=algo,
                           compute_dtype=case.dtype, lora=(4, 8.0, 0.0, []) if case.lora else None,
                           gradient_checkpointing=case.checkpointing)
        single, sharded = spec.build(), build_sharded(spec)
        before = learner_state(single)
        # old log-probs: one off-policy row, recomputed by rank 0 alone (rank 1 pads its forward)
        exp = _experience(single.actor, single.critic, pad, cfg, algo, seed=10)
        exp.versions[3] -= 1
        want = dataclasses.replace(exp)
        want = single.old_logprobs(want, 0)
        rows, new = fsdp_old_logprobs(sharded, exp, 0, rank, world)
        shares: list = [None] * world
        dist.all_gather_object(shares, (rows, new))
        redo, off = old_logprob_targets(exp, 0, False)
        set_old_logprobs(exp, torch.cat([s[0] for s in shares]), torch.cat([s[1] for s in shares]), redo, off,
                         OldLogprobSettings.of(cfg))
        tol = dict(atol=BF16_LOGPROB_ATOL, rtol=0) if bf16 else dict(atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(exp.old_logprobs, want.old_logprobs, **tol)
        torch.testing.assert_close(exp.is_weights, want.is_weights, **tol)
        # three updates on fresh batches; watched: what the first layer and the head of the actor receive
        layer = next(m for m in sharded.actor.modules() if type(m).__name__.endswith("DecoderLayer"))
        _, head = backbone_and_head(sharded.actor)
        seen: dict[str, list] = {"layer": [], "head": []}
        hooks = [m.register_forward_pre_hook(lambda m, args, key=key: seen[key].append(args[0].dtype))
                 for key, m in (("layer", layer), ("head", head))]
        for step in range(3):
            exp = _experience(single.actor, single.critic, pad, cfg, algo, seed=step)
            want_stats = single.update(exp, step)
            stats = fsdp_update(sharded, exp, step, rank, world)
            assert want_stats["grad_norm/actor"] > cfg.max_grad_norm, "clipping must be active"
            for k, v in want_stats.items():
                tol = (dict(abs=0.05) if k.endswith("clipfrac") else dict(rel=BF16_STATS_RTOL, abs=1e-3) if bf16
                       else dict(rel=1e-4, abs=1e-6))
                assert stats[k] == pytest.approx(v, **tol), f"{case.name}: {k}"
        for h in hooks:
            h.remove()
        # gradient checkpointing recomputes each layer's forward in backward (the head is not checkpointed)
        assert len(seen["layer"]) == (2 if case.checkpointing else 1) * len(seen["head"]) > 0, case.name
        # bf16: the layers compute in bf16 (FSDP2's MixedPrecisionPolicy casts their parameters and inputs)
        assert set(seen["layer"]) == {case.dtype}, case.name
        got = {"actor": full_model_state(sharded.actor),
               "actor_opt": full_optim_state(sharded.actor, sharded.actor_opt)}
        if sharded.critic is not None:
            got.update(critic=full_model_state(sharded.critic),
                       critic_opt=full_optim_state(sharded.critic, sharded.critic_opt))
        if rank == 0:
            _compare(got, learner_state(single), before, bf16)
        dist.barrier()
        if case.checkpoints:
            _checkpoints(rank, spec, single, sharded, before, f"{paths['ckpt']}/case{i}")
    dist.destroy_process_group()


def _models(learner) -> dict:
    return {"actor": (learner.actor, learner.actor_opt), "critic": (learner.critic, learner.critic_opt)}


def _checkpoints(rank: int, spec, single, sharded, before: dict, root: str) -> None:
    """DCP: 2 ranks' shards resume in one learner (no process group); one learner's DCP checkpoint
    resumes on 2 sharded ranks (resharded); both equal the trained state."""
    import torch.distributed as dist

    from oppo.learner.fsdp import build_sharded, full_model_state, full_optim_state
    from oppo.learner.sharded import load_sharded, save_sharded

    save_sharded(f"{root}/two", _models(sharded))  # each rank writes its shards
    want = learner_state(single)
    if rank == 0:
        local = spec.build()
        local.load_checkpoint_state({"sharded": f"{root}/two"})  # the local Learner's own resume path
        _compare(learner_state(local), want, before)
        save_sharded(f"{root}/one", _models(single), no_dist=True)
    dist.barrier()
    fresh = build_sharded(spec)
    load_sharded(f"{root}/one", _models(fresh))
    got = {"actor": full_model_state(fresh.actor), "actor_opt": full_optim_state(fresh.actor, fresh.actor_opt),
           "critic": full_model_state(fresh.critic), "critic_opt": full_optim_state(fresh.critic, fresh.critic_opt)}
    if rank == 0:
        _compare(got, want, before)
    dist.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fsdp_models(tiny_models, tmp_path_factory):
    """The tiny models, plus a policy whose output head is tied to its input embedding."""
    from transformers import LlamaForCausalLM

    tied = tmp_path_factory.mktemp("tied") / "policy"
    model = LlamaForCausalLM.from_pretrained(tiny_models["policy"])
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(tied)
    load_tokenizer(str(tiny_models["policy"])).save_pretrained(tied)
    return {"policy": str(tiny_models["policy"]), "reward": str(tiny_models["reward"]), "tied": str(tied)}


def test_fsdp2_ranks_train_like_one_learner_and_resume_across_rank_counts(fsdp_models, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(2, _free_port(), {**fsdp_models, "ckpt": str(tmp_path)}), nprocs=2, join=True)
    for i, case in enumerate(CASES):
        if case.checkpoints:  # they ran
            for name in ("two", "one"):
                assert (tmp_path / f"case{i}" / name / ".metadata").is_file()
            assert len(list((tmp_path / f"case{i}" / "two").glob("*.distcp"))) == 2, "one file of shards per rank"


@pytest.mark.parametrize("overrides, expected", [
    (["placement.learner=fsdp2"], r"placement.learner=fsdp2 runs on Ray ranks, not under placement.name=local: "
                                  r"set placement.name=ray"),
    (["placement.name=ray", "placement.learner=fsdp2", "learner.fsdp2.ranks=3",
      "ppo.batch_size=8", "ppo.minibatch_size=4", "ppo.micro_batch_size=2"],
     r"learner.fsdp2.ranks=3 sharded ranks, but a minibatch has only 2 micro-batches"),
])
def test_fsdp2_bad_settings_are_refused_before_any_model_loads(overrides, expected):
    from oppo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=expected):
        load_valid(None, overrides)  # validation: the models are loaded only later, by setup.build_roles


def test_fsdp2_takes_lora_checkpointing_bf16_critic_free_and_every_overlap_mode():
    from oppo.config import MODES, load_config

    for mode in MODES:
        load_config(None, ["placement.name=ray", "placement.learner=fsdp2", "learner.fsdp2.ranks=2",
                           "ppo.micro_batch_size=8", "lora.r=4", "policy.gradient_checkpointing=true",
                           "policy.dtype=bfloat16", "algo.name=rloo", f"overlap.mode={mode}"])


@pytest.mark.slow
@pytest.mark.ray
def test_trainer_with_fsdp2_on_ray_matches_sequential_and_its_sharded_checkpoint_resumes_locally(
        ray_local, tiny_models, tiny_prompts, tmp_path):
    """placement.learner=fsdp2 with 2 Ray ranks: the Trainer builds the sharded group, trains the
    local sequential run's steps in ``overlap.mode=oppo`` with Delta = 0 (the overlapped loop, chunks
    streamed to the Ray scorer: the invariant every mode keeps), writes a DCP checkpoint (atomically,
    with the HF export), and a local Trainer resumes from it and trains the next step as the
    uninterrupted run."""
    pytest.importorskip("ray")
    from oppo.checkpoint import load_checkpoint, save_checkpoint
    from oppo.config import load_config
    from oppo.trainer import Trainer

    def cfg(out, *extra):
        return load_config(None, [
            f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
            f"data.prompts={tiny_prompts}", "placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=2",
            "ppo.micro_batch_size=1", "generation.max_new_tokens=12", "overlap.mode=sequential",
            f"run.out_dir={out}", "log.progress=false", *extra])

    steps = 2
    seq = Trainer.from_config(cfg(tmp_path / "s"), progress=False)
    try:
        want = [seq.run_step() for _ in range(steps + 1)]
    finally:
        seq.close()
    # One Ray run (a run's Ray start costs about a minute of this 2-core box): the overlapped loop with
    # Delta = 0, which must reproduce the sequential steps; the learner's update is the same in every mode.
    t = Trainer.from_config(cfg(tmp_path / "r", "placement.name=ray", "placement.learner=fsdp2",
                    "learner.fsdp2.ranks=2", "learner.fsdp2.cpus=0.5", "placement.ray.scorer_cpus=0.5",
                    "overlap.mode=oppo", "overlap.delta=0", "overlap.chunk_size=4"), progress=False)
    try:
        assert type(t.roles.learner).__name__ == "LearnerGroup" and t.roles.learner.strategy.sharded
        got = [t.run_step() for _ in range(steps)]
        mem = t.roles.learner.memory()
        ckpt = save_checkpoint(t, tmp_path / "r")
    finally:
        t.close()
    for x, y in zip(want, got):
        for k in ("reward/mean", "loss/value", "kl/mean", "loss/policy", "grad_norm/actor"):
            assert y[k] == pytest.approx(x[k], abs=1e-4, rel=1e-3), k
    assert abs(mem[0]["params"] - mem[1]["params"]) <= 0.1 * mem[0]["params"], "each rank holds half"
    assert (ckpt / "learner" / ".metadata").is_file() and (ckpt / "policy" / "config.json").is_file()
    local = Trainer.from_config(cfg(tmp_path / "r", "overlap.mode=oppo", "overlap.delta=0", "overlap.chunk_size=4"),
                    progress=False)  # (a checkpoint resumes under its scheduler's settings)
    try:
        load_checkpoint(local, ckpt)
        y = local.run_step()
    finally:
        local.close()
    for k in ("reward/mean", "loss/value", "kl/mean", "loss/policy"):
        assert y[k] == pytest.approx(want[steps][k], abs=1e-4, rel=1e-3), k


@pytest.mark.slow
@pytest.mark.ray
def test_fsdp2_on_ray_trains_lora_with_checkpointing_critic_free_in_pipeline_mode(ray_local, tiny_models,
                                                                                   tiny_prompts, tmp_path):
    """overlap.mode=pipeline with 2 sharded Ray ranks, LoRA adapters, gradient checkpointing and RLOO
    (no critic anywhere): two steps train while the engine goes on decoding (PipelineRL); rank 0's
    adapters reach the rollout model at each step's end; no token is older than max_lag + 1
    versions; each rank holds about half of the trained state. Its sharded checkpoint resumes in a
    local LoRA learner with rank 0's adapters."""
    from oppo.checkpoint import load_checkpoint, save_checkpoint
    from oppo.config import load_config
    from oppo.trainer import Trainer

    def cfg(*extra):
        return load_config(None, [
            f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
            f"data.prompts={tiny_prompts}", "placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=4",
            "ppo.micro_batch_size=2", "generation.max_new_tokens=24", "overlap.chunk_size=4", f"run.out_dir={tmp_path}",
            "log.progress=false", "run.steps=2", "algo.name=rloo", "algo.group_size=2", "lora.r=4", "lora.alpha=8",
            "policy.gradient_checkpointing=true", *extra])

    pipeline = ("overlap.mode=pipeline", "overlap.delta=1", "overlap.refill=true", "overlap.max_lag=1")
    t = Trainer.from_config(cfg(*pipeline, "placement.name=ray", "placement.learner=fsdp2",
                    "learner.fsdp2.ranks=2", "learner.fsdp2.cpus=0.5", "placement.ray.scorer_cpus=0.5"),
                progress=False)
    try:
        assert type(t.roles.learner).__name__ == "LearnerGroup" and t.roles.learner.strategy.sharded and t.roles.critic is None
        inflight = 0
        for step in range(2):
            m = t.run_step()
            assert math.isfinite(m["loss/policy"]) and m["grad_norm/actor"] > 0 and m["time/weight_sync"] > 0
            inflight += m["pipeline/inflight_tokens"]
            for r in t.last_result.exp.rollouts:
                assert all(step - 2 <= v <= step for v in r.versions), (step, r.versions)
        rank0 = t.roles.learner.actor_state()
        adapters = {n: p for n, p in t.roles.rollout_policy.named_parameters() if "lora_" in n}
        assert adapters and all(torch.equal(p, rank0[n]) for n, p in adapters.items()), "rank 0's adapters, synced"
        assert any(p.abs().max() > 0 for n, p in adapters.items() if "lora_B" in n), "the adapters trained"
        mem = t.roles.learner.memory()
        ckpt = save_checkpoint(t, tmp_path)  # (run.steps=2: no third step was begun)
    finally:
        t.close()
    assert inflight > 0, "decoding went on while the learner trained"
    assert abs(mem[0]["params"] - mem[1]["params"]) <= 0.1 * mem[0]["params"], "each rank holds half"
    local = Trainer.from_config(cfg(*pipeline), progress=False)  # (a checkpoint resumes under its scheduler's settings)
    try:
        load_checkpoint(local, ckpt)
        mine = dict(local.roles.policy.named_parameters())
        assert all(torch.equal(mine[n], rank0[n]) for n in adapters), "the checkpoint's adapters are rank 0's"
    finally:
        local.close()
