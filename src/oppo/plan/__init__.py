"""``oppo plan``: a calibrated planner for the overlapped PPO step.

A discrete-event simulation of oppo's PPO steps per mode (``pipeline`` included) and placement,
with GRPO/RLOO groups and refill, fed with stage costs either fitted from oppo's own traces or
given by a roofline of a named GPU. It predicts step time, each device's busy fraction and the
speedup over ``sequential``. Pure Python and numpy (no torch, no models): ``lengths``, ``costs``,
``sim``, ``calibrate``, ``inter``, ``project``, ``summary``, ``cli``, and ``online`` (the planner
inside a run).

Design notes (the modules, how far to trust it): docs/planner.md, "The modules"."""
