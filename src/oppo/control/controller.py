"""The run's overlap controller built from the config (:func:`build_controller`). The controllers
and their Protocol (:class:`~oppo.scheduler.OverlapController`) live together in ``oppo.scheduler``:

Two controllers implement it: :class:`oppo.scheduler.tuner.OverlapTuner` (``overlap.delta_rule=cost``, the
default: Delta and the chunk chosen by measured cost, with the online planner predicting where a
Delta ladder is tuned for groups of one) and :class:`oppo.scheduler.ChunkSizeTuner` (the OPPO
paper's rules, ``delta_rule=reward_slope``: the chunk timed online; Delta set by the scheduler's
:class:`~oppo.scheduler.DeltaController` from the reward's slope). The controller loop asks every
one the same things (:class:`OverlapController`) and never which one it holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import modes
from ..plan.online import OnlinePlanner
from ..scheduler import ChunkSizeTuner, DeltaController, DeltaRule, OverlapController, StepTiming
from ..scheduler.tuner import OverlapTuner, Setting, TunedDelta, delta_ladder

if TYPE_CHECKING:
    from ..config import OverlapConfig


def build_controller(overlap: OverlapConfig, batch_size: int, group_size: int, steps: int, streams: bool,
                     in_flight: bool) -> tuple[OverlapController, int | DeltaRule]:
    """The run's overlap controller and the scheduler's Delta (a fixed one, or the rule that moves
    it), from the ``overlap`` section, B (``ppo.batch_size``), G (the group size in effect) and the
    run's ``steps`` (``run.steps``). ``streams``/``in_flight``: the mode streams chunks / trains while
    decoding (whether it carries: ``overlap.mode``'s row of the mode table). The adaptive bounds are
    derived once and never exceed B (in groups: B / G)."""
    o, B, G = overlap, batch_size, group_size
    carries = modes.get(o.mode).carries
    dmax = min(o.delta_max, B // G)
    dmin = min(o.delta_min, dmax)
    adaptive = carries and o.delta < 0
    if adaptive and o.delta_rule == "reward_slope":  # the OPPO paper's rules
        rule = DeltaController(min(max(o.delta_init, dmin), dmax), dmin, dmax, o.delta_window, o.delta_proportional)
        return ChunkSizeTuner(tuple(c for c in o.chunk_candidates if c), o.trial_steps, o.retune_every,
                              fixed=o.chunk_size or None), rule
    deltas = delta_ladder(dmin, dmax) if adaptive else ((o.delta if carries else 0),)
    chunks = ((o.chunk_size,) if o.chunk_size else tuple(o.chunk_candidates)) if streams else (0,)
    tuner = OverlapTuner(deltas, chunks, trial_steps=o.trial_steps, retune_every=o.retune_every,
                         margin=o.tune_margin, max_stale_share=o.max_stale_share, in_flight=in_flight,
                         steps=steps)
    if len(deltas) == 1:
        return tuner, deltas[0]
    if G == 1:  # the planner predicts Delta from the run's own steps (plan/online.py)
        planner = OnlinePlanner(B, o.max_lag)
        tuner.predictor = planner.predict
        tuner.learner = lambda setting, ran: _teach(planner, setting, ran)
    return tuner, TunedDelta(tuner)


def _teach(planner: OnlinePlanner, setting: Setting, ran: StepTiming) -> None:
    planner.observe(setting, ran.seconds, list(ran.lengths), ran.decode_steps, ran.generate_s)
