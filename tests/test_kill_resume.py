"""Sequences in flight at a checkpoint are saved with it and restored on resume, not drained.

- in-process: save -> load into a fresh Trainer restores every carried sequence with its partial
  response, per-token versions and log-probs and its scheduler ticket; the live run and the
  resumed one then train the same batches;
- the fallback: a rollout backend that cannot hand its rows out has them drained (requeued), and
  a checkpoint written before sequences were saved (drained, no ``in_flight.json``) still loads;
- ``kill -9``: ``oppo train`` on its built-in task in mode oppo, killed after a checkpoint that
  holds sequences in flight (its scorer child exits with it), resumed with ``--resume auto`` and
  run to its end: no prompt lost, none trained twice, and the carried sequences were restored
  (their uids trained after the resume, with tokens older than it), not regenerated.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

import clirun

from oppo.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from oppo.config import load_config
from oppo.trainer import Trainer

from conftest import builtin_cli
from test_child_exit import alive, descendants, wait_until

FIELDS = ("response_ids", "logprobs", "policy_logprobs", "versions", "finished", "ended_with_eos", "prompt_index",
          "start_version", "group", "prompt_ids")


def _settings(tiny_models, tiny_prompts, out, mode="oppo", steps=4):
    return [f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
            f"data.prompts={tiny_prompts}", "generation.max_new_tokens=16", f"run.steps={steps}",
            *_run_settings(out, mode)]


def _run_settings(out, mode="oppo"):
    """What a run is asked beside its models, prompts, length and steps."""
    return ["placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=2", "ppo.micro_batch_size=2",
            f"overlap.mode={mode}", "overlap.delta=2", "overlap.max_lag=2", "overlap.chunk_size=4", f"run.out_dir={out}",
            "log.progress=false", "run.samples=0"]


def _snapshot(trainer) -> dict[int, dict]:
    """The untrained sequences, a decoding one's progress as the rollout backend holds it."""
    return {u: {f: getattr(r, f) for f in FIELDS} for u, r in trainer.loop.untrained().items()}


def _carried(trainer, finished: bool = False):
    """Run steps until a running sequence with a partial response is in flight between steps
    (``finished``: and a finished one waits to be trained)."""
    for _ in range(12):
        trainer.run_step()
        rows = trainer.loop.untrained().values()  # (a decoding one's progress: the backend's record)
        if any(not r.finished and r.response_ids for r in rows) and (not finished or any(r.finished for r in rows)):
            return
    pytest.fail("no sequence was carried with a partial response (or finished and waiting): the test would "
                "prove nothing")


@pytest.mark.parametrize("mode,extra", [("oppo", ()), ("oppo", ("algo.name=grpo", "algo.group_size=2"))],
                         ids=["oppo", "oppo-grpo"])
def test_save_load_restores_carried_sequences(tiny_models, tiny_prompts, tmp_path, mode, extra):
    """(GRPO: a finished member of a carried group waits, scored, for its sibling: it is saved
    finished and scored again from its saved response on resume.)"""
    cfg = load_config(None, _settings(tiny_models, tiny_prompts, tmp_path / "run", mode, steps=16) + list(extra))
    live = Trainer.from_config(cfg, progress=False)
    try:
        _carried(live, finished=bool(extra))
        before = _snapshot(live)
        tickets = {u: live.loop.scheduler.ticket(u) for u in before}
        running = list(live.loop.scheduler.in_flight)
        ckpt = save_checkpoint(live, tmp_path / "run")
        saved = json.loads((ckpt / "in_flight.json").read_text())
        state = json.loads((ckpt / "state.json").read_text())
        assert state["in_flight"] == {"how": "saved", "count": len(before)} and not state["scheduler"]["requeue"]
        assert {d["uid"]: {f: d[f] for f in FIELDS} for d in saved} == before, "saved exactly as they stood"
        assert _snapshot(live) == before, "the live run goes on with the same sequences"
        assert [r.uid for r in live.roles.rollout.in_flight()] == running

        resumed = Trainer.from_config(cfg, progress=False)
        try:
            load_checkpoint(resumed, ckpt)
            assert resumed.step == live.step
            assert _snapshot(resumed) == before, "partial responses, versions and log-probs restored"
            assert {u: resumed.loop.scheduler.ticket(u) for u in before} == tickets
            assert list(resumed.loop.scheduler.in_flight) == running
            assert resumed.loop.scheduler.finished_pool == live.loop.scheduler.finished_pool
            assert [r.uid for r in resumed.roles.rollout.in_flight()] == running, "back in the engine"
            assert not resumed.loop.scheduler.requeue
            # both go on alike: the carried sequences continue where they stopped
            trained = []
            for _ in range(3):
                a, b = live.run_step(), resumed.run_step()
                ra, rb = live.last_result.exp.rollouts, resumed.last_result.exp.rollouts
                assert [r.uid for r in ra] == [r.uid for r in rb]
                assert [r.response_ids for r in ra] == [r.response_ids for r in rb]
                assert [r.versions for r in ra] == [r.versions for r in rb]
                assert a["reward/mean"] == pytest.approx(b["reward/mean"], rel=1e-5, abs=1e-6)
                trained += rb
        finally:
            resumed.close()
    finally:
        live.close()
    carried = {r.uid: r for r in trained if r.uid in before}
    assert carried, "no carried sequence was trained after the resume"
    for u, r in carried.items():
        n = len(before[u]["response_ids"])
        assert r.response_ids[:n] == before[u]["response_ids"], "the partial response was kept, not regenerated"
        assert r.versions[:n] == before[u]["versions"] and r.logprobs[:n] == before[u]["logprobs"]


def test_fallback_drain_and_old_checkpoints_load(tiny_models, tiny_prompts, tmp_path):
    """A rollout backend that cannot hand its rows out has them drained: their prompts requeued,
    recorded as such; one that cannot take saved rows back requeues them on load; a checkpoint in
    the format before sequences were saved loads the same way."""
    cfg = load_config(None, _settings(tiny_models, tiny_prompts, tmp_path / "run", steps=10))
    t = Trainer.from_config(cfg, progress=False)
    try:
        _carried(t)
        n = len(t.loop.rollouts)
        positions = sorted({r.prompt_index for r in t.loop.rollouts.values()})
        saved = save_checkpoint(t, tmp_path / "saved")
        t.roles.rollout.in_flight = lambda: None  # (a backend that cannot save its rows)
        ckpt = save_checkpoint(t, tmp_path / "run")
        assert not t.loop.rollouts and t.roles.rollout.active == 0
    finally:
        t.close()
    r = Trainer.from_config(cfg, progress=False)
    try:
        r.roles.rollout.in_flight = lambda: None  # (nor take them back)
        load_checkpoint(r, saved)
        assert sorted(r.loop.scheduler.requeue) == positions and not r.loop.rollouts and not r.roles.rollout.active
    finally:
        r.close()
    state = json.loads((ckpt / "state.json").read_text())
    assert state["in_flight"] == {"how": "drained", "count": n} and state["drained"] == n
    assert not (ckpt / "in_flight.json").exists() and sorted(state["scheduler"]["requeue"]) == positions
    # the format of checkpoints written before in-flight sequences were saved
    for key in ("in_flight",):
        del state[key]
    for key in ("finished", "complete", "finish_counter"):
        del state["scheduler"][key]
    (ckpt / "state.json").write_text(json.dumps(state))
    r = Trainer.from_config(cfg, progress=False)
    try:
        load_checkpoint(r, ckpt)
        assert sorted(r.loop.scheduler.requeue) == positions and not r.loop.rollouts
        r.run_step()
        admitted = ({x.prompt_index for x in r.last_result.exp.rollouts}
                    | {x.prompt_index for x in r.loop.rollouts.values()})
        assert set(positions) <= admitted, "the requeued prompts were admitted first"
    finally:
        r.close()


# ====================================================================== kill -9


def _env():
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except ValueError:  # a torn last line of a killed run
            pass
    return out


def _checkpoint_with_carried(run: Path) -> Path | None:
    """The newest complete checkpoint that saved a running sequence with a partial response."""
    root = run / "checkpoints"
    for d in sorted(root.glob("step_*"), reverse=True) if root.is_dir() else []:
        try:
            saved = json.loads((d / "in_flight.json").read_text())
            json.loads((d / "state.json").read_text())
        except (OSError, ValueError):
            continue
        if any(not s["finished"] and s["response_ids"] for s in saved):
            return d
    return None


@pytest.mark.slow
def test_kill_9_then_resume_loses_no_prompt_and_restores_carried(builtin_home, tmp_path):
    """On ``oppo train``'s own task (``conftest.builtin_home``: its tokenizer adds BOS, its reward
    model is the task's). The kill also ends the scorer's child process (``test_child_exit``: the
    watchdog of a worker started from a thread)."""
    out = tmp_path / "run"
    cli, env = builtin_cli(builtin_home, _env())
    base = [*cli, "train", *_run_settings(out), "generation.max_new_tokens=24", "run.save_every=1",
            "run.keep_checkpoints=1000"]
    # the first run would go on for ever: it ends by the kill, never on its own
    proc = clirun.Popen([*base, "run.steps=100000"], env=env)
    try:
        deadline = time.monotonic() + 600
        found = None
        while found is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            found = _checkpoint_with_carried(out)
        assert proc.poll() is None, f"oppo train ended early: {proc.stderr.read()[-2000:]}"
        assert found is not None, "no checkpoint with a carried sequence in time"
        kids = descendants(proc.pid)
        assert any(b"multiprocessing" in Path(f"/proc/{k}/cmdline").read_bytes() for k in kids), \
            "no scorer child process: the kill would leave nothing to check"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        wait_until(lambda: not any(alive(k) for k in kids), what=f"children {kids} to exit after the kill")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ckpt = _checkpoint_with_carried(out)  # (the run may have written a newer one before it died)
    resume_step = json.loads((ckpt / "state.json").read_text())["step"]
    # the one under test is the last checkpoint: newer ones the killed run wrote go
    for d in (out / "checkpoints").glob("step_*"):
        if int(d.name.split("_")[1]) > resume_step:
            shutil.rmtree(d)
    saved = {s["uid"]: s for s in json.loads((ckpt / "in_flight.json").read_text())}
    assert json.loads((ckpt / "state.json").read_text())["in_flight"]["how"] == "saved"
    steps = resume_step + 6
    done = clirun.run([*base, f"run.steps={steps}", "--resume", "auto"], env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {ckpt}" in done.stderr
    assert latest_checkpoint(out).name == f"step_{steps:06d}"

    rows = _lines(out / "lengths.jsonl")
    assert [r["step"] for r in rows] == list(range(steps)), "one record per step, before and after the kill"
    trained = [p for r in rows for p in r["prompt_index"]]
    assert len(trained) == len(set(trained)) == 4 * steps, "no prompt trained twice"
    final = json.loads((latest_checkpoint(out) / "state.json").read_text())["scheduler"]
    untrained = [row[1] for row in final["untrained"]]
    handed_out = set(range(final["next_position"]))
    assert not set(trained) & set(untrained) and set(trained) | set(untrained) | set(final["requeue"]) == handed_out, \
        "no prompt lost"
    # the carried sequences were restored, not regenerated: trained after the resume under their
    # own uids, with the tokens sampled before the kill (their versions are older than the resume)
    after = {u: (r["step"], p, v) for r in rows if r["step"] >= resume_step
             for u, p, v in zip(r["uid"], r["prompt_index"], r["oldest_version"])}
    partial = {u: s for u, s in saved.items() if s["response_ids"]}
    assert partial
    left = {s["uid"]: s for s in json.loads((latest_checkpoint(out) / "in_flight.json").read_text())} \
        if (latest_checkpoint(out) / "in_flight.json").is_file() else {}
    for u, s in partial.items():
        if u in after:
            step, position, oldest = after[u]
            assert position == s["prompt_index"]
            assert oldest == min(s["versions"]) < resume_step, "its tokens from before the kill were kept"
        else:  # still in flight at the run's end: saved again, its old tokens first
            n = len(s["response_ids"])
            assert left[u]["response_ids"][:n] == s["response_ids"] and left[u]["versions"][:n] == s["versions"]
    assert any(u in after for u in partial), "no restored sequence was trained after the resume"


def test_with_stale_kv_recompute_a_checkpoint_changes_nothing(tiny_models, tiny_prompts, tmp_path):
    """With ``overlap.stale_kv=recompute`` the carried rows' KV is rebuilt after every update
    anyway, which is what re-admitting them at a checkpoint does: a run that checkpoints trains
    the batches of one that does not (the scorers' sums of the re-fed prefixes round differently,
    so scores agree to floating-point tolerance)."""
    cfg = load_config(None, _settings(tiny_models, tiny_prompts, tmp_path / "a", steps=10)
                      + ["overlap.stale_kv=recompute"])
    runs = []
    for save in (False, True):
        t = Trainer.from_config(cfg, progress=False)
        try:
            out = []
            for k in range(5):
                m = t.run_step()
                out.append(([r.response_ids for r in t.last_result.exp.rollouts],
                            [r.versions for r in t.last_result.exp.rollouts], m["reward/mean"]))
                if save and k in (1, 2):
                    assert t.loop.rollouts, "nothing in flight at the checkpoint"
                    save_checkpoint(t, tmp_path / f"ckpt{k}")
            runs.append(out)
        finally:
            t.close()
    for (ids_a, v_a, r_a), (ids_b, v_b, r_b) in zip(*runs):
        assert ids_a == ids_b and v_a == v_b
        assert r_a == pytest.approx(r_b, rel=1e-5, abs=1e-6)
