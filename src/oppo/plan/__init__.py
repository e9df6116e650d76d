"""``oppo plan``: a calibrated planner for the overlapped PPO step."""
