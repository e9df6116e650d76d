"""The RL algorithms and their maths, in one home.

- ``ppo``, ``grpo``, ``rloo``, ``reinforce_pp``: one file per algorithm, its ``SPEC`` naming its
  advantage estimator, its policy loss, its defaults and settings;
- ``algorithms``: the registry (``register``, the ``oppo.algorithms`` entry points);
- ``core``: what they share (``Algorithm``, ``AlgorithmSpec``, ``KLPenalty``, ``ClippedTokenLoss``);
- the maths, pure and torch only: ``masks`` (masked reductions), ``losses`` (policy, value and KL
  losses, entropy), ``advantages`` (rewards, GAE, group baselines, whitening);
- ``stage``: the advantage stage (stages 4-5) on a batch;
- ``actor_loss``: the actor's loss of stage 6 composed (policy, KL, entropy) and the importance
  weights of off-policy tokens; the learner runs the forward, the backward and the step.

Importing this package does not import torch; running the maths does.
"""

from .algorithms import (ALGORITHMS, SPECS, algorithm_settings, build_algorithm, get_algorithm, get_spec, register,
                         unregister)
from .core import AdvantageResult, Algorithm, AlgorithmSpec, ClippedTokenLoss, KLPenalty, PolicyLoss

__all__ = ["ALGORITHMS", "SPECS", "AdvantageResult", "Algorithm", "AlgorithmSpec", "ClippedTokenLoss", "KLPenalty",
           "PolicyLoss", "algorithm_settings", "build_algorithm", "get_algorithm", "get_spec", "register",
           "unregister"]
