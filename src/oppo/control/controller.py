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


from ..config import Config
from ..plan.online import OnlinePlanner
from ..scheduler import ChunkSizeTuner, DeltaController, DeltaRule, OverlapController, StepTiming
from ..scheduler.tuner import OverlapTuner, Setting, TunedDelta, delta_ladder


def build_controller(cfg: Config, streams: bool, in_flight: bool
                     ) -> tuple[OverlapController, int | DeltaRule]:
    """The run's overlap controller and the scheduler's Delta (a fixed one, or the rule that moves
    it). ``streams``/``in_flight``: the mode streams chunks / trains while decoding. The adaptive
    bounds are derived once and never exceed B (in groups: B / G)."""
    o, B, G = cfg.overlap, cfg.ppo.batch_size, cfg.group_size
    dmax = min(o.delta_max, B // G)
    dmin = min(o.delta_min, dmax)
    adaptive = cfg.carries and o.delta < 0
    if adaptive and o.delta_rule == "reward_slope":  # the OPPO paper's rules
        rule = DeltaController(min(max(o.delta_init, dmin), dmax), dmin, dmax, o.delta_window, o.delta_proportional)
        return ChunkSizeTuner(tuple(c for c in o.chunk_candidates if c), o.trial_steps, o.retune_every,
                              fixed=o.chunk_size or None), rule
    deltas = delta_ladder(dmin, dmax) if adaptive else ((o.delta if cfg.carries else 0),)
    chunks = ((o.chunk_size,) if o.chunk_size else tuple(o.chunk_candidates)) if streams else (0,)
    tuner = OverlapTuner(deltas, chunks, trial_steps=o.trial_steps, retune_every=o.retune_every,
                         margin=o.tune_margin, max_stale_share=o.max_stale_share, in_flight=in_flight,
                         steps=cfg.run.steps)
    if len(deltas) == 1:
        return tuner, deltas[0]
    if G == 1:  # the planner predicts Delta from the run's own steps (plan/online.py)
        planner = OnlinePlanner(B, o.max_lag)
        tuner.predictor = planner.predict
        tuner.learner = lambda setting, ran: _teach(planner, setting, ran)
    return tuner, TunedDelta(tuner)


def _teach(planner: OnlinePlanner, setting: Setting, ran: StepTiming) -> None:
    planner.observe(setting, ran.seconds, list(ran.lengths), ran.decode_steps, ran.generate_s)
