"""The built-in tasks by name: ``get_task(name) -> Task``.

A ``Task`` is what the trainer needs to know about a built-in task -- how to draw prompts, how
long responses may get, how to score them -- and what ``prepare`` needs to build its models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from oppo.task import arith, positive

Tokens = tuple[str, ...]
Scorer = Callable[[list[str], list[str]], list[float]]


@dataclass(frozen=True)
class Task:
    """A built-in task. Frozen; make a ``positive`` variant with ``positive_task(params)``."""

    name: str
    description: str
    max_new_tokens: int
    """Default generation budget: long enough that the corpus tail is rarely truncated."""
    judge_function: str
    """Import path of ``judge`` as ``"module:function"``, for the trainer to load and log."""
    reward_function: str | None
    """``"module:function"`` of the rule reward, or None when a reward model gives the reward."""
    params: object | None
    """The task's generator knobs (a frozen dataclass with ``to_dict``), or None."""
    judge: Scorer = field(repr=False, compare=False)
    """Ground-truth scorer ``judge(prompts, responses) -> scores`` (for rule tasks: the reward)."""
    make_prompts: Callable[[int, int], list[str]] = field(repr=False, compare=False)
    examples: Callable[[int, int], list[tuple[Tokens, Tokens]]] = field(repr=False, compare=False)
    """``examples(n, seed)`` -> SFT (prompt tokens, response tokens), without special tokens."""
    vocabulary: Callable[[], list[str]] = field(repr=False, compare=False)
    """Every token the task's text uses (the tokenizer's vocabulary, before special tokens)."""
    accuracy_function: str | None = None
    """``"module:function"`` giving 1.0 per right answer and 0.0 otherwise, for tasks with one
    right answer (arith); the trainer logs its mean as ``task/accuracy``."""
    eval_disjoint: bool = True
    """Whether ``prepare`` keeps eval prompts out of the training prompts. False when the
    question space is too small for that (arith: 672 sums and differences in all), so eval
    prompts are fresh draws from the same distribution."""

    def prompts(self, n: int, seed: int = 0) -> list[str]:
        """``n`` prompts, deterministic in ``seed``."""
        return self.make_prompts(n, seed)

    @property
    def uses_reward_model(self) -> bool:
        return self.reward_function is None

    def params_dict(self) -> dict:
        p = self.params
        return p.to_dict() if p is not None and hasattr(p, "to_dict") else {}


def positive_task(params: positive.TaskParams | None = None) -> Task:
    """The ``positive`` task with the given corpus knobs (default: ``TaskParams()``)."""
    params = params or positive.TaskParams()

    def examples(n: int, seed: int) -> list[tuple[Tokens, Tokens]]:
        return [(ex.prompt_tokens, ex.response_tokens) for ex in positive.generate(n, seed, params)]

    return Task(
        name="positive",
        description="continue short reviews and notes; reward: positive sentiment (reward model)",
        max_new_tokens=(positive.DEFAULT_MAX_NEW_TOKENS if params == positive.TaskParams()
                        else positive.suggest_max_new_tokens(params)),
        judge=positive.judge,
        judge_function="oppo.task.positive:judge_score",
        reward_function=None,
        params=params,
        make_prompts=lambda n, seed: positive.make_prompts(n, seed, params),
        examples=examples,
        vocabulary=positive.vocabulary,
    )


def arith_task() -> Task:
    return Task(
        name="arith",
        description="answer small sums, differences and word counts; reward: exact answer (rule)",
        max_new_tokens=arith.MAX_NEW_TOKENS,
        judge=arith.reward,
        judge_function="oppo.task.arith:reward",
        reward_function="oppo.task.arith:reward",
        accuracy_function="oppo.task.arith:accuracy",
        params=None,
        make_prompts=arith.make_prompts,
        examples=lambda n, seed: arith.examples(n, seed),
        vocabulary=arith.vocabulary,
        eval_disjoint=False,
    )


TASKS: dict[str, Task] = {
    "positive": positive_task(),
    "arith": arith_task(),
}


def get_task(name: str) -> Task:
    """The built-in task called ``name``; ValueError (listing the known ones) otherwise."""
    try:
        return TASKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None
