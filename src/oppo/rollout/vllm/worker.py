"""Code oppo runs inside vLLM's worker process (through ``collective_rpc``): an in-place reload in
checkpoint format, the sampler wrap that returns each sampled token's untruncated log-prob beside
the behaviour one, and the parent-death signal that ends vLLM's worker with the trainer
(``docs/vllm.md`` says why each is needed)."""

from __future__ import annotations

import os
import signal

import torch


def reload_in_worker(worker, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs in vLLM's worker process (``collective_rpc``): reload the model in place, in
    checkpoint format, so the CPU backend re-packs its weights as after a load."""
    worker.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    return len(weights)


UNTRUNCATED_ID = -1
"""The token id under which a request's log-probs hold its sampled token's untruncated log-prob
(docs/vllm.md, "Untruncated log-probs"): no real token has it."""


def untruncated_id(token: int) -> int:
    """The id under which a request's log-probs hold ``token``'s untruncated log-prob, for a
    token it listed (``logprob_token_ids``: the forced-length EOS): -2, -3, ...; no real token."""
    return -2 - token


class _UntruncatedSampler:
    """Replaces ``forward`` of vLLM's (V1) ``Sampler`` in its worker process: the sampler's own
    output, with one more log-prob column right after the sampled token's: the sampled token's
    ``log_softmax(logits / temperature)``, under the id :data:`UNTRUNCATED_ID`. Computed from
    the logits the sampler receives (the model's, before temperature, top-k and top-p: what the
    eager backend's ``policy_logprobs`` and the learner's forward use), before the sampler runs,
    since it divides them by the temperature in place."""

    def __init__(self, forward):
        self.inner = forward

    def __call__(self, logits: torch.Tensor, sampling_metadata, *args, **kwargs):
        temperature = sampling_metadata.temperature  # [R]; None when every request is greedy
        if temperature is None or logits.dim() != 2:
            return self.inner(logits, sampling_metadata, *args, **kwargs)
        scaled = logits.float() / temperature.float().clamp_min(1e-5)[:, None]  # [R, V]: a new tensor
        lse = scaled.logsumexp(-1)  # [R]
        out = self.inner(logits, sampling_metadata, *args, **kwargs)
        lp = out.logprobs_tensors
        if lp is None:
            return out
        tokens = out.sampled_token_ids[:, :1].long()  # [R, 1]
        untruncated = scaled.gather(1, tokens) - lse[:, None]  # [R, 1]
        ids, values = lp.logprob_token_ids, lp.logprobs  # [R, 1 + n]: the sampled token first
        listed = sampling_metadata.logprob_token_ids  # {row: ids} (forced lengths: EOS)
        if listed and ids.shape[1] > 1:
            # the listed tokens' log-probs untruncated too, under ids of their own: the forced EOS
            # is not drawn, and its truncated log-prob is -inf when top-k/top-p cut it
            rows = torch.tensor(sorted(listed), device=ids.device)
            cols = ids[rows, 1:].long()  # [L, n]
            ids, values = ids.clone(), values.clone()
            ids[rows, 1:] = (-2 - cols).to(ids.dtype)
            values[rows, 1:] = (scaled[rows].gather(1, cols) - lse[rows, None]).to(values.dtype)
        out.logprobs_tensors = lp._replace(
            logprob_token_ids=torch.cat([ids[:, :1], torch.full_like(ids[:, :1], UNTRUNCATED_ID), ids[:, 1:]], 1),
            logprobs=torch.cat([values[:, :1], untruncated.to(values.dtype), values[:, 1:]], 1))
        return out


def install_untruncated_sampler(worker) -> bool:
    """Runs in vLLM's worker process (``collective_rpc``): wrap its sampler (once). False where
    the model runner has no V1 ``Sampler`` to wrap."""
    from vllm.v1.sample.sampler import Sampler

    sampler = getattr(worker.model_runner, "sampler", None)
    if not isinstance(sampler, Sampler):
        return False
    if not isinstance(sampler.__dict__.get("forward"), _UntruncatedSampler):
        # (an instance attribute over the method: the wrapper is what the sampler's callers run)
        sampler.forward = _UntruncatedSampler(sampler.forward)  # type: ignore[method-assign]
    return True


# ------------------------------------------------------------------------------------- parent death


def die_with_trainer(worker, trainer_pid: int) -> bool:
    """Runs in vLLM's worker process (``collective_rpc``): have the kernel SIGKILL it when the
    thread that started it exits (docs/vllm.md, "Parent death"). False where it cannot: not Linux, or
    vLLM's worker is not ``trainer_pid``'s child."""
    from ...procs import kill_with_parent

    if os.getppid() != trainer_pid or not kill_with_parent():
        return False
    if os.getppid() != trainer_pid:  # the trainer died before the prctl: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)
    return True
