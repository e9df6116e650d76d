"""At learning rate 0 nothing moves, in every mode, with both of oppo's rollout backends, in
float32 and under bf16 mixed precision (docs/implementation-details.md, "Non-finite numbers";
issue 26).

With ``ppo.actor_lr=0 ppo.critic_lr=0`` an update leaves every weight of the learner's actor and
critic bit-identical: AdamW's step is ``lr * (m / (sqrt(v) + eps))`` and its decoupled decay
``lr * wd * w``, both zero, unless a gradient or moment is non-finite, when 0 x NaN writes NaN
into the weight. And after every weight sync the models that serve hold exactly the learner's
weights: the engine's model is the trained module itself in float32, a separate copy with
in-flight updates (``pipeline``), the master cast to bf16 under mixed precision; likewise the
critic the scorers read.

On an H100 every overlapped mode at 1B wrote NaN into the policy after its third update at
learning rate 0 (NaN gradients, then AdamW, then the sync carried them to the engine). These
tests hold the invariant on CPU over three steps with carried rows (and, in ``pipeline``, rows
decoding when the new weights load).
"""

from __future__ import annotations

import threading

import pytest
import torch

from oppo.config import load_config
from oppo.trainer import Trainer

STEPS = 3
BASE = ["placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=2", "ppo.micro_batch_size=2",
        "generation.max_new_tokens=16", "overlap.chunk_size=4", "log.progress=false",
        "ppo.actor_lr=0", "ppo.critic_lr=0", "ppo.weight_decay=0.1",  # the decay is lr * wd * w: 0 too
        "overlap.delta=2", "overlap.max_lag=1"]
CARRIES = ("inter", "oppo", "pipeline")
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float64: torch.int64}


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name (a tied weight under each of its names)."""
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return {n: t.detach() for n, t in out.items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Compare bits, not values: -0.0 is not 0.0, and a NaN equals its own bits."""
    return t.reshape(-1).view(BITS.get(t.dtype, t.dtype))


def assert_unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor], what: str) -> None:
    now = weights(model)
    assert now.keys() == before.keys(), what
    moved = [f"{n}: {int((t != before[n]).sum())}/{t.numel()} elements changed, max |d| "
             f"{float((t.float() - before[n].float()).abs().max()):.3g}, {int((~torch.isfinite(t)).sum())} non-finite"
             for n, t in now.items() if t.dtype != before[n].dtype or not torch.equal(_bits(t), _bits(before[n]))]
    assert not moved, f"{what} moved at learning rate 0:\n" + "\n".join(moved[:10])


def assert_serves(served: torch.nn.Module, master: torch.nn.Module, what: str) -> None:
    """``served`` holds ``master``'s weights cast to its own dtype, bit for bit, under the same names."""
    mine, theirs = weights(served), weights(master)
    assert mine.keys() == theirs.keys(), f"{what}: other weight names"
    wrong = [f"{n}: {int((mine[n] != t.to(mine[n].dtype)).sum())}/{t.numel()} elements differ"
             for n, t in theirs.items() if not torch.equal(_bits(mine[n]), _bits(t.to(mine[n].dtype)))]
    assert not wrong, f"{what} does not serve the trained weights:\n" + "\n".join(wrong[:10])


@torch.no_grad()
def spoil(model: torch.nn.Module) -> None:
    """Zero a serving copy, so that only the sync can make it equal the (unchanged) master again."""
    for t in weights(model).values():
        t.zero_()


def run_lr0(tiny_models, tiny_prompts, out, mode: str, engine: str, dtype: str, *extra: str) -> list[dict]:
    """Three steps at learning rate 0, checking the learner's weights after each step and the
    serving models after each sync; returns the steps' metrics."""
    cfg = load_config(None, [f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
                             f"data.prompts={tiny_prompts}", f"run.out_dir={out}", *BASE, f"overlap.mode={mode}",
                             f"generation.backend={engine}", f"policy.dtype={dtype}", *extra])
    t = Trainer.from_config(cfg, progress=False)
    try:
        roles = t.roles
        actor, critic, served = roles.learner.actor, roles.learner.critic, roles.rollout.model
        assert served is roles.rollout_policy
        assert next(actor.parameters()).dtype == next(critic.parameters()).dtype == torch.float32, "fp32 masters"
        assert next(served.parameters()).dtype == roles.compute_dtype
        separate = dtype == "bfloat16" or mode == "pipeline"
        assert (served is not actor) == separate, "a copy serves under bf16 or in-flight updates, else the master"
        a0, c0 = ({n: t.clone() for n, t in weights(m).items()} for m in (actor, critic))
        assert_serves(served, actor, "the rollout backend's model at the start")
        assert_serves(roles.scoring_critic, critic, "the critic's scorer copy at the start")
        synced = []

        def check(version: int) -> None:  # the last step of every weight sync
            assert_serves(served, actor, f"the rollout backend's model after sync {version}")
            assert_serves(roles.scoring_critic, critic, f"the critic's scorer copy after sync {version}")
            synced.append(version)

        copies_critic = roles.scoring_critic is not critic and roles.placement.critic_trains_on == "learner"

        def spoil_copies(version: int) -> None:  # the first step of every weight sync
            if separate:
                spoil(served)  # (between two decode steps: the engine is not reading it)
            if copies_critic:  # (else the critic's trainer refreshes its copy as it trains)
                roles.scorer.barrier()  # no chunk is being scored with it
                spoil(roles.scoring_critic)

        roles.sync.steps.insert(0, spoil_copies)
        roles.sync.steps.append(check)
        if mode == "pipeline":
            load_mid_decode(t)
        metrics = []
        for step in range(STEPS):
            m = t.run_step()
            metrics.append(m)
            assert synced[-1:] == [step + 1], "a weight sync after every update"
            assert_unchanged(actor, a0, f"{mode}/{engine}/{dtype}: the actor after step {step}")
            assert_unchanged(critic, c0, f"{mode}/{engine}/{dtype}: the critic after step {step}")
            for k in ("grad_norm/actor", "grad_norm/critic", "loss/policy", "loss/value"):
                assert m[k] == m[k] and abs(m[k]) != float("inf"), f"step {step}: {k} = {m[k]}"
        return metrics
    finally:
        t.close()


def load_mid_decode(t: Trainer, decode_steps: int = 2) -> None:
    """Pipeline: each update's weights load once the engine has decoded ``decode_steps`` steps
    beside it, not sooner and not much later, so that rows are in flight at every load (left to
    timing, the tiny models' rows all end during the first update, and none decode during a
    quick one)."""
    rollout, learner = t.roles.rollout, t.roles.learner
    advance, update = rollout.advance, learner.update
    training, decoded, trained = threading.Event(), threading.Event(), threading.Event()
    count = [0]

    def counting_advance(chunk):  # the controller's thread
        if training.is_set():
            count[0] += 1
            if count[0] >= decode_steps:
                decoded.set()
                trained.wait(timeout=30)  # the update ends before the next decode step
        return advance(chunk)

    def gated_update(exp, step, **kw):  # the learner's thread
        count[0] = 0
        decoded.clear()
        trained.clear()
        training.set()
        try:
            out = update(exp, step, **kw)
            while not decoded.wait(0.01) and rollout.active:  # (the rows all ended: rows_at_load says so)
                pass
            return out
        finally:
            training.clear()
            trained.set()

    rollout.advance, learner.update = counting_advance, gated_update


def assert_not_vacuous(mode: str, metrics: list[dict]) -> None:
    """Rows were carried into a later step and trained there (stale tokens); in ``pipeline``,
    rows were decoding at every load."""
    if mode in CARRIES:
        assert any(m["overlap/carried"] > 0 for m in metrics[:-1]), "rows carried into a later step"
        assert any(m["overlap/offpolicy_token_frac"] > 0 for m in metrics), "stale tokens trained"
    if mode == "pipeline":
        assert all(m["pipeline/rows_at_load"] > 0 for m in metrics), "rows decoding at every load"


MODES = ("sequential", "intra", "inter", "oppo", "pipeline")
# Every mode in both dtypes, the engine alternating so that each mode runs on both engines and each
# engine in both dtypes: every pair of (mode, engine, dtype) values once, in half the runs of all
# twenty combinations.
CASES = [(mode, ("eager", "static")[(i + j) % 2], dtype)
         for i, mode in enumerate(MODES) for j, dtype in enumerate(("float32", "bfloat16"))]


@pytest.mark.parametrize("mode, engine, dtype", CASES, ids=["-".join(c) for c in CASES])
def test_lr0_leaves_every_weight_and_serves_it(tiny_models, tiny_prompts, tmp_path, mode, engine, dtype):
    """The scorer of the streaming modes: a child process in oppo and pipeline in float32 (the CPU
    default: the child trains the critic in shared memory), a thread otherwise (the GPU's; a bf16
    run's default): both transports, without a ~3 s process start in every case."""
    process = "true" if mode in ("oppo", "pipeline") and dtype == "float32" else "false"
    metrics = run_lr0(tiny_models, tiny_prompts, tmp_path, mode, engine, dtype, f"placement.local.scorer_process={process}")
    assert_not_vacuous(mode, metrics)
