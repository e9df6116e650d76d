"""Weights loaded into a model of this run (a resume): another shape refused in one line."""

from __future__ import annotations

import torch

from .errors import ModelLoadError


def _other_shapes(saved: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> str:
    """The first tensor of ``saved`` whose shape differs from ``own``'s, in words ("k is [..] there
    and [..] here", and how many more); "" when every shared name has the same shape."""
    bad = [(k, list(v.shape), list(own[k].shape)) for k, v in saved.items()
           if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if not bad:
        return ""
    k, there, here = bad[0]
    more = f" (and {len(bad) - 1} more parameters)" if len(bad) > 1 else ""
    return f"{k} is {there} there and {here} here{more}"



def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], source) -> None:
    """``model.load_state_dict(state)``, refusing first, in one line, a tensor of another shape
    (``source``: where ``state`` comes from, e.g. a checkpoint's ``policy/``): a resume onto a model
    of another size is otherwise torch's size-mismatch traceback of every parameter."""
    bad = _other_shapes(state, model.state_dict())
    if bad:
        raise ModelLoadError(f"{source} holds weights of another shape than this run's model: {bad}. Resume with "
                             f"the model the run started from (the checkpoint's config.json names its sizes), or "
                             f"start a new run without --resume to train this model.")
    model.load_state_dict(state)



def check_adapter_shapes(model, adapter: dict[str, torch.Tensor], source) -> None:
    """Refuse, in one line, a saved LoRA adapter (``source``: a checkpoint's ``policy/``; ``adapter``:
    its tensors, as ``peft.load_peft_weights`` gives them) whose tensors do not fit ``model``'s: a
    resume onto a base model of another shape is otherwise torch's size-mismatch traceback."""
    # (the saved names lack the adapter's name: peft's "....lora_A.default.weight" is saved as "....lora_A.weight")
    name = getattr(model, "active_adapter", "default")
    own = {k.replace(f".{name}.", ".").replace(f".{name}", ""): v for k, v in model.state_dict().items()}
    bad = _other_shapes(adapter, own)
    if bad:
        raise ModelLoadError(f"the LoRA adapter in {source} does not fit this run's base model: {bad}, so the base "
                             f"model at policy.path has "
                             f"another shape than the one the adapter was trained on. Resume with the base model "
                             f"the run started from, or start a new run without --resume to train this one.")
