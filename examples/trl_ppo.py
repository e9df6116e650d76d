"""TRL's PPO example script (``examples/scripts/ppo/ppo.py``, TRL 1.x), on oppo's Python API.

It takes TRL's command-line arguments, so a TRL command line runs with ``python`` and this file in
place of TRL's script::

    python examples/trl_ppo.py \\
        --dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style \\
        --dataset_train_split descriptiveness --output_dir runs/pythia-ppo \\
        --per_device_train_batch_size 64 --gradient_accumulation_steps 1 --total_episodes 10000 \\
        --model_name_or_path EleutherAI/pythia-1b-deduped --missing_eos_penalty 1.0

Each argument becomes an oppo setting by the table in ``oppo.from_trl`` (``docs/from-trl.md``);
the everyday ``TrainingArguments`` oppo has no setting for (``--logging_steps``, ``--eval_strategy``,
``--push_to_hub``, ...) are accepted and named once, with the reason; booleans take Hugging Face's
syntax (``--bf16``, ``--bf16 False``). As TRL does, the run is TRL's on-policy loop
(``overlap.mode=sequential``; ``--oppo overlap.mode=oppo`` for oppo's overlap), a causal LM given as
``--reward_model_path`` gets a fresh one-label head (``reward.new_head``: its rewards are random, as
in TRL's own quick-start), and the trained model ends up in ``--output_dir`` itself (as TRL's
``save_model``), beside oppo's run files. What differs from TRL's script: the tokenizer is the
policy's (``--sft_model_path``), every prompt is trained (TRL holds the last 100 out for its
completions table), and an existing ``--output_dir`` is refused, not deleted. ``--oppo
section.key=value`` sets any other oppo setting.

It runs as ``oppo train`` does (:func:`main`): Ctrl-C or SIGTERM finishes the step, writes a
checkpoint and exits 130 / 143; the same command line plus ``--resume OUTPUT_DIR`` (TRL's
``--resume_from_checkpoint``) continues. A long step prints a line a minute; errors are one
message, naming the TRL flags typed.
"""

from __future__ import annotations

import argparse
import math
import shutil
import signal
import sys
import threading
from pathlib import Path

from oppo import from_trl

# TRL's defaults (PPOConfig and the TrainingArguments it extends, TRL 1.12)
TRL_DEFAULTS = {
    "learning_rate": 3e-6, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
    "num_mini_batches": 1, "num_ppo_epochs": 4, "kl_coef": 0.05, "kl_estimator": "k1", "cliprange": 0.2,
    "cliprange_value": 0.2, "vf_coef": 0.1, "gamma": 1.0, "lam": 0.95, "response_length": 53,
    "temperature": 0.7, "whiten_rewards": False, "local_rollout_forward_batch_size": 64,
    "num_sample_generations": 10, "num_train_epochs": 3.0, "seed": 42, "save_steps": 500.0,
    "warmup_steps": 0, "max_grad_norm": 1.0, "weight_decay": 0.0, "sft_model_path": "EleutherAI/pythia-160m",
    "reward_model_path": "EleutherAI/pythia-160m",
}
# accepted, with no oppo setting (from_trl says why when one is given)
NO_SETTING = ("vf_coef", "whiten_rewards", "local_rollout_forward_batch_size", "num_sample_generations",
              "stop_token_id")
# everyday TrainingArguments / ScriptArguments / ModelConfig flags with no oppo meaning: accepted and
# named once (flag -> what oppo does instead)
IGNORED = {
    "logging_steps": "every step's metrics go to metrics.jsonl (and to TensorBoard or W&B when asked)",
    "logging_first_step": "every step's metrics go to metrics.jsonl",
    "eval_strategy": "there is no evaluation pass; reward.judge scores every step's responses as judge/mean",
    "eval_steps": "there is no evaluation pass",
    "dataset_test_split": "there is no evaluation pass: only --dataset_train_split is read",
    "push_to_hub": "oppo does not upload; the model is saved in --output_dir: upload it with "
                   "`hf upload <repo> <output_dir>`",
    "hub_model_id": "oppo does not upload (see --push_to_hub)",
    "lora_dropout": "oppo's LoRA has no dropout setting (lora.r, lora.alpha, lora.target_modules)",
    "save_strategy": "checkpoints follow run.save_every / run.save_every_minutes; --save_steps maps to run.save_every",
    "save_total_limit": "the newest run.keep_checkpoints checkpoints are kept",
    "run_name": "the run is named by --output_dir",
    "dataset_num_proc": "oppo tokenizes the prompts itself, in one process",
    "attn_implementation": "oppo picks the attention kernel for its packed rows",
    "model_revision": "give a local directory, or the hub name at its default revision",
    "fp16": "float16 is refused by oppo (no loss scaling); policy.dtype=auto is bfloat16 on CUDA",
}
FLAGS = ("use_peft", "whiten_rewards", "bf16", "fp16", "gradient_checkpointing", "trust_remote_code", "push_to_hub",
         "logging_first_step")


def hf_bool(text: str) -> bool:
    """Hugging Face's bool syntax: ``--flag`` alone is true; ``--flag true|false|yes|no|1|0``."""
    v = str(text).strip().lower()
    if v in ("true", "yes", "y", "1", "t"):
        return True
    if v in ("false", "no", "n", "0", "f"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    # ScriptArguments
    add("--dataset_name", required=True, help="Prompt set: hub name, local file or directory (field 'prompt').")
    add("--dataset_config", default=None, help="A hub dataset's configuration (not supported by oppo: refused).")
    add("--dataset_train_split", default="train")
    # ModelConfig
    add("--model_name_or_path", default=None, help="TRL's tokenizer source; oppo uses the policy's tokenizer.")
    add("--dtype", "--torch_dtype", dest="dtype", default=None, choices=[None, "auto", "float32", "bfloat16", "float16"])
    add("--lora_r", type=int, default=16)
    add("--lora_alpha", type=int, default=32)
    add("--lora_target_modules", nargs="*", default=None)
    for flag in FLAGS:  # --flag, --flag True, --flag false (HfArgumentParser's syntax)
        add(f"--{flag}", type=hf_bool, nargs="?", const=True, default=False)
    for name in IGNORED:
        if name not in FLAGS:
            add(f"--{name}", default=None)
    # PPOConfig / TrainingArguments
    add("--output_dir", required=True)
    add("--sft_model_path", default=TRL_DEFAULTS["sft_model_path"])
    add("--reward_model_path", default=TRL_DEFAULTS["reward_model_path"])
    add("--total_episodes", type=int, default=None)
    add("--num_train_epochs", type=float, default=TRL_DEFAULTS["num_train_epochs"])
    for name in ("learning_rate", "kl_coef", "cliprange", "cliprange_value", "vf_coef", "gamma", "lam",
                 "temperature", "save_steps", "max_grad_norm", "weight_decay"):
        add(f"--{name}", type=float, default=TRL_DEFAULTS[name])
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches",
                 "num_ppo_epochs", "response_length", "local_rollout_forward_batch_size",
                 "num_sample_generations", "seed", "warmup_steps"):
        add(f"--{name}", type=int, default=TRL_DEFAULTS[name])
    add("--kl_estimator", default="k1", choices=["k1", "k3"])
    add("--missing_eos_penalty", type=float, default=None)
    add("--stop_token", default=None, choices=[None, "eos"])  # eos: oppo's own (a response ends at EOS)
    add("--stop_token_id", type=int, default=None)
    add("--report_to", nargs="*", default=[])
    add("--resume", "--resume_from_checkpoint", dest="resume", default=None, metavar="DIR",
        help="Continue a stopped run: the --output_dir (or 'auto', or one of its checkpoints), with the same flags.")
    add("--oppo", action="append", default=[], metavar="SECTION.KEY=VALUE", help="Any other oppo setting.")
    return p.parse_args(argv)


def overrides(a: argparse.Namespace, n_prompts: int | None = None) -> list[str]:
    """The oppo settings for TRL's arguments ``a`` (``n_prompts``: the prompt count, needed for
    the run's length when ``--total_episodes`` is not given)."""
    if a.dataset_config:
        raise SystemExit(f"--dataset_config {a.dataset_config}: oppo reads a dataset's default configuration only; "
                         f"save the configuration you want with datasets' save_to_disk and give its directory.")
    batch = a.per_device_train_batch_size * a.gradient_accumulation_steps * a.num_mini_batches
    episodes = a.total_episodes
    if episodes is None:
        if n_prompts is None:
            raise SystemExit("give --total_episodes (or the prompt count, to run --num_train_epochs epochs)")
        episodes = int(a.num_train_epochs * n_prompts)
    out = [
        f"policy.path={a.sft_model_path}", f"reward.path={a.reward_model_path}",  # critic: from the reward model
        f"data.prompts={a.dataset_name}", "data.field=prompt", f"data.split={a.dataset_train_split}",
        f"ppo.batch_size={batch}", f"ppo.minibatch_size={batch // a.num_mini_batches}",
        f"ppo.micro_batch_size={a.per_device_train_batch_size}", f"ppo.epochs={a.num_ppo_epochs}",
        f"ppo.actor_lr={a.learning_rate}", f"ppo.critic_lr={a.learning_rate}", f"ppo.kl_coef={a.kl_coef}",
        f"ppo.kl_estimator={a.kl_estimator}", f"ppo.clip_eps={a.cliprange}", f"ppo.value_clip_eps={a.cliprange_value}",
        f"ppo.gamma={a.gamma}", f"ppo.lam={a.lam}", f"ppo.max_grad_norm={a.max_grad_norm}",
        f"ppo.weight_decay={a.weight_decay}", f"ppo.lr_warmup_steps={a.warmup_steps}",
        f"generation.max_new_tokens={a.response_length}", f"generation.temperature={a.temperature}",
        f"run.steps={max(1, math.ceil(episodes / batch))}", f"run.seed={a.seed}", f"run.out_dir={a.output_dir}",
        f"run.save_every={int(a.save_steps)}",
        "overlap.mode=sequential",  # TRL's loop: on-policy, stage after stage (--oppo overlap.mode=oppo to overlap)
        "reward.new_head=true",  # TRL loads the reward model with a fresh one-label head where it has none
    ]
    if a.missing_eos_penalty is not None:
        out.append(f"ppo.missing_eos_penalty={a.missing_eos_penalty}")
    if a.bf16 or a.dtype == "bfloat16":
        out.append("policy.dtype=bfloat16")
    elif a.dtype == "float32":
        out.append("policy.dtype=float32")  # (float16 and auto: oppo's auto, named by notes)
    if a.trust_remote_code:
        out.append("policy.trust_remote_code=true")
    if a.gradient_checkpointing:
        out.append("policy.gradient_checkpointing=true")
    if a.use_peft:
        out += [f"lora.r={a.lora_r}", f"lora.alpha={a.lora_alpha}"]
        if a.lora_target_modules:
            out.append(f"lora.target_modules=[{', '.join(a.lora_target_modules)}]")
    out += [f"log.{sink}=true" for sink in ("tensorboard", "wandb") if sink in a.report_to]
    return out + a.oppo


def notes(a: argparse.Namespace) -> list[str]:
    """One line per given argument that oppo has no setting for (from oppo.from_trl's table)."""
    lines = [from_trl.BY_NAME[n].says(getattr(a, n)) for n in NO_SETTING
             if getattr(a, n) != TRL_DEFAULTS.get(n) and n in from_trl.BY_NAME]
    lines += [f"--{n} {'' if getattr(a, n) is True else getattr(a, n)}".rstrip() + f": no oppo setting: {why}"
              for n, why in IGNORED.items() if getattr(a, n) not in (None, False)]
    if a.dtype == "float16":
        lines.append("--dtype float16: oppo refuses float16 (no loss scaling); it runs policy.dtype=auto: "
                     "bfloat16 on CUDA, float32 on CPU")
    if a.model_name_or_path and a.model_name_or_path != a.sft_model_path:
        lines.append(f"--model_name_or_path {a.model_name_or_path}: oppo loads the tokenizer with the policy, "
                     f"from --sft_model_path {a.sft_model_path}")
    return lines


# The oppo settings the port sets from TRL's flags, and the flags that set them: oppo's messages
# (errors, the line that says how to resume) are shown with these, the flags the user typed.
FLAG_OF = {
    "policy.path": "--sft_model_path", "reward.path": "--reward_model_path", "data.prompts": "--dataset_name",
    "data.split": "--dataset_train_split", "ppo.micro_batch_size": "--per_device_train_batch_size",
    "ppo.epochs": "--num_ppo_epochs", "ppo.actor_lr": "--learning_rate", "ppo.critic_lr": "--learning_rate",
    "ppo.kl_coef": "--kl_coef", "ppo.kl_estimator": "--kl_estimator", "ppo.clip_eps": "--cliprange",
    "ppo.value_clip_eps": "--cliprange_value", "ppo.gamma": "--gamma", "ppo.lam": "--lam",
    "ppo.max_grad_norm": "--max_grad_norm", "ppo.weight_decay": "--weight_decay",
    "ppo.lr_warmup_steps": "--warmup_steps", "generation.max_new_tokens": "--response_length",
    "generation.temperature": "--temperature", "run.seed": "--seed", "run.out_dir": "--output_dir",
    "run.save_every": "--save_steps", "ppo.missing_eos_penalty": "--missing_eos_penalty",
    "policy.trust_remote_code": "--trust_remote_code", "policy.gradient_checkpointing": "--gradient_checkpointing",
    "lora.r": "--lora_r", "lora.alpha": "--lora_alpha", "lora.target_modules": "--lora_target_modules",
    # set from several flags: named beside oppo's setting
    "ppo.batch_size": "--per_device_train_batch_size x --gradient_accumulation_steps x --num_mini_batches",
    "ppo.minibatch_size": "--per_device_train_batch_size x --gradient_accumulation_steps",
    "run.steps": "--total_episodes / the batch",
}


def in_flags(text: str, a: argparse.Namespace, prog: str = "examples/trl_ppo.py") -> str:
    """``text`` (a message of oppo's) in the port's terms: an oppo setting set from a TRL flag is
    named by the flag (``policy.path='x'`` -> ``--sft_model_path 'x'``; one set from several flags
    keeps its name and says which), except where the user set it with ``--oppo``; and the command
    that continues a run is this script's, with ``--resume``."""
    import re

    own = {o.partition("=")[0].strip() for o in a.oppo}
    text = re.sub(r"oppo train --resume (\S+) \(and the same settings\)",
                  rf"python {prog} with the same flags and --resume \1", text)
    for key in sorted(FLAG_OF, key=len, reverse=True):
        if key in own:
            continue
        flag = FLAG_OF[key]
        pattern = rf"(?<![\w.-]){re.escape(key)}(?![\w])(=)?"
        if " " in flag:  # several flags
            text = re.sub(pattern + r"(\S*)", lambda m: f"{key}{m.group(1) or ''}{m.group(2)} (from {flag})"
                          if m.group(1) else f"{key} (from {flag})", text)
        else:
            text = re.sub(pattern, lambda m: f"{flag} " if m.group(1) else flag, text)
    return text


class _InFlags:
    """A text stream that writes what it is given :func:`in_flags` (``sys.stderr`` during the run:
    oppo's errors, stop and resume lines, in the flags the user typed)."""

    def __init__(self, stream, a: argparse.Namespace) -> None:
        self._stream, self._a = stream, a

    def write(self, text: str) -> int:
        return self._stream.write(in_flags(text, self._a))

    def __getattr__(self, name: str):  # flush, isatty, fileno, encoding: the stream's own
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    """Train as ``oppo train`` does (``oppo.cli.main``): SIGTERM or Ctrl-C finishes the step, writes a
    checkpoint and exits 143 / 130 with the command that continues (``--resume``); a long step says
    where it is (``oppo.run.heartbeat``); errors are oppo's one-line messages, not a traceback, with
    the TRL flags in place of the oppo settings they set. Returns the exit status."""
    from oppo import cli

    a = parse_args(argv)
    stderr, sys.stderr = sys.stderr, _InFlags(sys.stderr, a)  # (restored below)
    try:
        try:
            n_prompts = None
            if a.total_episodes is None:  # TRL's default: num_train_epochs over the prompts
                from oppo.data import read_prompts

                n_prompts = len(read_prompts(a.dataset_name, "prompt", a.dataset_train_split))
            settings = overrides(a, n_prompts)
        except (ValueError, FileNotFoundError) as e:
            print(f"trl_ppo: error: {e}", file=sys.stderr)
            return 2
        for line in notes(a):
            print(f"trl_ppo: {line}", file=sys.stderr)
        resume = ["--resume", "auto" if a.resume.lower() in ("auto", "true") else a.resume] if a.resume else []
        # `oppo train`'s own command: the same run loop, signal handling, progress and messages
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            rc = cli.main(["train", *settings, *resume], signals=True)
        finally:  # (main() called from Python: the caller's handlers again)
            if threading.current_thread() is threading.main_thread():
                for signum, handler in handlers.items():
                    if handler is not None:  # (None: not set from Python)
                        signal.signal(signum, handler)
    finally:
        sys.stderr = stderr
    if rc == 0 and save_model(Path(a.output_dir), _steps(settings)):
        print(f"trl_ppo: the trained model is in {a.output_dir} (as TRL's save_model leaves it)", file=sys.stderr)
    return rc


def _steps(settings: list[str]) -> int:
    """run.steps among ``settings`` (the last one given)."""
    return int([s for s in settings if s.replace(" ", "").startswith("run.steps=")][-1].partition("=")[2])


def save_model(run_dir: Path, steps: int) -> bool:
    """The final checkpoint's policy (weights, config, tokenizer; a LoRA run's adapter) copied to the
    top of the run directory, where TRL's ``trainer.save_model(output_dir)`` writes it. False where
    the run saved no final checkpoint (``run.save_final=none``)."""
    from oppo.checkpoint import checkpoint_step, latest_checkpoint

    ckpt = latest_checkpoint(Path(run_dir))
    if ckpt is None or checkpoint_step(ckpt) != steps:
        return False
    for f in (ckpt / "policy").iterdir():
        if f.is_file():
            shutil.copy2(f, Path(run_dir) / f.name)
    return True


if __name__ == "__main__":
    sys.exit(main())
