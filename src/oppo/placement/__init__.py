"""Where roles run. This package places them on Ray (``shared/DESIGN.md`` section 4).

- :mod:`.specs`: how a role's model is loaded wherever it runs (a path, a dtype, a device), so
  that models travel as a few strings, never as pickled weights;
- :mod:`.cluster`: joining a Ray cluster, or starting a local one (or a local multi-node one);
- :mod:`.ray_scorer`: the streaming scorers (reward, reference, critic) in Ray actors, behind a
  handle with the methods of :class:`oppo.scoring.worker.ScorerWorker`;
- :mod:`.dp`: the learner as a data-parallel group of Ray actors (``torch.distributed``: gloo on
  CPU, NCCL on GPU) whose update equals one learner's, and the weight sync to the rollout side;
- :mod:`.ray_rollout`: rollout workers, N policy engines in Ray actors behind the engine's
  interface, streaming their chunks straight to the scorer actors;
- :mod:`.weight_sync`: weights to the rollout side, through Ray's object store as numpy views, or
  streamed in buckets over a ``torch.distributed`` group of their own (gloo or NCCL), versioned.

Nothing here imports Ray at import time: ``ray`` is an optional dependency (the ``ray`` extra).
"""
