"""``oppo plan``: a calibrated planner for the overlapped PPO step.

A discrete-event simulation of oppo's PPO steps per mode (``sequential``, ``intra``, ``inter``,
``oppo``) and placement (actor devices, scorer devices, data parallelism), fed with stage costs
that are either fitted from oppo's own traces or given by a roofline of a named GPU. It predicts
step time, each device's busy fraction and the speedup over ``sequential``.

Modules (pure Python and numpy; no torch, no models):

- ``lengths``: response-length models (log-normal with a cap: the tail heaviness is sigma);
- ``costs``: what one piece of work costs on one device (``LinearCosts`` fitted; ``Roofline``
  from spec-sheet figures and stated efficiencies);
- ``sim``: the simulator (``Workload``, ``Placement``, ``simulate``); admission and closing are
  decided by oppo's own scheduler (``oppo.scheduler``), so the schedule is the runtime's;
- ``calibrate``: replay measured ``oppo bench`` runs, fit the costs, compare predicted with
  measured speedups;
- ``project``: the OPPO paper's setting, one-at-a-time sensitivity, weak scaling;
- ``report`` and ``cli``: tables, pictures, the ``oppo plan`` command.
"""
