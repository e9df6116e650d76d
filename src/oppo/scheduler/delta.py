"""Delta, the spare sequences in flight: the rule the scheduler reads before each step
(:class:`DeltaRule`) and the OPPO paper's reward-slope rule (:class:`DeltaController`)."""

from __future__ import annotations

from typing import Any, Protocol

from .records import check_int, check_reward, state_mismatch


class DeltaRule(Protocol):
    """What the scheduler needs of an adaptive Delta: the value for the next step, its bound, an
    ``after_step`` with the mean reward of each trained step, and a checkpointable state."""

    delta_max: int

    @property
    def delta(self) -> int: ...

    def after_step(self, mean_reward: float) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, d: dict[str, Any]) -> None: ...


class DeltaController:
    """Adaptive Delta by the reward-slope rule of the OPPO paper (``overlap.delta_rule=reward_slope``).

    ``after_step(R_t)`` is called once per step with the step's mean reward. With the last
    ``window`` differences ``d_i = R_i - R_{i-1}``, the slope is ``s_t = mean(d)``;
    ``s_t > 0`` -> ``Delta + step``, otherwise (flat or falling) ``Delta - step``; the result is
    clipped to ``[delta_min, delta_max]``. ``step`` is 1, or with ``proportional=True``
    ``max(1, floor(Delta / 4))`` computed from the current Delta. Until ``window`` differences
    exist (the first ``window`` calls) Delta stays at ``delta_init``.
    """

    def __init__(
        self,
        delta_init: int = 0,
        delta_min: int = 0,
        delta_max: int = 8,
        window: int = 5,
        proportional: bool = False,
    ) -> None:
        check_int("delta_min", delta_min, 0, "use 0 for 'no extra sequences'")
        check_int("delta_max", delta_max, 0, "use a non-negative bound")
        check_int("delta_init", delta_init, 0, "use a value in [delta_min, delta_max]")
        check_int("window", window, 1, "use a window of at least 1 reward difference")
        if delta_min > delta_max:
            raise ValueError(
                f"delta_min ({delta_min}) > delta_max ({delta_max}); swap them or lower delta_min"
            )
        if not delta_min <= delta_init <= delta_max:
            raise ValueError(
                f"delta_init ({delta_init}) must lie in [delta_min, delta_max] = "
                f"[{delta_min}, {delta_max}]; change delta_init or the bounds"
            )
        self.delta_min = delta_min
        self.delta_max = delta_max
        self.delta_init = delta_init
        self.window = window
        self.proportional = bool(proportional)
        self._delta = delta_init
        self._rewards: list[float] = []  # the last window + 1 mean rewards
        self._slope: float | None = None

    @property
    def delta(self) -> int:
        return self._delta

    @property
    def slope(self) -> float | None:
        """Slope computed by the last ``after_step`` (None until ``window`` differences exist)."""
        return self._slope

    def after_step(self, mean_reward: float) -> int:
        """Feed one step's mean reward; return the Delta for the next step."""
        self._rewards.append(check_reward(mean_reward, "mean_reward"))
        del self._rewards[: -(self.window + 1)]
        if len(self._rewards) < self.window + 1:
            return self._delta
        diffs = [b - a for a, b in zip(self._rewards, self._rewards[1:])]
        self._slope = sum(diffs) / self.window
        step = max(1, self._delta // 4) if self.proportional else 1
        new = self._delta + step if self._slope > 0 else self._delta - step
        self._delta = min(self.delta_max, max(self.delta_min, new))
        return self._delta

    def _config(self) -> dict[str, Any]:
        return {
            "delta_init": self.delta_init,
            "delta_min": self.delta_min,
            "delta_max": self.delta_max,
            "window": self.window,
            "proportional": self.proportional,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "config": self._config(),
            "delta": self._delta,
            "rewards": list(self._rewards),
            "slope": self._slope,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d["config"] != self._config():
            raise state_mismatch("DeltaController config", d["config"], self._config())
        delta = check_int("delta", d["delta"], 0, "the checkpoint is corrupt")
        if not self.delta_min <= delta <= self.delta_max:
            raise ValueError(f"checkpoint delta {delta} is outside [delta_min, delta_max]")
        self._delta = delta
        self._rewards = [check_reward(r, "checkpoint reward") for r in d["rewards"]]
        self._slope = None if d["slope"] is None else float(d["slope"])


