"""TRL's PPO names and what each is in oppo: the one table behind the config's errors and
``docs/from-trl.md``.

A TRL user's first run names TRL's settings (``num_ppo_epochs=4``, ``vf_coef=0.1``). Spelling is a
poor guide to oppo's names (``vf_coef`` is one letter pair from ``kl_coef``, another operation), so
an unknown setting whose last component is a name here is answered with the conversion instead of a
guess: ``num_mini_batches=4 is ppo.minibatch_size = ppo.batch_size / 4``. The table covers TRL 1.x's
``PPOConfig`` fields, the ``PPOTrainer`` arguments and a few ``TrainingArguments`` every TRL config
inherits. ``docs/from-trl.md`` is generated from it (:func:`markdown_table`; a test keeps the two
equal). Imports nothing of oppo's, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TrlName:
    """One TRL name. ``is_`` says what it is in oppo, with ``{v}`` where the user's value goes
    (``N`` in the docs), or, starting "no setting: ", why there is none; ``keys``: the oppo settings
    it maps to or that come nearest."""

    name: str
    where: str  # "PPOConfig", "PPOTrainer" or "TrainingArguments"
    trl_default: str  # as TRL documents it ("" where it has none worth saying)
    keys: tuple[str, ...]
    is_: str

    def says(self, value: Any = None) -> str:
        """One sentence: ``name=value is ...`` (``name=N is ...`` without a value)."""
        v = "N" if value is None else str(value)
        lead = f"{self.name}={v}" if self.where != "PPOTrainer" else f"PPOTrainer's {self.name}"
        text = self.is_.format(v=v)
        if text.startswith(_NONE):
            return f"TRL's {lead} has no oppo setting: {text[len(_NONE):]}"
        return f"TRL's {lead} is {text}"


_NONE = "no setting: "

TABLE: tuple[TrlName, ...] = (
    # PPOConfig
    TrlName("num_ppo_epochs", "PPOConfig", "4", ("ppo.epochs",),
            "ppo.epochs={v} (oppo's default is 1)"),
    TrlName("num_mini_batches", "PPOConfig", "1", ("ppo.minibatch_size",),
            "ppo.minibatch_size = ppo.batch_size / {v} (oppo names the minibatch's size, not the count)"),
    TrlName("per_device_train_batch_size", "PPOConfig", "8", ("ppo.micro_batch_size", "ppo.batch_size"),
            "ppo.micro_batch_size={v} (sequences per forward/backward pass); TRL's rollout batch, "
            "{v} x gradient_accumulation_steps x num_mini_batches x processes, is ppo.batch_size"),
    TrlName("gradient_accumulation_steps", "PPOConfig", "1", ("ppo.minibatch_size",),
            "ppo.minibatch_size = ppo.micro_batch_size x {v} (oppo accumulates minibatch_size / "
            "micro_batch_size micro-batches per optimizer step)"),
    TrlName("kl_coef", "PPOConfig", "0.05", ("ppo.kl_coef",),
            "ppo.kl_coef={v} (empty: the algorithm's default, 0.05 for ppo)"),
    TrlName("kl_estimator", "PPOConfig", "k1", ("ppo.kl_estimator",),
            "ppo.kl_estimator={v} (k1 and k3 as in TRL, also k2 and abs; auto: k1 in the reward for ppo)"),
    TrlName("cliprange", "PPOConfig", "0.2", ("ppo.clip_eps",), "ppo.clip_eps={v}"),
    TrlName("cliprange_value", "PPOConfig", "0.2", ("ppo.value_clip_eps",), "ppo.value_clip_eps={v}"),
    TrlName("vf_coef", "PPOConfig", "0.1", ("ppo.critic_lr",),
            _NONE + "the critic trains with an AdamW and a gradient clip of its own, where a constant factor "
                    "on its loss changes next to nothing (Adam divides it out); weigh the critic's learning "
                    "with ppo.critic_lr"),
    TrlName("gamma", "PPOConfig", "1.0", ("ppo.gamma",), "ppo.gamma={v}"),
    TrlName("lam", "PPOConfig", "0.95", ("ppo.lam",), "ppo.lam={v}"),
    TrlName("whiten_rewards", "PPOConfig", "False", (),
            _NONE + "oppo does not whiten the per-token rewards; ppo.whiten_advantages (on, as TRL always "
                    "does) whitens the advantages"),
    TrlName("response_length", "PPOConfig", "53", ("generation.max_new_tokens",),
            "generation.max_new_tokens={v}"),
    TrlName("temperature", "PPOConfig", "0.7", ("generation.temperature",),
            "generation.temperature={v} (oppo's default is 1.0; as in TRL the log-probs use it too)"),
    TrlName("missing_eos_penalty", "PPOConfig", "None", ("ppo.missing_eos_penalty",),
            "ppo.missing_eos_penalty={v}"),
    TrlName("stop_token", "PPOConfig", "None", (),
            _NONE + "a response always ends at the tokenizer's EOS (TRL's stop_token='eos'); decoding on to "
                    "generation.max_new_tokens past it is not offered"),
    TrlName("stop_token_id", "PPOConfig", "None", (),
            _NONE + "a response ends at the tokenizer's eos_token_id or any of the model's "
                    "generation_config.eos_token_id; change those to change where it ends"),
    TrlName("local_rollout_forward_batch_size", "PPOConfig", "64", (),
            _NONE + "the rollout decodes the whole batch at once and the scorers take it as packed rows (or "
                    "chunk by chunk while it decodes); lower ppo.batch_size for less memory"),
    TrlName("total_episodes", "PPOConfig", "None", ("run.steps",),
            "run.steps = {v} / ppo.batch_size (oppo counts PPO steps, each of ppo.batch_size sequences)"),
    TrlName("num_sample_generations", "PPOConfig", "10", ("run.samples",),
            _NONE + "oppo prints run.samples sample responses at the start and at the end (not {v} times "
                    "during training); every step's metrics are in metrics.jsonl"),
    TrlName("exp_name", "PPOConfig", "", ("run.out_dir",),
            "run.out_dir=runs/{v} (the run's directory: metrics, trace, checkpoints)"),
    TrlName("reward_model_path", "PPOConfig", "", ("reward.path",), "reward.path={v}"),
    TrlName("sft_model_path", "PPOConfig", "", ("policy.path",), "policy.path={v}"),
    # TrainingArguments, which PPOConfig extends
    TrlName("output_dir", "TrainingArguments", "", ("run.out_dir",), "run.out_dir={v}"),
    TrlName("learning_rate", "TrainingArguments", "3e-6", ("ppo.actor_lr", "ppo.critic_lr"),
            "ppo.actor_lr={v} and ppo.critic_lr={v}, both (TRL's one optimizer trains the policy and the value "
            "model at one rate; oppo has an AdamW each, and a critic usually learns faster)"),
    TrlName("save_steps", "TrainingArguments", "500", ("run.save_every",), "run.save_every={v}"),
    TrlName("warmup_steps", "TrainingArguments", "0", ("ppo.lr_warmup_steps",), "ppo.lr_warmup_steps={v}"),
    TrlName("bf16", "TrainingArguments", "", ("policy.dtype",),
            "policy.dtype=bfloat16 (auto: bfloat16 on CUDA, float32 on CPU)"),
    TrlName("report_to", "TrainingArguments", "", ("log.tensorboard", "log.wandb"),
            "log.tensorboard=true and/or log.wandb=true (metrics.jsonl is always written)"),
    # PPOTrainer's arguments
    TrlName("args", "PPOTrainer", "", (), "the config: a YAML file (--config) plus section.key=value overrides"),
    TrlName("processing_class", "PPOTrainer", "", ("policy.path",),
            _NONE + "the tokenizer is loaded from policy.path, with the policy"),
    TrlName("model", "PPOTrainer", "", ("policy.path",), "policy.path (a local directory or a hub name)"),
    TrlName("ref_model", "PPOTrainer", "", ("reference.path",),
            "reference.path (empty: a frozen copy of the initial policy; with LoRA the policy's base)"),
    TrlName("reward_model", "PPOTrainer", "", ("reward.path", "reward.function"),
            "reward.path (a one-label ...ForSequenceClassification), or reward.function=module:function"),
    TrlName("value_model", "PPOTrainer", "", ("critic.path",),
            "critic.path (empty: the reward model's path, else the policy's, with a new value head)"),
    TrlName("train_dataset", "PPOTrainer", "", ("data.prompts", "data.field"),
            "data.prompts (text prompts in the field data.field; oppo tokenizes them itself)"),
    TrlName("data_collator", "PPOTrainer", "", (),
            _NONE + "oppo tokenizes, truncates (data.max_prompt_tokens) and packs the prompts itself"),
    TrlName("eval_dataset", "PPOTrainer", "", (),
            _NONE + "there is no evaluation pass; reward.judge scores every step's responses as judge/mean"),
    TrlName("optimizers", "PPOTrainer", "", ("ppo.actor_lr", "ppo.critic_lr"),
            _NONE + "actor and critic each train with AdamW: ppo.actor_lr, ppo.critic_lr, ppo.weight_decay, "
                    "ppo.lr_warmup_steps, ppo.max_grad_norm"),
    TrlName("callbacks", "PPOTrainer", "", (),
            _NONE + "metrics go to metrics.jsonl, and to TensorBoard or W&B with log.tensorboard or log.wandb"),
    TrlName("peft_config", "PPOTrainer", "", ("lora.r",),
            "lora.r, lora.alpha and lora.target_modules (peft LoRA on the policy)"),
)

BY_NAME = {t.name: t for t in TABLE}


def lookup(key: str) -> TrlName | None:
    """The TRL name ``key``'s last component is, or None (``ppo.num_mini_batches`` and
    ``num_mini_batches`` alike)."""
    return BY_NAME.get(key.rpartition(".")[2])


def markdown_table(where: str) -> str:
    """The rows of ``where``'s names ("PPOConfig", "PPOTrainer", "TrainingArguments") as a
    Markdown table: docs/from-trl.md holds these, generated (``python -m oppo.from_trl``)."""
    rows = ["| TRL | TRL default | oppo |", "|---|---|---|"]
    for t in TABLE:
        if t.where == where:
            rows.append(f"| `{t.name}` | {t.trl_default or '-'} | {t.is_.format(v='N')} |")
    return "\n".join(rows)


SECTIONS = ("PPOConfig", "PPOTrainer", "TrainingArguments")
BEGIN, END = "<!-- table:{} (generated: python -m oppo.from_trl docs/from-trl.md) -->", "<!-- end table -->"


def render(doc: str) -> str:
    """``doc`` with the text between each section's BEGIN and END markers replaced by its table."""
    for where in SECTIONS:
        begin = BEGIN.format(where)
        head, sep, rest = doc.partition(begin)
        if not sep:
            continue
        _, sep2, tail = rest.partition(END)
        doc = f"{head}{begin}\n{markdown_table(where)}\n{END}{tail if sep2 else rest}"
    return doc


if __name__ == "__main__":  # python -m oppo.from_trl docs/from-trl.md: rewrite the doc's tables
    import sys
    from pathlib import Path

    for arg in sys.argv[1:]:
        p = Path(arg)
        p.write_text(render(p.read_text()))
