"""Algorithms: PPO, GRPO, RLOO and REINFORCE++, one file each (``ppo``, ``grpo``, ``rloo``,
``reinforce_pp``: the advantage estimator, the defaults, the Config settings it reads); what they
share (``core``: ``Algorithm``, ``KLPenalty``, ``AdvantageResult``, ``AlgorithmSpec``); the
registry by name (``algorithms``); and the critic-free advantage math (``advantages``, pure,
torch only). Importing this package does not import torch; running the math does."""

from .algorithms import ALGORITHMS, SPECS, algorithm_settings, build_algorithm, get_algorithm, get_spec
from .core import AdvantageResult, Algorithm, AlgorithmSpec, KLPenalty

__all__ = ["ALGORITHMS", "SPECS", "AdvantageResult", "Algorithm", "AlgorithmSpec", "KLPenalty", "algorithm_settings",
           "build_algorithm", "get_algorithm", "get_spec"]
