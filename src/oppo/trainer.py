"""The trainer: a thin façade over the roles (``setup.build.build_roles``) and the controller
(``oppo.control``).

``run_step`` runs one PPO step in the configured mode: ``control.sequential_step`` (the
reference loop, ``overlap.mode=sequential``) or ``control.overlapped_step`` (intra, inter, oppo
and pipeline, one loop driven by a policy value). ``state_dict`` / ``load_state_dict`` are what a
checkpoint saves and restores (``checkpoint/store.py`` writes them to disk); ``close`` stops every
role's thread, process or actor. Where a role runs is decided once, in ``setup/build.py``;
nothing here asks.

Objects in place of paths (``setup/inputs.py``): ``Trainer.from_config(cfg, policy=model,
tokenizer=tok, reward_model=rm, reward_fn=score, prompts=ds)``; ``self.cfg`` is then the settings
with each object's marker (what checkpoints record), ``self.inputs`` the objects.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

import torch

from .config import Config, to_dict
from .control import Loop, StepResult, overlapped_step, sequential_step
from .control.step_metrics import step_metrics
from .fingerprint import run_fingerprints
from .api.roles import RoleHandles, Roles
from .setup.build import build_roles
from .setup.check import Checked, check_objects
from .setup.inputs import Inputs


class Trainer:
    """``Trainer.from_config(cfg, **objects)`` checks the settings and inputs, then builds every
    role; ``Trainer(checked)`` builds them from a record the one check issued (``setup.check``:
    ``oppo train`` and :func:`oppo.train` pass theirs, nothing is checked again). ``run_step()``
    trains one step and returns its metrics."""

    def __init__(self, checked: Checked, progress: bool = True):
        if not isinstance(checked, Checked):
            raise TypeError(f"Trainer(...) takes the record oppo.setup.check issues, not a {type(checked).__name__}; "
                            f"for settings and objects given in code, use Trainer.from_config(cfg, ...).")
        cfg = checked.cfg
        self.checked = checked
        self.cfg, self.inputs = cfg, checked.inputs
        torch.set_num_threads(cfg.placement.threads or torch.get_num_threads())
        _seed_everything(cfg.run.seed)
        try:
            self.roles: Roles = build_roles(cfg, progress=progress, inputs=self.inputs)
        except BaseException:
            self._remove_saved()
            raise
        # the models the run reads, as loaded (before any step trains the critic): saved with every
        # checkpoint, compared on resume (checkpoint.check_models)
        self.fingerprints = run_fingerprints(self.roles)
        self.loop = Loop(RoleHandles.of(self.roles))  # the controller gets the roles and what a step reads, no model
        self.step = 0
        self.wallclock = 0.0
        self.step_windows: dict[int, tuple[float, float]] = {}  # perf_counter bounds of each step
        self.last_result: StepResult | None = None

    @classmethod
    def from_config(cls, cfg: Config, progress: bool = True, *, policy: Any = None, tokenizer: Any = None,
                    reference: Any = None, critic: Any = None, reward_model: Any = None,
                    reward_fn: Callable | str | None = None, judge: Callable | str | None = None, prompts: Any = None,
                    save_dir: str | os.PathLike | None = None,
                    reward_terms: Mapping[str, Callable] | None = None) -> "Trainer":
        """A Trainer for settings and objects given in code: the objects split from the settings,
        then the one check (``setup.check``: the settings validated, every path and object
        checked, before any model loads), then the roles built. Objects may stand in for the
        settings that name paths or functions (docs/python-api.md): ``policy`` (a causal LM,
        trained in place) with its ``tokenizer``, ``reference``, ``critic`` (its initialisation),
        ``reward_model`` (a one-label sequence classifier), ``reward_fn`` and ``judge``
        (callables), ``prompts`` (a ``datasets.Dataset``, a list of str or of dicts); a str given
        for one of them is its setting's value. ``save_dir``: where models that a role loads in
        another process (Ray, vLLM) are saved (default: a temporary directory, removed by
        :meth:`close`). ``reward_terms``: callables for ``reward.terms``' functions by term name,
        for a config whose terms hold their markers already."""
        checked = check_objects(cfg, policy=policy, tokenizer=tokenizer, reference=reference, critic=critic,
                                reward_model=reward_model, reward_fn=reward_fn, judge=judge, prompts=prompts,
                                save_dir=Path(save_dir) if save_dir is not None else None, reward_terms=reward_terms)
        return cls(checked, progress)

    # ------------------------------------------------------------------ what users and tools read

    @property
    def tracer(self):
        return self.roles.tracer

    @property
    def max_new_tokens(self) -> int:
        return self.roles.max_new_tokens

    @property
    def length_sampler(self):
        """Benchmarks: ``(prompt_index, member of its group) -> forced response length`` (None: the
        model's own lengths)."""
        return self.loop.length_sampler

    @length_sampler.setter
    def length_sampler(self, fn) -> None:
        self.loop.length_sampler = fn

    # ------------------------------------------------------------------ the loop

    def run_step(self) -> dict[str, float]:
        step = self.step
        t0, c0 = time.perf_counter(), time.process_time()
        self.loop.threads.use(self.loop.threads.full)
        if self.cfg.overlap.mode == "sequential":
            result, times = sequential_step(self.loop, step)
        else:
            result, times = overlapped_step(self.loop, step)  # (each ends the scheduler's step: stages.end_step)
        t1 = time.perf_counter()
        dt = t1 - t0
        self.step_windows[step] = (t0, t1)
        self.wallclock += dt
        metrics = step_metrics(self.loop, result, times, dt, self.wallclock)
        self.loop.record(dt, float(result.exp.mask.sum()), metrics.get("overlap/offpolicy_token_frac", 0.0), metrics)
        # share of the machine's CPU capacity this process used during the step
        metrics["perf/cpu_util"] = (time.process_time() - c0) / (dt * (os.cpu_count() or 1))
        self.step += 1
        self.last_result = result
        return metrics

    # ------------------------------------------------------------------ checkpoints

    def models(self) -> dict[str, torch.nn.Module]:
        """The trained models a checkpoint saves, by name (``policy``, and ``critic`` unless the
        algorithm is critic-free). After :meth:`state_dict` they hold the trained weights."""
        out = {"policy": self.roles.policy}
        if self.roles.critic is not None:
            out["critic"] = self.roles.critic
        return out

    def state_dict(self) -> dict:
        """Everything but the models' weights that a checkpoint saves, with the sequences in
        flight (``in_flight``: :meth:`Loop.save_in_flight`; drained where the rollout backend cannot
        hand them out). Brings trained weights that live elsewhere (Ray learner ranks) into
        :meth:`models`. Then re-admits the saved sequences, as a resume from this state does
        (:meth:`Loop.reload_in_flight`), so that the live run and a resumed one go on alike."""
        in_flight = self.loop.save_in_flight()
        sched = self.loop.scheduler.state_dict()
        import numpy as np

        rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
               "rollout": self.roles.rollout.state_dict(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        out = {"optim": self.roles.learner.checkpoint_state(), "rng": rng, "config": to_dict(self.cfg),
               "tokenizer": self.roles.tokenizer, "in_flight": in_flight["sequences"], "models": self.fingerprints,
               "state": {"step": self.step, "wallclock": self.wallclock,
                         "scheduler": sched, "tuner": self.loop.tuner.state_dict(),
                         # how the sequences in flight were checkpointed: "saved" or "drained", and how many
                         "in_flight": {"how": in_flight["how"], "count": in_flight["count"]},
                         "drained": in_flight["count"] if in_flight["how"] == "drained" else 0}}
        if in_flight["how"] == "saved":
            self.loop.reload_in_flight(in_flight, self.step)
        return out

    def load_state_dict(self, state: dict) -> None:
        """Inverse of :meth:`state_dict`, after :meth:`models` hold the checkpoint's weights. A
        checkpoint of any placement loads into any other. Saved sequences in flight
        (``state["in_flight"]``) are re-admitted with their partial responses; where this run's
        rollout backend cannot take them back, or the checkpoint predates saving them (it drained
        them), their prompts are requeued."""
        roles, st = self.roles, state["state"]
        roles.learner.load_checkpoint_state(state["optim"])  # the learner takes the checkpoint's weights and states
        roles.sync(st["step"])  # then every role that serves them, as after an update (weights.steps.WeightSync)
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        import numpy as np

        np.random.set_state(rng["numpy"])
        # ("engine": the generator state, as checkpoints before the rollout backends had a state_dict saved it)
        roles.rollout.load_state_dict(rng["rollout"] if "rollout" in rng else {"generator": rng["engine"]})
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        saved: list[dict] = state.get("in_flight") or []  # empty: a checkpoint that drained (or predates saving)
        keep = bool(saved) and roles.rollout.in_flight() is not None
        self.loop.scheduler.load_state_dict(st["scheduler"], keep_untrained=keep)
        self.loop.tuner.load_state_dict(st["tuner"])
        self.step, self.wallclock = st["step"], st["wallclock"]
        if keep:
            sched = self.loop.scheduler
            if ({d["uid"] for d in saved if not d["finished"]} != set(sched.in_flight)
                    or {d["uid"] for d in saved if d["finished"]} != set(sched.finished_pool)):
                raise ValueError("the checkpoint's saved sequences in flight do not match its scheduler's "
                                 "untrained tickets; the checkpoint is corrupt")
            self.loop.restore_in_flight(saved, self.step)

    def close(self) -> None:
        self.loop.close()
        self.roles.close()
        self._remove_saved()

    def _remove_saved(self) -> None:
        """Remove the temporary directory that objects were saved to for other processes (if any)."""
        inputs: Inputs = self.inputs
        if inputs.temporary and inputs.save_dir is not None:
            shutil.rmtree(inputs.save_dir, ignore_errors=True)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> Literal[False]:
        self.close()
        return False


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


__all__ = ["StepResult", "Trainer"]
