"""Packed forwards on oppo's variable-length attention (``oppo.kernels.varlen``, issue 50): sequence
offsets instead of a 4-D mask, transformers' packed-sequence detection (and its host read) never
run, the kernel chosen by what the installed torch and flash-attn offer (their CUDA calls driven
here through stand-ins of their signatures), the CPU stand-in equal to a dense block-diagonal mask,
gradient checkpointing recomputing on the same path, and a model that cannot take offsets kept on
today's packed mask, said once. Exactness on every architecture: ``test_architectures.py``
(``test_packed_forward_equals_each_sequence_alone``, gradients included)."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch

from oppo.kernels import varlen
from oppo.forward import RowLayout, LayoutRule, packed_hidden, layout_rule
from oppo.models import backbone_and_head, load_causal_lm

CPU = torch.device("cpu")
OFFSETS = (0, 5, 6, 13, 16)  # segments of 5, 1, 7 and 3 positions


def _qkv(seed: int = 0, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    N = OFFSETS[-1]
    return (torch.randn(N, heads, dim, generator=g), torch.randn(N, kv_heads, dim, generator=g),
            torch.randn(N, kv_heads, dim, generator=g))


def _dense(q, k, v, offsets, scale=None, window=None, softcap=None):
    """The obvious reference: every query against every key of the row in float64, one
    block-diagonal causal (banded) mask, KV heads repeated."""
    q, k, v = (x.double() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    seg = torch.repeat_interleave(torch.arange(len(offsets) - 1), torch.tensor(offsets).diff())  # [N]
    i = torch.arange(len(seg))
    keep = (seg[:, None] == seg[None]) & (i[:, None] >= i[None])
    if window is not None:
        keep &= i[:, None] - i[None] < window
    w = torch.einsum("qhd,khd->hqk", q, k) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    w = w.masked_fill(~keep, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", w, v).float()


@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (None, 5.0), (3, 5.0)])
def test_stand_in_equals_a_block_diagonal_mask(window, softcap):
    q, k, v = _qkv()
    got = varlen.stand_in(q, k, v, OFFSETS, 0.3, window, softcap)
    torch.testing.assert_close(got, _dense(q, k, v, OFFSETS, 0.3, window, softcap), atol=1e-5, rtol=1e-5)


def _fake_213(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
              window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.13's ``varlen_attn`` signature, computed by the stand-in (the CUDA kernel's contract)."""
    assert window_size[1] == 0 and (enable_gqa or key.shape[1] == query.shape[1])
    assert max_q == max_k == max(cu_seq_q.diff().tolist())
    _fake_213.seen = dict(window_size=window_size, enable_gqa=enable_gqa)
    return varlen.stand_in(query, key, value, tuple(cu_seq_q.tolist()), scale,
                           window_size[0] + 1 if window_size[0] >= 0 else None)


def _fake_211(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=None, window_size=(-1, -1)):
    """torch 2.11's: no grouped KV heads."""
    assert key.shape[1] == query.shape[1], "torch 2.11 takes as many KV heads as query heads"
    return varlen.stand_in(query, key, value, tuple(cu_seq_q.tolist()), scale,
                           window_size[0] + 1 if window_size[0] >= 0 else None)


@pytest.mark.parametrize("fake", [_fake_213, _fake_211], ids=["torch2.13", "torch2.11"])
def test_torch_varlen_is_called_as_the_installed_signature_allows(monkeypatch, fake):
    monkeypatch.setattr(varlen, "_torch_varlen", lambda: (fake, inspect.signature(fake).parameters))
    monkeypatch.setattr(varlen, "_flash_attn", lambda: None)
    assert varlen.kernel("cuda", torch.bfloat16, 4, None)[0] == "torch"
    q, k, v = _qkv(1)
    cu = torch.tensor(OFFSETS, dtype=torch.int32)
    for window in (None, 3):
        got = varlen._run_torch(q, k, v, cu, 7, 0.3, window, groups=2)
        torch.testing.assert_close(got, _dense(q, k, v, OFFSETS, 0.3, window), atol=1e-5, rtol=1e-5)
    if fake is _fake_213:
        assert _fake_213.seen == dict(window_size=(2, 0), enable_gqa=True)


def test_kernel_choice_falls_back_in_order(monkeypatch):
    monkeypatch.setattr(varlen, "_torch_varlen", lambda: (_fake_213, inspect.signature(_fake_213).parameters))
    monkeypatch.setattr(varlen, "_flash_attn", lambda: None)
    assert varlen.kernel("cpu", torch.bfloat16, None, None)[0] == "stand-in"  # CUDA kernels only
    assert varlen.kernel("cuda", torch.float32, None, None)[0] == "stand-in"  # half precision only
    assert varlen.kernel("cuda", torch.bfloat16, None, None)[0] == "torch"
    name, why = varlen.kernel("cuda", torch.bfloat16, None, 50.0)  # a soft cap: not torch's
    assert name == "stand-in" and "soft cap" in why and "flash_attn is not installed" in why
    monkeypatch.setattr(varlen, "_flash_attn", lambda: object())
    assert varlen.kernel("cuda", torch.bfloat16, None, 50.0)[0] == "flash_attn"
    monkeypatch.setattr(varlen, "_torch_varlen", lambda: (_fake_211, inspect.signature(_fake_211).parameters))
    assert varlen.kernel("cuda", torch.float16, 4, None)[0] == "torch"  # 2.11 has window_size
    monkeypatch.setattr(varlen, "_torch_varlen", lambda: None)
    assert varlen.kernel("cuda", torch.float16, None, None)[0] == "flash_attn"


@pytest.fixture(scope="module")
def backbone(tiny_models):
    return backbone_and_head(load_causal_lm(str(tiny_models["policy"]), "policy", CPU, torch.float32))[0]


def _layout_inputs(plan: LayoutRule, lengths=(5, 1, 7, 3)):
    g = torch.Generator().manual_seed(2)
    source = torch.randint(3, 20, (sum(lengths),), generator=g)
    first = torch.tensor((0,) + tuple(torch.tensor(lengths).cumsum(0)[:-1].tolist()))
    return plan.layout(list(lengths)), source, first


def test_packed_forward_builds_no_mask_and_runs_no_packed_detection(backbone, monkeypatch):
    """transformers' detection reads the device (``.all()`` on a device tensor) once per forward:
    on the varlen path it never runs, and the numbers are the packed mask's."""
    import transformers.masking_utils as mu

    plan = layout_rule(backbone)  # (its probe runs the mask path too)
    found = []
    real = mu.find_packed_sequence_indices
    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda p: found.append(1) or real(p))
    assert plan.varlen and plan.packed and plan.attention_cost == 0.0
    layout, source, first = _layout_inputs(plan)
    assert layout.rows == 1 and layout.varlen and layout.offsets() == (0, 5, 6, 13, 16)
    with torch.no_grad():
        got = packed_hidden(backbone, layout, source, first)
        assert not found and backbone.config._attn_implementation == "oppo_varlen:sdpa"  # (the alias stays)
        mask_layout, _, _ = _layout_inputs(LayoutRule(True))  # the same row on transformers' packed mask
        want = packed_hidden(backbone, mask_layout, source, first)
    assert found  # (the count can fail: the mask path detects)
    for s, n, t in zip(layout.start, layout.lengths, mask_layout.start):  # each sequence's states, wherever it sits
        torch.testing.assert_close(got[s:s + n], want[t:t + n], atol=1e-5, rtol=1e-5)


def test_gradient_checkpointing_recomputes_on_the_varlen_path(backbone):
    """A checkpointed layer recomputes in the backward with the forward's arguments: the offsets
    (on CUDA that runs on autograd's own thread, so nothing may hang on the calling one)."""
    from oppo.models import checkpointing, enable_gradient_checkpointing

    plain = copy.deepcopy(backbone).requires_grad_(True)
    ckpt = copy.deepcopy(backbone).requires_grad_(True)
    enable_gradient_checkpointing(ckpt)
    layout, source, first = _layout_inputs(layout_rule(plain))
    assert layout_rule(ckpt).varlen
    grads = []
    for model in (plain, ckpt):
        with checkpointing(model):
            loss = packed_hidden(model, layout, source, first).square().sum()
        before = varlen.calls[0]
        loss.backward()
        assert (varlen.calls[0] > before) == (model is ckpt)  # (recomputed on the varlen path)
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_the_alias_leaves_other_forwards_as_they_were(backbone):
    """Decode and streamed chunks (a cache, a 2-D or 4-D mask) on a model put on the alias get the
    aliased path's own masks and numbers, bit for bit."""
    from transformers import DynamicCache

    layout_rule(backbone)
    assert backbone.config._attn_implementation == "oppo_varlen:sdpa"
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    outs = []
    for on in (True, False):
        varlen.use(backbone, on)
        with torch.no_grad():
            cache = DynamicCache(config=backbone.config)
            a = backbone(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).last_hidden_state
            b = backbone(input_ids=ids[:, :1], attention_mask=torch.cat([mask, mask[:, :1]], 1), past_key_values=cache,
                         use_cache=True).last_hidden_state
        outs.append((a, b))
    varlen.use(backbone)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_a_model_whose_attention_takes_no_offsets_keeps_the_packed_mask(backbone):
    """A backbone that passes no keyword arguments on (remote code often does not) cannot take
    sequence offsets: it keeps transformers' packed mask, said once, and still packs."""

    class NoKwargs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.config = backbone, backbone.config

        def forward(self, input_ids, position_ids=None, use_cache=False):
            return self.inner(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache)

    model = NoKwargs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = layout_rule(model)
        assert layout_rule(model) is plan  # (found once)
    assert plan.packed and not plan.varlen
    assert len(caught) == 1 and "packed mask" in str(caught[0].message) and "TypeError" in str(caught[0].message)


def test_bucketed_padding_stays_inside_learned_positions():
    """Unpacked rows on a bucketed width: padding at the row's last real position, so a GPT-2 of
    18 positions takes a 17-token sequence in a row of 20 (an index error before) and gives the
    unbucketed numbers."""
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    model = GPT2Model(GPT2Config(vocab_size=40, n_positions=18, n_embd=16, n_layer=1, n_head=2)).eval()
    lengths = [17, 2]
    source = torch.randint(3, 40, (19,))
    first = torch.tensor([0, 17])
    wide = LayoutRule(False, buckets=True).layout(lengths)
    assert wide.width == 20 and int(wide.lay_out(source, first, 0)[1].max()) == 16
    with torch.no_grad():
        got = packed_hidden(model, wide, source, first).view(2, 20, -1)
        want = packed_hidden(model, LayoutRule(False).layout(lengths), source, first).view(2, 17, -1)
    torch.testing.assert_close(got[0, :17], want[0])
    torch.testing.assert_close(got[1, :2], want[1, :2])
    # packed on a wide row (the token ladder): the padding run stops at the longest sequence's last position
    many = [5, 3, 4] * 4  # 48 tokens, a row of 48 + 16 padding: positions would reach 15 < 18, so pad further
    row = LayoutRule(True, varlen=True).layout(many)
    wide = RowLayout(1, 64 + 20, row.start, row.lengths, True, varlen=True)
    src = torch.randint(3, 40, (48,))
    starts = torch.tensor(row.start)
    assert int(wide.lay_out(src, starts, 0)[1].max()) == 4
    with torch.no_grad():
        got = packed_hidden(model, wide, src, starts)  # (puts the model on its alias)
        alone = packed_hidden(model, LayoutRule(False).layout(many), src, starts).view(len(many), 5, -1)
    assert model.config._attn_implementation == "oppo_varlen:sdpa"
    for i, (s, n) in enumerate(zip(row.start, many)):
        torch.testing.assert_close(got[s:s + n], alone[i, :n], atol=1e-5, rtol=1e-5)
