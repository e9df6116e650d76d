"""TRL's own PPOTrainer (trl.experimental.ppo, TRL 1.12) on local models, timed per update; run in
a venv with TRL installed (see README.md). Prints one JSON line: the seconds of each update."""

from __future__ import annotations

import argparse
import json
import time

from datasets import load_dataset
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          TrainerCallback)
from trl.experimental.ppo import PPOConfig, PPOTrainer


class Clock(TrainerCallback):
    """perf_counter at the start and after each update."""

    def __init__(self):
        self.marks: list[float] = []

    def on_train_begin(self, args, state, control, **kw):
        self.marks.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kw):
        self.marks.append(time.perf_counter())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--policy", required=True)
    p.add_argument("--reward", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--response_length", type=int, default=16)
    a = p.parse_args()

    tok = AutoTokenizer.from_pretrained(a.policy, padding_side="left")
    ds = load_dataset("json", data_files=a.prompts, split="train")
    ds = ds.map(lambda x: {"input_ids": tok(x["prompt"])["input_ids"]}, remove_columns=ds.column_names)
    args = PPOConfig(output_dir=a.out, per_device_train_batch_size=a.batch, gradient_accumulation_steps=1,
                     num_mini_batches=1, total_episodes=a.batch * a.steps, response_length=a.response_length,
                     stop_token="eos", missing_eos_penalty=1.0, num_sample_generations=0, report_to=[],
                     save_strategy="no", use_cpu=True, seed=0, logging_steps=1000)
    clock = Clock()
    trainer = PPOTrainer(args=args, processing_class=tok,
                         model=AutoModelForCausalLM.from_pretrained(a.policy),
                         ref_model=AutoModelForCausalLM.from_pretrained(a.policy),
                         reward_model=AutoModelForSequenceClassification.from_pretrained(a.reward, num_labels=1),
                         value_model=AutoModelForSequenceClassification.from_pretrained(a.reward, num_labels=1),
                         train_dataset=ds, eval_dataset=ds.select(range(4)), callbacks=[clock])
    trainer.train()
    steps = [b - a_ for a_, b in zip(clock.marks, clock.marks[1:])]
    print(json.dumps({"trainer": "trl", "step_s": steps}))


if __name__ == "__main__":
    main()
