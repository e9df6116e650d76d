"""Built-in tasks: generated, offline, with their own tokenizer, SFT policy and reward model.

- ``get_task(name) -> Task`` / ``TASKS``: ``"positive"`` (steer reviews and notes toward
  positive text; reward model) and ``"arith"`` (small verifiable questions; rule reward);
- ``prepare(task, home, seed, force, progress) -> Prepared``: build (once) and cache the task's
  tokenizer, SFT policy, reward model and prompt files under ``<home>/<task>/``.

See ``docs/task.md``.
"""

from oppo.task.prepare import PrepareSizes, Prepared, default_home, prepare, read_task_prompts
from oppo.task.registry import TASKS, Task, get_task, positive_task

__all__ = ["TASKS", "PrepareSizes", "Prepared", "Task", "default_home", "get_task",
           "positive_task", "prepare", "read_task_prompts"]
