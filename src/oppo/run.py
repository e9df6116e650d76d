"""``oppo train``: a Trainer in a run directory, with metrics, samples, trace and checkpoints.

A new run never writes into another run's directory: the default ``runs/latest`` is a link to the
newest run's own ``runs/<date>-<time>-<mode>/``; any other ``run.out_dir`` is the run directory
itself, refused when it already holds a run. A resume continues in the run's own directory, after
checking, before any model loads, that the checkpoint was saved with the run's settings (every
problem that needs no model is reported in one message: :mod:`oppo.preflight`). SIGTERM or Ctrl-C
(:data:`STOP`) finish the step in progress, write a checkpoint with the sequences in flight and
raise :class:`Preempted`; a second signal interrupts at once. What a user sees:
``docs/guide.md``, "Run directories, resuming, and what a run tells you"; objects passed from
Python: ``docs/python-api.md``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from .checkpoint import (CKPT_DIR, checkpoint_dirs, checkpoint_settings, checkpoint_step, is_weights_only,
                         latest_checkpoint, load_checkpoint, save_checkpoint, settings_mismatches, verify_checkpoint)
from .config import Config, to_dict
from .inputs import Inputs, keyword_of, split_inputs
from .marker import is_marker
from .metrics import METRICS_FILE, MetricsLogger, ProgressBar, read_metrics
from .preflight import PreflightError, input_problems

LINK_NAME = "latest"
RUN_FILES = ("config.yaml", METRICS_FILE, "trace.json", "lengths.jsonl", CKPT_DIR)
INPUTS_DIR = "inputs"  # models given as objects, saved for the roles that load them elsewhere (inputs.py)
FAILURE_FILE = "failure.txt"  # a run that failed with an error: when, the error, and how to go on (removed on resume)
LOCK_FILE = ".oppo.lock"  # held (flock) by the process writing the run; the kernel drops it when that dies


class Preempted(KeyboardInterrupt):
    """The run stopped on SIGTERM/SIGINT at a step boundary, its checkpoint written (str: what was
    saved and the command that continues it). ``oppo train`` exits 128 + ``signum``."""

    def __init__(self, signum: int, run_dir: Path, checkpoint: Path, steps: int, objects: bool = False):
        self.signum, self.run_dir, self.checkpoint = signum, run_dir, checkpoint
        state = json.loads((checkpoint / "state.json").read_text())
        held = state.get("in_flight") or {}
        carried = (f", with the {held['count']} sequences in flight {held['how']}" if held.get("count") else "")
        how = (f"oppo.train(cfg, resume={str(run_dir)!r}, ...) with the same settings and objects (the policy as it "
               f"was at the start)" if objects else f"oppo train --resume {run_dir} (and the same settings)")
        super().__init__(f"stopped by {signal.Signals(signum).name} after {state['step']} of {steps} steps: "
                         f"checkpoint {checkpoint} holds them{carried}. Continue with: {how}.")

    def __str__(self) -> str:
        return self.args[0]


@dataclass
class StopRequest:
    """A stop asked for by a signal (``oppo train`` sets it from its SIGTERM/SIGINT handler,
    cli.py): the training loop finishes the step it is in, writes a checkpoint and raises
    :class:`Preempted`. A signal outside the loop, or a second one, interrupts at once
    (KeyboardInterrupt); saves are atomic, so that corrupts no checkpoint."""

    signum: int | None = None
    active: bool = False  # a training loop is running and will look at ``signum`` after its step
    run_dir: Path | None = None  # the run being trained (kept after the loop: the CLI's message names it)
    final: bool = False  # the steps are done; the final checkpoint is being written (a signal waits for it)

    def request(self, signum: int) -> bool:
        """True: the loop will stop after its current step; False: interrupt now."""
        if not self.active or self.signum is not None:
            return False
        self.signum = signum
        return True


STOP = StopRequest()  # process-wide, as signal handlers are


def _take_lock(run_dir: Path, mark: bool = True):
    """An open file holding the run directory's lock (with this pid written in it when ``mark``),
    or None if another process holds it."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock
        return open(os.devnull)
    f = open(run_dir / LOCK_FILE, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    if mark:
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
    return f


def _writer_of(run_dir: Path) -> str | None:
    """'pid N' of a live process writing ``run_dir``, or None."""
    if not (run_dir / LOCK_FILE).is_file():
        return None
    lock = _take_lock(run_dir, mark=False)  # a check only: leaves the file as it is
    if lock is not None:
        lock.close()
        return None
    pid = (run_dir / LOCK_FILE).read_text().strip()
    return f"pid {pid}" if pid else "another process"


@dataclass
class RunPlan:
    """Where a run writes and what it starts from, decided before anything is written."""

    run_dir: Path
    """The run's own directory (created when the models have loaded, if it does not exist)."""
    link: Path | None
    """A ``latest`` link to point at ``run_dir``, or None."""
    checkpoint: Path | None
    """The checkpoint to resume from, or None for a new run."""
    start_step: int = 0


def holds_run(d: Path) -> bool:
    """Whether directory ``d`` already holds (part of) a run."""
    return any((Path(d) / f).exists() for f in RUN_FILES)


def _describe_run(d: Path) -> str:
    ckpt = latest_checkpoint(d)
    try:
        steps = len(read_metrics(d))
    except (OSError, ValueError):
        steps = 0
    bits = [f"{steps} steps of metrics" if steps else "no metrics yet"]
    if ckpt is not None:
        bits.append(f"a checkpoint at step {checkpoint_step(ckpt)}")
    return ", ".join(bits)


def _is_link(out: Path) -> bool:
    """``out`` is the 'latest' link (or where it will be), not a run directory."""
    return out.name == LINK_NAME and (out.is_symlink() or not out.exists())


def _fmt(v) -> str:
    return "empty" if v is None else str(v)


def _new_run_dir(parent: Path, mode: str) -> Path:
    base = f"{time.strftime('%Y%m%d-%H%M%S')}-{mode}"
    cand, n = parent / base, 2
    while cand.exists():
        cand, n = parent / f"{base}-{n}", n + 1
    return cand


def _resume_problems(cfg: Config, ckpt: Path, arg: str) -> tuple[list[str], int]:
    step = checkpoint_step(ckpt)
    problems = []
    if is_weights_only(ckpt):
        full = [c for c in checkpoint_dirs(ckpt.parent.parent) if not is_weights_only(c)]
        earlier = f"resume from {full[-1]} (--resume {full[-1]}), or " if full else ""
        problems.append(f"--resume {arg}: {ckpt} holds the weights only (saved with run.save_final=weights), no "
                        f"optimizer state, so the run cannot go on from it exactly; {earlier}start a new run from "
                        f"its weights (policy.path={ckpt / 'policy'}).")
        return problems, step
    saved = checkpoint_settings(ckpt)
    if saved is not None:
        diffs = settings_mismatches(saved, to_dict(cfg))
        objects = [(k, a) for k, a, _ in diffs if is_marker(a)]  # given from Python to the run that saved it
        for k, a in objects:
            kw = keyword_of(k)
            problems.append(f"--resume {arg}: {k} was given as an object to the run that saved {ckpt} ({a}); pass "
                            f"the same object again to continue it, from Python: oppo.train(cfg, resume=..., "
                            f"{kw}=...).")
        diffs = [d for d in diffs if not is_marker(d[1])]
        if diffs:
            said = "; ".join(f"{k} is {_fmt(a)} in the checkpoint, {_fmt(b)} now" for k, a, b in diffs)
            fix = " ".join(f"{k}={'' if a is None else shlex.quote(str(a))}" for k, a, _ in diffs)
            problems.append(
                f"--resume {arg}: {ckpt} was saved with other settings: {said}. To continue that run, resume with "
                f"its settings ({fix}); to train with the new ones, start a new run (no --resume, a fresh "
                f"run.out_dir). The checkpoint's policy and critic, in Hugging Face format, are {ckpt / 'policy'} "
                f"and {ckpt / 'critic'}.")
    if cfg.run.steps <= step:
        problems.append(f"--resume {arg}: run.steps={cfg.run.steps} but {ckpt} is at step {step}, so there is nothing "
                        f"left to train. Set run.steps above {step} (e.g. run.steps={max(2 * step, step + 1)}) to "
                        f"train on.")
    return problems, step


def _verified(ckpt: Path, arg: str) -> tuple[Path | None, list[str]]:
    """``ckpt`` if its files match its manifest; else, for ``--resume auto`` or a run directory, the
    newest earlier checkpoint that does (with a warning naming both); else a problem naming it."""
    bad = verify_checkpoint(ckpt)
    if bad is None:
        return ckpt, []
    picked = Path(arg).expanduser() if arg != "auto" else None
    if picked is None or not (picked / "state.json").is_file():  # auto or a run directory: fall back
        for earlier in reversed(checkpoint_dirs(ckpt.parent.parent)):
            if checkpoint_step(earlier) < checkpoint_step(ckpt) and verify_checkpoint(earlier) is None:
                print(f"oppo: warning: the newest checkpoint {ckpt} is damaged ({bad}); resuming from the previous "
                      f"one, {earlier}, instead (the steps after it are trained again).", file=sys.stderr)
                return earlier, []
    return None, [f"--resume {arg}: checkpoint {ckpt} is damaged ({bad}) and no earlier intact checkpoint is beside "
                  f"it in {ckpt.parent}; start the run again (a fresh run.out_dir)."]


def plan_run(cfg: Config, resume: str | None = None, inputs: Inputs | None = None) -> RunPlan:
    """Decide the run directory and the checkpoint, and run every check that needs no model.
    ``inputs``: the objects given in place of paths (``cfg`` holds their markers: ``inputs.split_inputs``).

    Writes nothing. Raises :class:`~oppo.preflight.PreflightError` listing every problem found:
    the run directory's, the checkpoint's and the inputs' (:func:`oppo.preflight.input_problems`).
    """
    out = Path(cfg.run.out_dir).expanduser()
    problems: list[str] = []
    link = out if _is_link(out) else None
    ckpt, run_dir, step = None, out, 0
    if resume is None:
        if link is not None:
            run_dir = _new_run_dir(out.parent, cfg.overlap.mode)
        elif holds_run(out):
            hint = (f" ({out} is a run directory from an older oppo: runs now get their own directories beside a "
                    f"'{LINK_NAME}' link; rename it, e.g. mv {out} {out.parent / 'old-run'}, to go on with the "
                    f"default)") if out.name == LINK_NAME else ""
            problems.append(
                f"run.out_dir={cfg.run.out_dir} already holds a run ({_describe_run(out)}); a new run never writes "
                f"over another. To continue that run: oppo train --resume auto run.out_dir={cfg.run.out_dir} "
                f"(with its settings). To start a new run: give a fresh directory, e.g. "
                f"run.out_dir={out.parent / (out.name + '-2')}, or delete {out} first.{hint}")
    elif resume == "auto":
        if link is not None and not out.is_symlink():
            problems.append(f"--resume auto: there is no run to resume: {out} does not exist yet. Start a run "
                            f"without --resume, or set run.out_dir to the directory of the run to continue.")
        else:
            run_dir = out.resolve() if link is not None else out
            ckpt = latest_checkpoint(run_dir)
            if ckpt is None:
                problems.append(f"--resume auto: no checkpoint under {run_dir / CKPT_DIR}; start without --resume, "
                                f"or set run.out_dir to the directory of the run to continue.")
    else:
        ckpt = Path(resume).expanduser()
        if not (ckpt / "state.json").is_file() and (latest := latest_checkpoint(ckpt)) is not None:
            ckpt = latest  # a run directory: its latest checkpoint
        if not (ckpt / "state.json").is_file():
            problems.append(f"--resume {resume}: {ckpt} is not a checkpoint (no state.json). Give a "
                            f"{CKPT_DIR}/step_N directory, a run directory, or auto.")
            ckpt = None
        else:
            own = ckpt.parent.parent
            run_dir = own if link is not None else out
            if run_dir.resolve() != own.resolve() and holds_run(run_dir):
                problems.append(f"--resume {resume}: run.out_dir={cfg.run.out_dir} holds another run "
                                f"({_describe_run(run_dir)}); continue the checkpoint's run in its own directory "
                                f"(run.out_dir={own}) or give an empty run.out_dir.")
    if ckpt is not None:
        assert resume is not None  # a checkpoint is picked only with --resume
        ckpt, found = _verified(ckpt, resume)
        problems += found
        if ckpt is not None:
            found, step = _resume_problems(cfg, ckpt, resume)
            problems += found
    writer = _writer_of(run_dir) if run_dir.is_dir() else None
    if writer is not None:
        problems.append(f"oppo train ({writer}) is still writing {run_dir}; wait for it to end or stop it, "
                        f"then resume with --resume auto.")
    problems += input_problems(cfg, inputs)
    if problems:
        raise PreflightError(problems)
    return RunPlan(run_dir, link, ckpt, step)


def _create(plan: RunPlan, made: bool = False) -> Path:
    """Create the run directory (another name if a concurrent run took this one). The link is
    pointed at it once a step has finished (``train``): a run that fails before leaves the link on
    the last run that trained. ``made``: this run made it already (to save objects in it)."""
    run_dir = plan.run_dir
    if plan.link is not None and plan.checkpoint is None and not made:
        base, n = run_dir, 2
        while True:
            try:
                run_dir.mkdir(parents=True)
                break
            except FileExistsError:
                run_dir, n = base.with_name(f"{base.name}-{n}"), n + 1
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _objects_comment(cfg: Config, inputs: Inputs) -> str:
    """``config.yaml``'s comment lines on the settings given as objects (``<object: ...>``)."""
    from .inputs import SETTINGS

    lines = []
    for kw, key in SETTINGS.items():
        section, name = key.split(".")
        if is_marker(getattr(getattr(cfg, section), name)):
            role = {"reward_model": "reward"}.get(kw, kw)
            where = f"; saved to {inputs.saved[role]}" if role in inputs.saved else ""
            lines.append(f"# {key}: given from Python as an object ({kw}=){where}\n")
    lines += [f"# reward.terms term {name!r}: given from Python as a callable (cfg.reward.terms)\n"
              for name in inputs.reward_terms]
    if inputs.tokenizer is not None:
        lines.append("# the policy's tokenizer: given from Python as an object (tokenizer=); saved with every "
                     "checkpoint's policy\n")
    return "".join(lines)


def _point_link(link: Path, target: Path) -> None:
    """Atomically (re)point ``link`` at ``target`` (a relative link when they are siblings)."""
    rel = target.name if target.resolve().parent == link.parent.resolve() else str(target.resolve())
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(rel, target_is_directory=True)
        os.replace(tmp, link)
    except OSError as e:  # a filesystem without symlinks: the run still has its directory
        tmp.unlink(missing_ok=True)
        print(f"oppo: note: could not point {link} at {target} ({e})", file=sys.stderr)


def _print_samples(title: str, texts, scores, n: int) -> None:
    if n <= 0:
        return
    print(f"\n{title}", file=sys.stderr)
    for (prompt, response), s in list(zip(texts, scores))[:n]:
        print(f"  [{s:+.3f}] {prompt} ||| {response}", file=sys.stderr)


def _keep_lines_before(path: Path, step: int) -> None:
    """Drop the records of steps >= ``step`` from a JSONL file (rewritten atomically)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True)
            if line.strip() and (k := _step_of(line)) is not None and k < step]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a torn last line from a killed run


def _earlier_spans(path: Path, before: int):
    from .trace import load_trace

    if before <= 0 or not path.is_file():
        return []
    try:
        return [s for s in load_trace(path) if s.step < before]
    except (OSError, ValueError, KeyError, TypeError):
        return []  # unreadable (a run killed mid-write cannot leave one: saves are atomic)


def policy_line(cfg: Config) -> str:
    """One line for the run's start: whether it trains on-policy tokens only (no sequence outlives
    the weights that began it) or may train off-policy ones (carried across an update, or sampled
    while the learner trained), and the settings that give TRL's PPOTrainer behaviour."""
    o, B = cfg.overlap, cfg.ppo.batch_size
    trl = (f"for TRL's PPOTrainer (on-policy, its defaults): overlap.mode=sequential ppo.epochs=4 "
           f"ppo.minibatch_size={B} generation.temperature=0.7 (docs/from-trl.md)")
    extra = o.delta if o.delta >= 0 else o.delta_max  # adaptive Delta goes up to delta_max
    if cfg.in_flight:
        why = (f"overlap.mode={o.mode} loads new weights while sequences decode and carries up to Delta unfinished "
               f"ones into the next step (overlap.max_lag={o.max_lag})")
    elif cfg.carries and extra > 0 and o.max_lag > 0:
        delta = (f"overlap.delta={o.delta}" if o.delta >= 0 else
                 f"adaptive Delta up to overlap.delta_max={o.delta_max}, starting at overlap.delta_min={o.delta_min}"
                 + (f" and kept only where carrying measurably shortens the step, adding at most "
                    f"overlap.max_stale_share={o.max_stale_share:g} of off-policy tokens" if o.delta_rule == "cost"
                    else " (overlap.delta_rule=reward_slope)"))
        why = (f"overlap.mode={o.mode} keeps extra sequences in flight ({delta}) and carries unfinished ones into "
               f"the next step (overlap.max_lag={o.max_lag})")
    else:
        how = ("stage after stage" if o.mode == "sequential" else "with no extra sequences in flight" if cfg.carries
               else "scoring while decoding, carrying nothing")
        return (f"on-policy: overlap.mode={o.mode} ({how}) trains every step on tokens the step's own policy "
                f"sampled; {trl}")
    return (f"may train off-policy tokens: {why}, their PPO ratios importance-weighted by the behaviour "
            f"log-probs (ppo.is_truncate={cfg.ppo.is_truncate}); {trl}")


def loading_line(cfg: Config) -> str:
    """One line before the models load (minutes for large ones, with nothing else printed): which
    models, from where, so that a slow or wrong load is seen before it ends."""
    if cfg.uses_builtin_task:
        from .task import get_task

        task = f"the {cfg.data.task} task's"
        policy = f"{task} SFT policy"
        builtin_fn = get_task(cfg.data.task).reward_function
    else:
        task, policy, builtin_fn = "", str(cfg.policy.path), None
    fn = cfg.reward.function or (None if cfg.reward.path else builtin_fn)
    reward = f"function {fn}" if fn else cfg.reward.path or f"{task} reward model"
    first_rm = cfg.reward.path
    if cfg.reward.terms:  # (validated) the weighted sum, each term by what it reads
        from .rewards import parse_terms

        terms = parse_terms(cfg.reward.terms)
        reward = " + ".join(f"{t.weight:g} x {t.path or t.function}" for t in terms)
        fn, first_rm = None, next((t.path for t in terms if t.path), None)
    parts = [f"policy {policy}", f"reward {reward}",
             f"reference {cfg.reference.path or 'a frozen copy of the policy'}"]
    if cfg.algo_spec.needs_critic:  # initialised as resolve_paths says: the reward model's, else the policy's
        critic = cfg.critic.path or first_rm or (f"{task} reward model" if cfg.uses_builtin_task and not fn
                                                 and not cfg.reward.terms else policy)
        parts.append(f"critic from {critic}")
    if cfg.reward.judge:
        parts.append(f"judge {cfg.reward.judge}")
    return "loading models: " + ", ".join(parts) + " ..."


def machine_threads() -> tuple[int, int, int | None, float | None]:
    """This process's torch thread count, the machine's cores, the cores this process may run on
    (None where the OS does not say) and the 1-minute load average (None where there is none)."""
    import torch

    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on macOS / Windows
        usable = None
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return torch.get_num_threads(), os.cpu_count() or 1, usable, load


def threads_lines(cfg: Config, torch_threads: int, cores: int, usable: int | None,
                  load: float | None) -> list[str]:
    """The start-up lines on CPU threads: the count torch uses and where it comes from, and, when
    the machine is already busier than the cores this run may use, a warning with the fix: there
    torch's threads wait on each other and steps can be many times slower (``docs/guide.md``)."""
    pl = cfg.placement
    full = pl.threads or torch_threads
    source = f"placement.threads={pl.threads}" if pl.threads else "placement.threads=0: torch's default"
    cpus = f"{usable} usable of {cores} cores" if usable is not None and usable != cores else f"{cores} cores"
    line = f"threads: torch {full} ({source}); {cpus}"
    if cfg.streams:
        line += (f"; while decoding, actor {pl.actor_threads} and scorer {pl.scorer_threads} "
                 f"(placement.actor_threads, placement.scorer_threads)")
    if load is not None:
        line += f"; load average {load:.1f}"
    lines = [line]
    avail = usable if usable is not None else cores
    if load is not None and load > avail:
        fix = ("set placement.threads=1 (or fewer threads than the idle cores)" if full > 1 else
               "this run already uses one thread: free some cores")
        lines.append(f"oppo: warning: the machine is oversubscribed (load average {load:.1f} over {avail} usable "
                     f"cores before this run starts): torch's threads will wait on each other and steps can be many "
                     f"times slower; {fix}")
    return lines


def train(cfg: Config, resume: str | None = None, progress: bool = True, *, policy: Any = None,
          tokenizer: Any = None, reference: Any = None, critic: Any = None, reward_model: Any = None,
          reward_fn: Callable | str | None = None, judge: Callable | str | None = None, prompts: Any = None) -> Path:
    """Run PPO as configured; return the run directory.

    ``resume``: None for a new run, ``"auto"`` for the latest checkpoint of ``run.out_dir``, or a
    checkpoint (or run) directory. Raises :class:`~oppo.preflight.PreflightError` before loading
    anything when the run directory, the checkpoint or the inputs are wrong. The keywords after
    ``progress`` give objects in place of settings, as :class:`~oppo.trainer.Trainer` takes them;
    models that a role loads elsewhere are saved under the run directory's ``inputs/``. With
    ``progress``, a finished run prints its summary (:func:`run_summary`: ``done: N steps ...``) on
    stdout, as ``oppo train`` does.
    """
    from transformers.utils import logging as hf_logging

    from .trainer import Trainer

    objects = dict(policy=policy, tokenizer=tokenizer, reference=reference, critic=critic, reward_model=reward_model,
                   reward_fn=reward_fn, judge=judge, prompts=prompts)
    cfg, inputs = split_inputs(cfg, **objects)
    objects = {kw: getattr(inputs, kw) for kw in objects}  # (with those the settings held: now markers there)
    t_start = time.perf_counter()
    hf_logging.disable_progress_bar()  # "Loading weights" bars for every role drown the run's own output
    plan = plan_run(cfg, resume, inputs)
    ckpt = plan.checkpoint
    lock = None
    if progress:
        for line in threads_lines(cfg, *machine_threads()):
            print(line, file=sys.stderr)
        print(loading_line(cfg), file=sys.stderr, flush=True)
    t_load = time.perf_counter()
    # the entries of an existing run directory before this run (None: this run makes it), so that a
    # run failing before its first step removes only what it wrote
    found = set(plan.run_dir.iterdir()) if plan.run_dir.is_dir() else None
    trainer = Trainer(cfg, progress=progress, save_dir=plan.run_dir / INPUTS_DIR, reward_terms=inputs.reward_terms,
                      **objects)
    if progress:
        print(f"models loaded in {time.perf_counter() - t_load:.1f}s", file=sys.stderr)
    try:
        if ckpt is not None:
            load_checkpoint(trainer, ckpt)
            print(f"resumed from {ckpt} at step {trainer.step}", file=sys.stderr)
        saved = trainer.inputs.saved  # (models given as objects, saved in the run directory for other processes)
        run_dir = _create(plan, made=bool(saved))
        lock = _take_lock(run_dir)
        if lock is None:  # another run took the directory since the check
            raise PreflightError([f"another oppo train is writing {run_dir} (started since the checks); "
                                  f"give a fresh run.out_dir."])
        engine = trainer.roles.engine  # generation.engine=auto resolved: which engine runs, and why
        if progress:
            linked = f" ({plan.link} will point to it once a step has finished)" if plan.link is not None else ""
            print(f"run directory: {run_dir}{linked}", file=sys.stderr)
            if engine:
                print(f"rollout engine: {engine}", file=sys.stderr)
            print(policy_line(cfg), file=sys.stderr)
        first = trainer.step
        (run_dir / FAILURE_FILE).unlink(missing_ok=True)  # (an earlier failure of this run: it goes on now)
        (run_dir / "config.yaml").write_text((f"# rollout engine: {engine}\n" if engine else "")
                                             + _objects_comment(cfg, trainer.inputs)
                                             + yaml.safe_dump(_used_settings(cfg), sort_keys=False))
        logger = MetricsLogger(run_dir, tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb,
                               wandb_project=cfg.log.wandb_project, config=to_dict(cfg), resume=ckpt is not None)
        if ckpt is not None:
            logger.truncate_after(first - 1)
        lengths_path = run_dir / "lengths.jsonl"
        _keep_lines_before(lengths_path, first)
        earlier = _earlier_spans(run_dir / "trace.json", first) if cfg.log.trace else []
        bar = ProgressBar(cfg.run.steps, initial=first, enabled=cfg.log.progress)
        STOP.signum, STOP.active, STOP.final, STOP.run_dir = None, True, False, run_dir
        saved_at = time.monotonic()  # run.save_every_minutes counts from the start (or the resume)
        try:
            with open(lengths_path, "a" if ckpt else "w") as lengths:
                while trainer.step < cfg.run.steps and STOP.signum is None:  # (a stop asked during a save)
                    step = trainer.step
                    metrics = trainer.run_step()
                    res = trainer.last_result
                    assert res is not None and res.exp.scores is not None  # run_step's trained, scored batch
                    if step == first:
                        _print_samples(f"samples at step {step}:", res.texts, res.exp.scores.tolist(),
                                       cfg.run.samples)
                    logger.log(step, metrics)
                    if step == first and plan.link is not None:  # a step has finished: the run is the latest
                        _point_link(plan.link, run_dir)
                    rows = res.exp.rollouts
                    # per trained sequence: its data position and uid (a prompt is trained once, across
                    # resumes too) and the oldest version among its tokens (carried across a checkpoint:
                    # older than the resume)
                    lengths.write(json.dumps({"step": step, "lengths": res.exp.mask.sum(1).int().tolist(),
                                              "prompt_index": [r.prompt_index for r in rows],
                                              "uid": [r.uid for r in rows],
                                              "oldest_version": [min(r.versions, default=step) for r in rows]})
                                  + "\n")
                    lengths.flush()
                    bar.update(step, metrics)
                    for line in trainer.run.take_decisions():  # the overlap controller's changes, with reasons
                        bar.note(f"[oppo] {line}")
                    if STOP.signum is not None:  # preempted: the step is whole; save below
                        break
                    minutes = (time.monotonic() - saved_at) / 60
                    due = (cfg.run.save_every and trainer.step % cfg.run.save_every == 0
                           or cfg.run.save_every_minutes and minutes >= cfg.run.save_every_minutes)
                    if due and trainer.step < cfg.run.steps:
                        save_checkpoint(trainer, run_dir, cfg.run.keep_checkpoints)
                        saved_at = time.monotonic()
        finally:
            bar.close()
            if cfg.log.trace:  # also when interrupted: the trace of the steps run so far
                trainer.tracer.save(run_dir / "trace.json", previous=earlier)
        # STOP stays active through the last save: a signal now (the loop is done) waits for the checkpoint
        # that holds every step, instead of interrupting it and losing them all
        STOP.final = True
        if STOP.signum is not None and trainer.step < cfg.run.steps:
            # with the sequences in flight (trainer.state_dict), as every checkpoint
            saved = save_checkpoint(trainer, run_dir, cfg.run.keep_checkpoints)
            logger.close()
            raise Preempted(STOP.signum, run_dir, saved, cfg.run.steps, objects=bool(inputs))
        if trainer.step > first:
            res = trainer.last_result
            assert res is not None and res.exp.scores is not None  # the last step's trained, scored batch
            _print_samples(f"samples at step {trainer.step - 1}:", res.texts, res.exp.scores.tolist(), cfg.run.samples)
        final = None
        if cfg.run.save_final != "none":
            final = save_checkpoint(trainer, run_dir, cfg.run.keep_checkpoints,
                                    weights_only=cfg.run.save_final == "weights")
        logger.close()
        STOP.active = False
        if STOP.signum is not None:  # asked during the last step or the last save: both were finished
            kept = f"the final checkpoint {final} holds them" if final is not None else "run.save_final=none"
            print(f"oppo: {signal.Signals(STOP.signum).name} arrived as the run ended: all {cfg.run.steps} steps "
                  f"are trained and {kept}; nothing is left to resume.", file=sys.stderr)
    except BaseException as e:
        removed = lock is not None and ckpt is None and trainer.step == 0  # a new run of ours, no step done
        if removed:
            _remove_unfinished(run_dir, found)
        if isinstance(e, Exception) and lock is not None:  # (a signal's stop has its own message: cli.py)
            line = recovery_line(run_dir, trainer.step, removed, objects=bool(inputs))
            print(line, file=sys.stderr, flush=True)
            if not removed:  # the directory says it failed, and why, to whoever finds it later
                _record_failure(run_dir, e, line)
        raise
    finally:
        STOP.active = STOP.final = False
        trainer.close()
        if lock is not None:
            lock.close()  # releases the flock
    if progress:
        print(run_summary(run_dir, time.perf_counter() - t_start, link=cfg.run.out_dir), flush=True)
    return run_dir


def _record_failure(run_dir: Path, e: BaseException, line: str) -> None:
    """Write ``failure.txt`` in ``run_dir``: the time, the error's first line and the recovery line."""
    first = (str(e).strip().splitlines() or [""])[0]
    try:
        (run_dir / FAILURE_FILE).write_text(f"failed at {time.strftime('%Y-%m-%d %H:%M:%S %z')}: "
                                            f"{type(e).__name__}: {first}\n{line.removeprefix('oppo: ')}\n")
    except OSError:
        pass  # (a full or read-only disk: the message on stderr is what there is)


def recovery_line(run_dir: Path, step: int, removed: bool, objects: bool = False) -> str:
    """What a run that failed with an error kept, and how to go on: the run directory removed (no
    step had finished), no checkpoint to resume from, or the checkpoint and the command (from
    Python with the same objects, where the run was given objects)."""
    if removed:
        return (f"oppo: the run failed before its first step finished: nothing was trained, and what it wrote in "
                f"{run_dir} was removed. Once fixed, start it again.")
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return (f"oppo: the run failed in step {step}: the metrics and trace of its {step} finished steps are in "
                f"{run_dir}, but it wrote no checkpoint (run.save_every, run.save_every_minutes), so it cannot be "
                f"resumed. Once fixed, start a new run (a fresh run.out_dir).")
    how = (f"oppo.train(cfg, resume={str(run_dir)!r}, ...) with the same settings and objects (the policy as it "
           f"was at the start)" if objects else f"oppo train --resume {run_dir} (and the same settings)")
    return (f"oppo: the run failed in step {step}; its last checkpoint is {ckpt} (step {checkpoint_step(ckpt)}). "
            f"Once fixed, continue with: {how}.")


def _used_settings(cfg: Config) -> dict:
    """The run's settings for its ``config.yaml``: ``data.task`` only where the built-in task ran."""
    d = to_dict(cfg)
    if not cfg.uses_builtin_task:
        del d["data"]["task"]
    return d


def _remove_unfinished(run_dir: Path, found: set[Path] | None) -> None:
    """Remove what a new run that failed before finishing a step wrote: its directory, or, in a
    directory that existed before it (``found``: its entries then), only the entries it added."""
    import shutil

    if found is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for p in set(run_dir.iterdir()) - found:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


# --------------------------------------------------------------------------- the closing summary

def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _mean(records: list[dict], key: str) -> float | None:
    vals = [r[key] for r in records if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def run_summary(run_dir: str | Path, wall_seconds: float | None = None, link: str | Path | None = None) -> str:
    """A few lines that close a run: steps, reward and judge at the start and the end, wall time,
    the run directory and the command that draws its pictures."""
    run_dir = Path(run_dir)
    try:
        ms = read_metrics(run_dir)
    except (OSError, ValueError):
        ms = []
    lines = []
    if ms:
        k = 5 if len(ms) >= 10 else 1
        head, tail = ms[:k], ms[-k:]
        took = f" in {_duration(wall_seconds)}" if wall_seconds is not None else ""
        train_s = ms[-1].get("time/wallclock")
        lines.append(f"done: {len(ms)} steps ({ms[0]['step']}-{ms[-1]['step']}){took}"
                     + (f", {_duration(train_s)} of it training" if train_s is not None and wall_seconds else ""))
        parts = []
        for key, name in (("reward/mean", "reward"), ("judge/mean", "judge"), ("task/accuracy", "accuracy")):
            a, b = _mean(head, key), _mean(tail, key)
            if a is not None and b is not None:
                parts.append(f"{name} {a:.3f} -> {b:.3f}")
        kl = _mean(tail, "kl/mean")
        if kl is not None:
            parts.append(f"KL {kl:.3g} at the end")
        if parts:
            which = f"means of the first and last {k} steps" if k > 1 else "first and last step"
            lines.append(f"  {', '.join(parts)} ({which})")
    where = f"  run directory: {run_dir}"
    if link is not None and Path(link).is_symlink() and Path(link).resolve() == run_dir.resolve():
        where += f"  ({link} points to it)"
    lines.append(where)
    if ms:
        lines.append(f"  pictures:      oppo report {shlex.quote(str(run_dir))}")
    return "\n".join(lines)
