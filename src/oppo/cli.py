"""The ``oppo`` command: train, prepare, bench, report."""

from __future__ import annotations

import argparse
import sys

from .config import ConfigError, help_text, load_config


LIGHT = ("recipes",)
"""Commands that load no model: neither transformers nor torch is imported for them (``oppo recipes``
took 22 s on a busy 2-core machine to print four lines, nearly all of it importing torch: issue 53)."""


class _NotRaised(Exception):
    """Matches nothing: the stand-in for an error class whose module was never imported."""


def _checkpoint_error() -> type[Exception]:
    """``checkpoint.CheckpointError`` where ``oppo.checkpoint.store`` was imported (only then can it
    have been raised), else :class:`_NotRaised`: importing it here would import torch for every command."""
    mod = sys.modules.get(f"{__package__}.checkpoint.store")
    return mod.CheckpointError if mod is not None else _NotRaised


def _train(argv: list[str]) -> int:
    """PPO on your models, or on the built-in task (prepared on first use); progress, then a summary."""
    shown, source = None, ""
    if {"-h", "--help"} & set(argv):  # the settings' help shows the values of the recipe / --config given
        first = argparse.ArgumentParser(add_help=False)
        first.add_argument("--recipe")
        first.add_argument("--config")
        known = first.parse_known_args(argv)[0]
        if (known.recipe and known.recipe != "list") or known.config:
            shown = load_config(known.config, recipe=known.recipe if known.recipe != "list" else None)
            source = " and ".join(s for s in (known.recipe and f"recipe {known.recipe!r}",
                                              known.config and f"config {known.config}") if s)
    p = argparse.ArgumentParser(
        prog="oppo train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="PPO-based RLHF. With no models named, trains on the built-in task (prepared on first use).\n"
                    "Each run gets its own directory, runs/<date>-<time>-<mode>/, and runs/latest points to the\n"
                    "newest; with run.out_dir=DIR the run directory is DIR, which must not hold another run.",
        epilog=help_text(shown, source))
    p.add_argument("--recipe", help="Start from a shipped recipe (a config for a known public setup: models, data, "
                                    "sizes); --config and section.key=value apply on top. 'list' (or `oppo recipes`) "
                                    "lists them.")
    p.add_argument("--config", help="YAML file of settings (sections as below).")
    p.add_argument("--resume", help="Continue a run: 'auto' for the latest checkpoint of run.out_dir (with the "
                                    "default, the newest run), or a checkpoint or run directory. The settings must "
                                    "be the checkpoint's, and run.steps beyond its step.")
    p.add_argument("--print-config", action="store_true",
                   help="Print the settings this command line resolves to (the recipe, then --config, then the "
                        "overrides, and the built-in task's preset) as a YAML file --config takes, and exit.")
    p.add_argument("overrides", nargs="*", help="section.key=value settings, applied after --config.")
    args = p.parse_intermixed_args(argv)  # settings may come before and after --resume / --config
    if args.recipe == "list":
        return _recipes([])
    # parsed here; validated, with every input, by the run's one check (setup.check), before any model loads
    cfg = load_config(args.config, args.overrides, recipe=args.recipe)
    if args.print_config:
        print(config_yaml(cfg), end="")
        return 0
    from .run import train

    train(cfg, resume=args.resume)  # (it prints the run's summary: done, reward, run directory)
    return 0


def config_yaml(cfg) -> str:
    """``cfg`` as the YAML file ``--print-config`` writes. The built-in task's presets that
    ``load_config`` applied (``config.TASK_PRESETS``: learning rates and steps for its tiny models)
    are written as comments, not as the user's own values: ``--config`` with that file applies them
    again where no ``policy.path`` is named, and with one's own model gives the defaults, as the
    Python API does (``inputs._drop_task_presets``). Written as plain values, a file made with no model
    named kept the tiny models' ``ppo.actor_lr`` of 1e-4, ten times the default, for one's own model
    (issue 53). A preset the command line set itself is the user's: written plainly."""
    import yaml

    from .config import to_dict

    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    presets = cfg.__dict__.get("_presets") or {}
    if not presets:
        return text
    task = cfg.data.task
    lines, section = [], ""
    for line in text.splitlines(keepends=True):
        if line[:1].isalpha():
            section = line.split(":", 1)[0]
        name = line[2:].split(":", 1)[0] if line.startswith("  ") and not line.startswith("   ") else ""
        if name and f"{section}.{name}" in presets:
            line = (f"  # {line[2:].rstrip()}  # the built-in task {task!r}'s preset: applied where no "
                    f"policy.path is named; with one, the default\n")
        lines.append(line)
    shown = ", ".join(f"{k}={v}" for k, v in presets.items())
    print(f"oppo: the built-in task {task!r}'s presets ({shown}) are written as comments: --config applies them "
          f"again only where no policy.path is named (one's own model gets the defaults).", file=sys.stderr)
    return (f"# Settings for the built-in task {task!r} (no policy.path). Its presets are the commented lines\n"
            f"# marked 'preset': they apply only to the built-in task's models.\n" + "".join(lines))


def _recipes(argv: list[str]) -> int:
    """The shipped recipes (oppo train --recipe NAME), one line each: what each trains."""
    argparse.ArgumentParser(prog="oppo recipes", description="List the shipped recipes.").parse_args(argv)
    from . import recipes

    print(recipes.listing())
    return 0


def _prepare(argv: list[str]) -> int:
    """Build the built-in task's tiny SFT policy and reward model (cached; `train` does it when needed)."""
    p = argparse.ArgumentParser(prog="oppo prepare", description="Build the built-in task's tiny models (cached).")
    p.add_argument("--task", default="positive")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="Rebuild even if a valid cache exists.")
    args = p.parse_args(argv)
    from .task import prepare

    prepared = prepare(task=args.task, seed=args.seed, force=args.force)
    print(f"prepared {args.task}: {prepared.root}")
    return 0


def _report(argv: list[str]) -> int:
    """Pictures (PNG) of one or more run directories: reward, KL, timeline, lengths, overlap."""
    p = argparse.ArgumentParser(prog="oppo report", description="Pictures (PNG) of one or more training runs.")
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--out", default=None, help="Output directory (default: RUN_DIR/report).")
    args = p.parse_args(argv)
    from pathlib import Path

    from .report import make_report

    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "report"
    for path in make_report([Path(d) for d in args.run_dirs], out):
        print(path)
    return 0


def _bench(argv: list[str]) -> int:
    """The same workload in every overlap mode, side by side: step times, speedups, pictures."""
    from .bench import main as bench_main

    return bench_main(argv)


def _plan(argv: list[str]) -> int:
    """Simulate the PPO step per mode: fit costs from bench traces, check them, project GPU clusters."""
    from .plan.cli import main as plan_main

    return plan_main(argv)


COMMANDS = {"train": _train, "recipes": _recipes, "prepare": _prepare, "report": _report, "bench": _bench, "plan": _plan}


def usage() -> str:
    """The command list, one line each (from each command's docstring)."""
    width = max(map(len, COMMANDS))
    lines = ["usage: oppo COMMAND [options]   (oppo COMMAND --help for its options)", "", "commands:"]
    for name, fn in COMMANDS.items():
        doc = (fn.__doc__ or "").strip().splitlines()
        lines.append(f"  {name:<{width}}  {doc[0] if doc else ''}")
    return "\n".join(lines)


def _terminate_like_ctrl_c() -> None:
    """SIGTERM (``kill``, a job scheduler) and Ctrl-C (SIGINT): during training, the step in
    progress finishes, a checkpoint is written and the command exits 143 / 130
    (``run.STOP``, ``run.Preempted``); elsewhere, or on a second signal, it is interrupted at
    once: ``finally`` blocks run, so the trace of the steps so far is saved, the scorer worker stops
    and a half-built cache or checkpoint is removed. (SIGKILL runs nothing; the scorer worker's child exits
    on its own, see ``scoring/worker.py``.)"""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        from .run import STOP

        if STOP.request(signum):
            doing = ("writing the final checkpoint (all steps are done)" if STOP.final else
                     "finishing this step, then writing a checkpoint")
            print(f"\noppo: {signal.Signals(signum).name}: {doing} (a second signal stops at once, without one)",
                  file=sys.stderr)
            return
        raise KeyboardInterrupt(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _interrupted(e: KeyboardInterrupt, command: str) -> int:
    """The message and exit status (128 + the signal) of an interrupted command: what was saved."""
    import signal

    from .run import STOP, Preempted

    signum = e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT
    if isinstance(e, Preempted):
        print(f"\noppo: {e}", file=sys.stderr)
        return 128 + e.signum
    said = "oppo: interrupted"
    if command == "train" and STOP.run_dir is not None:
        from .checkpoint import checkpoint_step, latest_checkpoint
        from .run import holds_run

        ckpt = latest_checkpoint(STOP.run_dir)
        said += (f"; no checkpoint was written by this stop. The run's last checkpoint is {ckpt} (step "
                 f"{checkpoint_step(ckpt)}); continue with: oppo train --resume {STOP.run_dir} (and the same "
                 f"settings)." if ckpt is not None else
                 f" before its first step finished; nothing was trained, and what it had written in "
                 f"{STOP.run_dir} was removed: start the run again." if not holds_run(STOP.run_dir) else
                 f"; no checkpoint was written, and {STOP.run_dir} holds none: start the run again without "
                 f"--resume, in a fresh run.out_dir (or delete {STOP.run_dir} first).")
    elif command == "train":
        said += " before training began; nothing was trained or saved."
    print(f"\n{said}", file=sys.stderr)
    return 128 + signum


def main(argv: list[str] | None = None, *, signals: bool | None = None) -> int:
    """Run the command ``argv`` (default: this process's arguments). ``signals``: SIGTERM and Ctrl-C
    stop a run at a step boundary (:func:`_terminate_like_ctrl_c`); by default only for the ``oppo``
    command itself (``argv`` None), not for a call from Python, whose signals are the caller's. A
    script that runs a command as its own process passes True (``examples/trl_ppo.py``)."""
    if argv is None if signals is None else signals:
        _terminate_like_ctrl_c()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        asked = bool(argv) and argv[0] in ("-h", "--help")
        if argv and not asked:
            print(f"oppo: unknown command {argv[0]!r}", file=sys.stderr)
        print(usage(), file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    try:
        if argv[0] not in LIGHT:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        return COMMANDS[argv[0]](argv[1:]) or 0
    except KeyboardInterrupt as e:
        return _interrupted(e, argv[0])
    except ConfigError as e:
        print(f"oppo: config error: {e}", file=sys.stderr)
        return 2
    except _checkpoint_error() as e:  # (evaluated when an exception gets here: no import of torch before)
        print(f"oppo: checkpoint error: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:
        print(f"oppo: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        found = non_finite(e) or _child_died(e) or broken_companion(e)
        if found is None:
            raise
        print(f"oppo: error: {found}", file=sys.stderr)  # (a run's resume line is printed by run.train)
        return 1


COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def broken_companion(e: BaseException) -> str | None:
    """What to do when ``e`` (an OSError, ImportError or RuntimeError) was raised inside
    torchvision, torchaudio or torchcodec, which transformers imports when they are installed: a
    wheel built for another torch (pip took a CUDA torch, or a PyPI torchaudio, beside the CPU
    build) fails to load its library (``undefined symbol``, ``libnvrtc.so``, ``operator
    torchvision::nms does not exist``), and everything fails far from the cause. None otherwise."""
    import traceback

    if not isinstance(e, (OSError, ImportError, RuntimeError)):
        return None
    files = [f.filename.replace("\\", "/") for f in traceback.extract_tb(e.__traceback__)]
    found = next((name for f in reversed(files) for name in COMPANIONS if f"/{name}/" in f), None)
    if found is None:
        return None
    have, index = "the installed torch", "https://download.pytorch.org/whl/cpu"
    try:
        import torch

        have = f"torch {torch.__version__}"
        if torch.version.cuda:
            index = f"https://download.pytorch.org/whl/cu{torch.version.cuda.replace('.', '')}"
    except Exception:  # noqa: BLE001 (torch itself may be what is broken)
        pass
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    return (f"importing {found} failed ({type(e).__name__}: {first}): transformers imports it when it is installed, "
            f"and this {found} was built for another torch than {have}. oppo needs neither torchvision nor "
            f"torchaudio: pip uninstall -y torchvision torchaudio torchcodec; or install the builds that match "
            f"your torch from {index} (pip install torchvision torchaudio --index-url {index}).")


def _child_died(e: BaseException):
    """``e`` if a child process of the run died (the scorer process, vLLM's engine): its message
    names the process, its pid and signal; the CLI prints it, not a traceback."""
    for module, name in (("oppo.scoring.worker", "ScorerDied"), ("oppo.rollout.vllm.checks", "VLLMEngineDied")):
        mod = sys.modules.get(module)  # (not imported: e cannot be one)
        if mod is not None and isinstance(e, getattr(mod, name)):
            return e
    return None


def non_finite(e: BaseException):
    """The guard's ``NonFiniteError`` behind ``e`` (itself, or the cause of the scorer worker's, a Ray
    actor's or a learner rank's failure), or None: the CLI prints its message, not a traceback."""
    from .guard import NonFiniteError

    seen = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        inner = getattr(cur, "cause", None)  # a Ray task error's own exception (its str is a traceback)
        if isinstance(inner, BaseException):
            cur = inner
        elif isinstance(cur, NonFiniteError):
            return cur
        else:
            cur = cur.__cause__ or cur.__context__
    return None


if __name__ == "__main__":
    sys.exit(main())
