"""The probe every loaded model passes: finite weights, causal attention, and oppo's head reading
what the model's own forward returns."""

from __future__ import annotations

import torch

from .arch import text_config
from .errors import ModelLoadError
from .heads import backbone_and_head


@torch.no_grad()
def verify_model(model, role: str, pad_token_id: int | None = None) -> None:
    """Check on a small probe input that oppo reads ``model`` as Hugging Face's own forward does.

    - causal: the hidden state at a position does not depend on later tokens (a model that
      attends both ways cannot be streamed or scored per token);
    - head: ``head(backbone(x))`` equals ``model(x).logits`` (a causal LM's logits at every
      position; a sequence classifier's score at the last token, which is what HF pools when
      there is no padding).
    Costs one forward of 8 tokens per role. Raises ModelLoadError naming the fix. The probe runs in
    eval mode (a model made or given in train mode would differ by its dropout masks, not by what
    it attends to); the model's mode is restored.
    """
    was_training = model.training
    model.eval()
    try:
        _verify(model, role, pad_token_id)
    finally:
        model.train(was_training)



def _verify(model, role: str, pad_token_id: int | None) -> None:
    params = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]
    finite = torch.stack([torch.isfinite(p).all() for _, p in params]).tolist() if params else []
    bad = [n for (n, _), ok in zip(params, finite) if not ok]
    if bad:
        raise ModelLoadError(
            f"The {role} model ({type(model).__name__}) has non-finite (NaN or inf) weights in {len(bad)} of "
            f"{len(params)} tensors, e.g. {', '.join(bad[:3])}: the checkpoint is corrupt or was saved from a "
            f"diverged run. Load another checkpoint (an earlier one of the run that wrote it).")
    backbone, head = backbone_and_head(model)
    device = next(model.parameters()).device
    vocab = int(text_config(model.config).vocab_size)
    g = torch.Generator().manual_seed(1234)
    # no pad token in the probe, neither the run's nor the model's own (a sequence classifier's forward
    # pools the last token that is not its config's pad: with one in the probe it would pool elsewhere)
    pads = {p for p in (pad_token_id, getattr(text_config(model.config), "pad_token_id", None)) if p is not None}
    ids = torch.randint(0, vocab, (1, 8), generator=g)
    for _ in range(len(pads)):
        for p in pads:
            ids[ids == p] = (p + 1) % vocab
    ids = ids.to(device)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % vocab
    while int(changed[0, -1]) in pads:
        changed[0, -1] = (changed[0, -1] + 1) % vocab
    name = type(model).__name__
    h = backbone(input_ids=ids).last_hidden_state.float()
    h2 = backbone(input_ids=changed).last_hidden_state.float()
    scale = h[0, :-1].abs().max().clamp(min=1.0)
    if not torch.allclose(h[0, :-1], h2[0, :-1], atol=1e-3 * float(scale), rtol=0):
        raise ModelLoadError(
            f"The {role} model ({name}) is not causal: its earlier hidden states change when a later token "
            f"changes (an encoder such as BERT or DeBERTa). PPO reads every role token by token, left to right; "
            f"use a decoder-only (causal LM) model for the {role}.")
    ours = head(backbone(input_ids=ids).last_hidden_state).float()  # [1, 8, V] or [1, 8, 1]
    theirs = model(input_ids=ids).logits.float()
    if theirs.dim() == 2:  # sequence classification: HF pools the last token
        ours = ours[:, -1]
    tol = (1e-4 if next(model.parameters()).dtype == torch.float32 else 2e-2) * float(theirs.abs().max().clamp(min=1))
    if ours.shape != theirs.shape or not torch.allclose(ours, theirs, atol=tol, rtol=0):
        gap = (ours - theirs).abs().max().item() if ours.shape == theirs.shape else float("nan")
        raise ModelLoadError(
            f"The {role} model ({name}) post-processes its outputs in a way oppo does not reproduce "
            f"(max gap {gap:.3g} between its forward and oppo's head on a probe input). Training on it would "
            f"use the wrong log-probs; please report the architecture.")
