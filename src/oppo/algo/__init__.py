"""Algorithms beside PPO: critic-free advantage math (``advantages``, pure, torch only) and the
small ``Algorithm`` objects that say what each algorithm needs (``algorithms``)."""

from .algorithms import ALGORITHMS, Algorithm, algorithm_settings, get_algorithm

__all__ = ["ALGORITHMS", "Algorithm", "algorithm_settings", "get_algorithm"]
