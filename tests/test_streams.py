"""Actor, learner and scorers each on a stream of their own, hand-offs ordered by events (issue 50).

On the CPU a role's stream is a stand-in (``oppo.kernels.streams``) that orders nothing but logs each
entry, event record and wait while ``recording`` is open: these tests drive a real trainer's step
through it and check, from the log, that every model forward runs inside its role (never on the
default stream) and that the weights pass from the learner to the actor's decode only through an
event. Whether the streams then overlap on a GPU is for a GPU to show (``docs/gpu-shapes.md``).
"""

from __future__ import annotations

import torch

from oppo.kernels import streams
from oppo.config import load_config
from oppo.trainer import Trainer


def _cfg(tiny_models, tiny_prompts, tmp_path, *extra):
    return load_config(None, [
        f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
        f"data.prompts={tiny_prompts}", "placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=2",
        "ppo.micro_batch_size=2", "generation.max_new_tokens=8", "overlap.chunk_size=4",
        f"run.out_dir={tmp_path}", "log.progress=false", *extra])


def _where(modules: dict[str, torch.nn.Module]) -> tuple[list[tuple[str, str]], list]:
    """Log (module, the role its forward ran in) for every forward of ``modules``."""
    from oppo.models import backbone_and_head

    seen: list[tuple[str, str]] = []

    def hook(name):
        return lambda module, args: seen.append((name, streams.current()))

    # (oppo calls a model's backbone and head, not the model)
    return seen, [backbone_and_head(m)[0].register_forward_pre_hook(hook(n)) for n, m in modules.items()]


def test_a_step_runs_every_role_on_its_stream_and_syncs_weights_by_events(tiny_models, tiny_prompts, tmp_path):
    """intra, scorers on a thread: the policy's forwards run in the actor's role (decode) or the
    learner's (its update), the scorer models' in the scorer thread's; the first decode step after
    an update waits on the event the learner recorded at its end, and the learner's next update
    waits for the actor's work on the weights they share (fp32: the engine samples the trained module)."""
    t = Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path, "overlap.mode=intra",
                     "placement.local.scorer_process=false"), progress=False)
    try:
        scorers = {f"scorer_{role}": s.model for role, s in t.roles.scorer.scorers.items()}
        seen, hooks = _where({"policy": t.roles.policy, **scorers})
        with streams.recording() as log:
            t.run_step()
            t.run_step()
        for h in hooks:
            h.remove()
    finally:
        t.close()
    roles = {}
    for name, role in seen:
        roles.setdefault(name, set()).add(role)
    assert roles["policy"] == {"actor", "learner"}, roles
    for name in scorers:
        assert roles[name] == {"scorer:scorer"}, (name, roles)
    assert "default" not in {r for rs in roles.values() for r in rs}
    # the learner's end-of-update event: recorded by the learner, then waited on by the actor
    # before its next decode forward, and the learner's second update waits on the actor
    kinds = [(k, who, getattr(ev, "role", None)) for k, who, ev in log]
    updates = [i for i, (k, who, _) in enumerate(kinds) if k == "enter" and who == "learner"]
    assert len(updates) >= 2
    wrote = [i for i, (k, who, ev) in enumerate(log) if k == "record" and who == "learner"]
    waits = [(i, ev) for i, (k, who, ev) in enumerate(log) if k == "wait" and who == "actor" and ev.role == "learner"]
    assert waits, "the actor waits on the learner's event"
    assert all(any(ev is log[j][2] for j in wrote if j < i) for i, ev in waits), "on an event the learner recorded"
    assert any(k == "wait" and who == "learner" and ev.role == "actor" for k, who, ev in log), \
        "the learner waits for the actor's reads of the weights they share"


def test_weights_pass_between_roles_only_through_events():
    """The stand-in's log of one weight hand-off: the learner's write waits for the actor's reads,
    the actor's next read waits on the learner's end-of-write event, once per write."""
    actor, learner = streams.role("actor", "cpu", follow=False), streams.role("learner", "cpu")
    w = torch.nn.Linear(2, 2)
    with streams.recording() as log:
        with actor:
            actor.read(w)  # (nothing written yet: no wait)
        with learner:
            learner.write(w)
            learner.wrote(w)
        with actor:
            actor.read(w)
            actor.read(w)  # (the same write: no second wait)
    waits = [(who, ev.role) for kind, who, ev in log if kind == "wait"]
    # (each role's first entry waits for its caller's queued work: the models' loading)
    assert waits == [("actor", "default"), ("learner", "default"), ("learner", "actor"), ("actor", "learner")], log
    recorded = [ev for kind, who, ev in log if kind == "record" and who == "learner"]
    assert [ev for kind, who, ev in log if kind == "wait" and who == "actor" and ev.role == "learner"] == recorded


def test_deferred_stop_checks_keep_intra_equal_to_sequential(tiny_models, tiny_prompts, tmp_path):
    """With the stop flags read every 4 steps (CUDA's road, forced here on the CPU), which steps
    retire rows depends on the engine's clock only, not on the chunks pulled for the scorers:
    intra and sequential still sample the same responses and scores."""
    out = {}
    for mode in ("sequential", "intra"):
        t = Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path / mode, f"overlap.mode={mode}",
                         "generation.max_new_tokens=24"), progress=False)
        try:
            engine = t.roles.rollout
            engine.stop_check_every = 4
            out[mode] = []
            for _ in range(1):
                t.run_step()
                exp = t.last_result.exp
                out[mode].append((exp.ids.clone(), exp.scores.clone(), [(len(r.response_ids), r.ended_with_eos)
                                                                        for r in exp.rollouts]))
            assert engine.host_reads < 0.75 * engine._clock  # (a check every step would read at least once a step)
        finally:
            t.close()
    for (ids_s, sc_s, _), (ids_i, sc_i, _) in zip(out["sequential"], out["intra"]):
        assert torch.equal(ids_s, ids_i)
        torch.testing.assert_close(sc_s, sc_i, atol=1e-5, rtol=1e-5)
    assert any(eos and n % 4 for _, _, rows in out["sequential"] for n, eos in rows), \
        "fixture: a row ends by EOS between two checks"
