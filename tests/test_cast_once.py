"""Under bf16 the learner casts each fp32 master weight once per optimizer step, not once per
micro-batch (``weights.precision.cast_once``), and the update is the same as casting every time."""

from types import SimpleNamespace

import torch
from torch.profiler import profile

import oppo.learner.local as local
from oppo.config import PPOConfig
from oppo.weights.precision import autocast

MICRO = 4  # micro-batches per optimizer step


def _step(cast_once_on: bool, monkeypatch) -> tuple[int, list[torch.Tensor]]:
    """One optimizer step of ``MICRO`` micro-batches of a two-layer fp32 model under bf16 autocast
    (the learner's own loop); the number of dtype casts it ran, and the updated weights."""
    if not cast_once_on:
        monkeypatch.setattr(local, "cast_once", lambda device, dtype: local.autocast(device, torch.float32))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(MICRO, 16)

    def micro(rows, num_tokens, num_seqs):
        with autocast(x.device, torch.bfloat16):
            y = model(x[rows]).float().sum()
        y.backward()
        return {"loss/x": y.item(), "_frac": 1.0 / MICRO}

    cfg = PPOConfig(micro_batch_size=1, minibatch_size=MICRO, batch_size=MICRO, packing="off")  # (a bare batch: no lengths)
    with profile() as prof:
        local.train_minibatches(model, opt, SimpleNamespace(mask=torch.ones(MICRO, 1)), [torch.arange(MICRO)],
                                local.UpdateSettings.of(cfg, "actor"), "actor",
                     micro, compute_dtype=torch.bfloat16)
    casts = sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")
    return casts, [p.detach().clone() for p in model.parameters()]


def test_each_master_is_cast_once_per_optimizer_step(monkeypatch):
    once, w_once = _step(True, monkeypatch)
    every, w_every = _step(False, monkeypatch)
    n_params = 4  # two weights, two biases
    # the same inputs' casts either way; the parameters' once per step instead of once per micro-batch
    assert every - once == n_params * (MICRO - 1)
    for a, b in zip(w_once, w_every):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fp32_compute_opens_no_autocast_region():
    from oppo.weights.precision import cast_once

    with cast_once(torch.device("cpu"), torch.float32):
        assert not torch.is_autocast_enabled("cpu")
    with cast_once(torch.device("cpu"), torch.bfloat16):
        assert not torch.is_autocast_enabled("cpu")  # (open for the cache, disabled between the forwards)
        with autocast(torch.device("cpu"), torch.bfloat16):
            assert torch.is_autocast_enabled("cpu")


def test_fused_head_weight_is_cast_once_per_optimizer_step():
    """The fused head casts by hand outside autocast (``forward.head_logprobs``); inside one
    optimizer step (``cast_once``) its weight is cast once, not in every micro-batch's forward and
    backward."""
    import contextlib

    from oppo.forward import head_logprobs
    from oppo.weights.precision import cast_once

    def casts(region) -> int:
        torch.manual_seed(0)
        head = torch.nn.Linear(16, 48, bias=False)
        h, tok = torch.randn(2, 3, 16, requires_grad=True), torch.randint(0, 48, (2, 3))
        with profile(record_shapes=True) as prof:
            with region():
                for _ in range(MICRO):
                    with autocast(torch.device("cpu"), torch.bfloat16):
                        lp, _ = head_logprobs(head, h, tok)
                    lp.sum().backward()
        # [48, 16] casts: the weight's to bf16, and each micro-batch's bf16 weight gradient to fp32
        return sum(e.count for e in prof.key_averages(group_by_input_shape=True)
                   if e.key == "aten::_to_copy" and e.input_shapes and list(e.input_shapes[0]) == [48, 16])

    once = casts(lambda: cast_once(torch.device("cpu"), torch.bfloat16))
    every = casts(contextlib.nullcontext)
    assert every - once == MICRO - 1 and once == 1 + MICRO
