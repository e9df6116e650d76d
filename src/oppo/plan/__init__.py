"""``oppo plan``: a calibrated planner for the overlapped PPO step.

A discrete-event simulation of oppo's PPO steps per mode (``sequential``, ``intra``, ``inter``,
``oppo``, and ``pipeline``: the update beside the next step's decoding) and placement (actor
devices, scorer devices, data parallelism), with GRPO/RLOO groups (whole groups closed and
carried, ``partial_groups``) and refill, fed with stage costs that are either fitted from oppo's
own traces or given by a roofline of a named GPU. It predicts step time, each device's busy
fraction and the speedup over ``sequential``.

Modules (pure Python and numpy; no torch, no models):

- ``lengths``: response-length models (log-normal with a cap: the tail heaviness is sigma;
  measured lengths replayed; a measured sample redrawn);
- ``costs``: what one piece of work costs on one device (``LinearCosts`` fitted; ``Roofline``
  from spec-sheet figures and stated efficiencies);
- ``sim``: the simulator (``Workload``, ``DeviceSplit``, ``simulate``); admission and closing are
  decided by oppo's own scheduler (``oppo.scheduler``), so the schedule is the runtime's;
- ``calibrate``: replay measured runs (an ``oppo bench --tail`` sweep, or run directories with
  ``lengths.jsonl``), fit the costs, compare predicted with measured speedups;
- ``inter``: where inter-step overlap's time goes (a sequential/inter pair of traces), and the
  regime where it pays;
- ``project``: the OPPO paper's setting, one-at-a-time sensitivity, weak scaling;
- ``report`` and ``cli``: tables, pictures, the ``oppo plan`` command.

How far to trust it: ``oppo plan --calibrate`` fits and compares on the same tail-sweep runs
(in-sample; its "held out" column leaves one sigma out of the fit, still the same machine
session, and compares speed ratios only). The held-out validation is
``benchmarks/plan/heldout.py``: costs fitted on two natural-length runs, then other tails,
batch sizes, Delta, modes (pipeline included), GRPO groups, refill and a Ray placement
predicted from their settings before they are measured, with absolute-time errors and the
run-to-run spread (``benchmarks/plan/README.md``).
"""
