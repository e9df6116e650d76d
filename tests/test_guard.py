"""The non-finite guard (issue 26; docs/implementation-details.md, "Non-finite numbers"): a
non-finite loss, advantage, gradient norm or updated weight stops the update before the optimizer
or the rollout backend, naming the step, the stage, the tensor and the first rows or parameters;
``ppo.nonfinite=skip`` skips and counts instead; the sampler names a diverged policy's rows."""

from __future__ import annotations

from types import SimpleNamespace

import dataclasses
import json
import math

import pytest
import torch

from oppo.config import PPOConfig
from oppo.guard import NonFiniteError, NonFiniteWarning
from oppo.algo.stage import AdvantageSettings, compute_advantages
from oppo.learner.batch import build_experience
from oppo.learner.local import UpdateSettings, train_minibatches
from oppo.api.records import Rollout


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(1, 3)).sum().backward()  # one real step first: AdamW has moments to keep intact
    opt.step()
    return model, opt


def _snapshot(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {p: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()} for p, st in opt.state.items()})


def _assert_same(model, opt, snap):
    weights, state = snap
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k  # bit-identical
    for p, st in opt.state.items():
        for k, v in st.items():
            assert torch.equal(v, state[p][k]) if torch.is_tensor(v) else v == state[p][k], k


def _micro(model, bad_minibatches=(0,), nan_loss_rows=()):
    """A micro-step: a finite loss; the gradient of ``1.weight`` NaN in the listed minibatches (by
    call order), or a NaN loss on micro-batches holding ``nan_loss_rows``."""
    calls = {"mb": -1}

    def step(rows, num_tokens, num_seqs):
        if rows[0] % 2 == 0:  # each minibatch below is [2k, 2k+1] in micro-batches of 1
            calls["mb"] += 1
        loss = model(torch.ones(len(rows), 3)).sum() / num_seqs
        loss.backward()
        if calls["mb"] in bad_minibatches:
            model[1].weight.grad[0, 1] = float("nan")
        value = float("nan") if set(rows) & set(nan_loss_rows) else loss.item()
        return {"loss/policy": value, "_frac": 0.5}

    return step


def _update(name: str, **kw) -> UpdateSettings:
    return UpdateSettings.of(_cfg(**kw), name)


def _cfg(**kw):
    # packing off: the bare batches below have no tokens to balance micro-batches by (runs of rows, in order)
    return dataclasses.replace(PPOConfig(), minibatch_size=2, micro_batch_size=1, packing="off", **kw)


MASK = torch.ones(4, 1)
MBS = [torch.tensor([0, 1]), torch.tensor([2, 3])]


def test_nan_gradient_stops_before_the_optimizer_step_naming_the_parameter():
    model, opt = _model_and_opt()
    snap = _snapshot(model, opt)
    with pytest.raises(NonFiniteError) as info:
        train_minibatches(model, opt, SimpleNamespace(mask=MASK), MBS, _update("actor"), "actor", _micro(model), step=7)
    msg = str(info.value)
    assert "non-finite gradient norm (nan) at step 7, actor update, optimizer step 1 of 2" in msg
    assert "parameters with non-finite gradients: 1.weight" in msg and "0.weight" not in msg
    assert "ppo.actor_lr" in msg and "ppo.nonfinite=skip" in msg
    _assert_same(model, opt, snap)


def test_skip_setting_skips_that_step_and_counts_it():
    model, opt = _model_and_opt()
    snap = _snapshot(model, opt)
    with pytest.warns(NonFiniteWarning, match="1.weight.*skipped"):
        out = train_minibatches(model, opt, SimpleNamespace(mask=MASK), MBS[:1], _update("critic", nonfinite="skip"), "critic",
                                _micro(model), step=7)
    assert out == {"guard/skipped/critic": 1}  # no loss or norm of a skipped step in the means
    _assert_same(model, opt, snap)
    # the bad minibatch is skipped, the good one steps: its loss and norm are the update's
    with pytest.warns(NonFiniteWarning):
        out = train_minibatches(model, opt, SimpleNamespace(mask=MASK), MBS, _update("critic", nonfinite="skip"), "critic",
                                _micro(model), step=8)
    assert out["guard/skipped/critic"] == 1 and math.isfinite(out["grad_norm/critic"]) and math.isfinite(out["loss/policy"])
    assert not torch.equal(model[1].weight, snap[0]["1.weight"])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nan_loss_names_its_rows():
    model, opt = _model_and_opt()
    snap = _snapshot(model, opt)
    with pytest.raises(NonFiniteError, match=r"non-finite loss at step 3, actor update, optimizer step 2 of 2: "
                                             r"rows 3 of the batch"):
        train_minibatches(model, opt, SimpleNamespace(mask=MASK), MBS, _update("actor"), "actor",
                          _micro(model, bad_minibatches=(), nan_loss_rows=(3,)), step=3)
    assert not torch.equal(model[1].weight, snap[0]["1.weight"])  # (the first minibatch stepped, finite)


def test_non_finite_updated_weights_stop_before_the_sync():
    model, opt = _model_and_opt()
    opt.param_groups[0]["lr"] = float("inf")  # finite gradients, an update that overflows every weight
    with pytest.raises(NonFiniteError, match=r"non-finite updated weights at step 2, actor update: 0.weight, 0.bias, "
                                             r"1.weight and 1 more; the run stopped before the weight sync"):
        train_minibatches(model, opt, SimpleNamespace(mask=MASK), MBS[:1], _update("actor", nonfinite="skip"), "actor",
                          _micro(model, bad_minibatches=()), step=2)


def _experience(scores):
    rows = []
    for i, s in enumerate(scores):
        r = Rollout(10 + i, i, "p", [5, 6], 0, response_ids=[7, 8, 1][: 2 + i % 2], group=10 + i)
        r.logprobs = r.policy_logprobs = [-1.0] * len(r.response_ids)
        r.versions, r.finished, r.ended_with_eos = [0] * len(r.response_ids), True, True
        rows.append(r)
    exp = build_experience(rows, 0, torch.device("cpu"))
    return dataclasses.replace(exp, ref_logprobs=exp.old_logprobs.clone(), values=torch.zeros_like(exp.mask),
                               scores=torch.tensor(scores))


def test_non_finite_advantages_name_the_cause_and_its_rows():
    from oppo.algo import get_algorithm

    exp = _experience([0.5, float("nan"), 1.0, float("inf")])
    with pytest.raises(NonFiniteError, match=r"non-finite scores at step 5, advantages: rows 1, 3 of 4 \(sequences "
                                             r"11, 13\).*check that the reward"):
        compute_advantages(exp, AdvantageSettings.of(PPOConfig()), get_algorithm("ppo"), step=5)
    with pytest.warns(NonFiniteWarning, match="non-finite scores"):
        out = compute_advantages(exp, AdvantageSettings.of(dataclasses.replace(PPOConfig(), nonfinite="skip")),
                                 get_algorithm("ppo"), 5)
    assert not out.trainable
    assert compute_advantages(_experience([0.5, 0.1, 1.0, 0.0]), AdvantageSettings.of(PPOConfig()),
                              get_algorithm("ppo")).trainable


@pytest.mark.parametrize("engine", ["eager", "static"])
def test_sampler_names_rows_of_a_diverged_policy(tiny_models, engine):
    """Not torch.multinomial's "probability tensor contains either inf, nan or element < 0" (on
    CUDA a device-side assert): the rows, their sequences and the likely cause."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oppo.rollout.static import StaticBackend
    from oppo.rollout.eager.backend import EagerBackend

    tok = AutoTokenizer.from_pretrained(tiny_models["policy"])
    model = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    with torch.no_grad():
        model.lm_head.weight[3] = float("inf")  # the logit of token 3: inf or NaN in every row
    kind, extra = (EagerBackend, {}) if engine == "eager" else (StaticBackend, {"max_rows": 2, "max_len": 16})
    eng = kind(model, tok.eos_token_id, tok.pad_token_id, max_new_tokens=4, seed=0, **extra)
    eng.set_version(4)
    eng.admit([Rollout(20 + i, i, "p", tok(p)["input_ids"], 4) for i, p in enumerate(["the film", "a day"])])
    with pytest.raises(NonFiniteError, match=r"non-finite logits in sampling with the policy of version 4 \(the "
                                             r"weights after step 3's update\): rows 0, 1 \(sequences 20, 21\).*"
                                             r"lower ppo.actor_lr"):
        eng.step()


def test_cli_diverging_run_stops_with_the_guards_message(tiny_models, tiny_prompts, tmp_path, capsys):
    """`oppo train` at a learning rate that diverges: one paragraph, exit 1, no traceback, no
    checkpoint. On the built-in task ppo.actor_lr=1e4 does it (NaN gradients at step 0's second
    optimizer step); the tests' tiny random models take 1e4 for 20 steps without a non-finite
    number, and 1e8 gives NaN gradients at step 1."""
    from oppo import cli

    args = ["train", f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
            f"data.prompts={tiny_prompts}", "ppo.batch_size=2", "ppo.minibatch_size=2", "ppo.micro_batch_size=1",
            "generation.max_new_tokens=4", "overlap.mode=sequential", "placement.threads=1", "log.progress=false",
            "log.trace=false", "run.samples=0", "run.steps=3", "ppo.actor_lr=1e8"]
    assert cli.main(args + [f"run.out_dir={tmp_path / 'a'}"]) == 1
    err = capsys.readouterr().err
    assert "oppo: error: non-finite gradient norm (nan) at step 1, actor update" in err, err
    assert "model.embed_tokens.weight" in err and "Traceback" not in err and "probability tensor" not in err
    assert not (tmp_path / "a" / "checkpoints").exists()
    # skipped instead: the run goes on with the weights of before, counting what it skipped
    with pytest.warns(NonFiniteWarning):
        assert cli.main(args + [f"run.out_dir={tmp_path / 'b'}", "ppo.nonfinite=skip"]) == 0
    ms = [json.loads(l) for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [m["guard/skipped_updates"] for m in ms] == [0, 1, 1]
    assert ms[-1]["guard/skipped_updates_total"] == 2 and "grad_norm/actor" not in ms[-1]


def test_nan_scores_stop_or_skip_the_whole_update(tiny_models, tiny_prompts, tmp_path, capsys, monkeypatch):
    """Through the CLI: a reward whose scores are NaN (a reward model or function gone wrong; patched
    in, as a model with NaN weights fails at load) stops the run naming the rows, or (skip) skips
    the actor's and the critic's steps of every update."""
    from oppo import cli
    from oppo.control import stages

    attach = stages.attach_scores

    def nan_scores(exp, scores):
        return attach(exp, dataclasses.replace(scores, scores=[float("nan")] * len(scores.scores)))

    monkeypatch.setattr(stages, "attach_scores", nan_scores)
    args = ["train", f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
            f"data.prompts={tiny_prompts}", "ppo.batch_size=2", "ppo.minibatch_size=2", "ppo.micro_batch_size=1",
            "generation.max_new_tokens=4", "overlap.mode=sequential", "placement.threads=1", "log.progress=false",
            "log.trace=false", "run.samples=0", "run.steps=2"]
    assert cli.main(args + [f"run.out_dir={tmp_path / 'a'}"]) == 1
    err = capsys.readouterr().err
    assert "oppo: error: non-finite scores at step 0, advantages: rows 0, 1 of 2" in err and "Traceback" not in err
    with pytest.warns(NonFiniteWarning, match="non-finite scores"):
        assert cli.main(args + [f"run.out_dir={tmp_path / 'b'}", "ppo.nonfinite=skip"]) == 0
    ms = [json.loads(l) for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [m["guard/skipped_updates"] for m in ms] == [2, 2]  # the actor's and the critic's optimizer step
    assert ms[-1]["guard/skipped_updates_total"] == 4 and "loss/policy" not in ms[-1]


def test_critic_on_the_scorer_process_stops_alike(tiny_models, tiny_prompts, tmp_path, capsys):
    """overlap.mode=oppo on CPU: the critic trains in the scorer's child process; its guard's error
    comes back whole (not as a string) and the CLI prints it the same way."""
    from oppo import cli

    args = ["train", f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
            f"data.prompts={tiny_prompts}", "ppo.batch_size=2", "ppo.minibatch_size=2", "ppo.micro_batch_size=1",
            "generation.max_new_tokens=4", "overlap.mode=oppo", "placement.threads=1", "log.progress=false",
            "log.trace=false", "run.samples=0", "run.steps=3", "ppo.critic_lr=1e8", f"run.out_dir={tmp_path / 'a'}"]
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "oppo: error: non-finite gradient norm (nan) at step 1, critic update" in err and "Traceback" not in err
