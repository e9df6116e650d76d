"""How a role's model is loaded where the role runs: a path, a dtype, a device.

A Ray actor loads its own models from these specs (through the same loaders and checks as the
controller, :mod:`oppo.models`) instead of receiving pickled weights: loading the same directory
in the same dtype gives the same weights. The one exception is a freshly initialised head (a
critic started from a causal-LM checkpoint): its random init depends on the process's RNG, so
whoever needs identical weights sends them once (``RayScorerWorker.set_critic_weights``; the
learner group broadcasts rank 0's weights at start).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROLES = ("policy", "reference", "reward", "critic")


@dataclass(frozen=True)
class ModelSpec:
    """One role's model: ``role`` picks the loader (policy/reference: causal LM; reward: one-label
    classifier; critic: value model). ``device``: "auto" resolves where the model is loaded (in a
    Ray actor given a GPU, ``cuda``), or a torch device string. ``pad_id``: the policy
    tokenizer's pad id (reward and critic need it). ``packing``: ``ppo.packing`` for the model's
    one-shot forwards (``forward.set_packing``)."""

    role: str
    path: str
    dtype: torch.dtype = torch.float32
    device: str = "auto"
    pad_id: int | None = None
    trust_remote_code: bool = False
    packing: str = "auto"
    new_head: bool = False  # reward: a causal LM gets a fresh one-label head (reward.new_head)
    buckets: str = "auto"  # ppo.shape_buckets for its forwards (forward.set_packing)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"ModelSpec.role must be one of {ROLES}, got {self.role!r}")
        if self.role in ("reward", "critic") and self.pad_id is None:
            raise ValueError(f"ModelSpec for the {self.role} needs pad_id (the policy tokenizer's pad id)")

    def with_dtype(self, dtype: torch.dtype) -> "ModelSpec":
        return ModelSpec(self.role, self.path, dtype, self.device, self.pad_id, self.trust_remote_code, self.packing,
                         self.new_head, self.buckets)

    def load(self) -> torch.nn.Module:
        """The model, on its device, in its dtype. Frozen roles (reference, reward) come back in
        eval mode without gradients; trained ones (policy, critic) in eval mode (no dropout: rollout
        and training see the same function, as in the trainer)."""
        from ..forward import set_packing
        from ..models import load_causal_lm, load_critic, load_reward_model, resolve_device

        dev = resolve_device(self.device)
        if self.role in ("policy", "reference"):
            model = load_causal_lm(self.path, self.role, dev, self.dtype, self.trust_remote_code)
            if self.role == "reference":
                model.requires_grad_(False)
            model = model.eval()
        else:
            assert self.pad_id is not None  # (the reward and the critic have one: __post_init__)
            model = (load_reward_model(self.path, dev, self.dtype, self.pad_id, self.new_head) if self.role == "reward"
                     else load_critic(self.path, dev, self.dtype, self.pad_id).eval())
        set_packing(model, self.packing, self.buckets)
        return model
