"""oppo.kernels.attention: the choice among SDPA paths as a pure function of injected measurements (the CUDA
branch driven on the CPU), torch's own cuDNN rule, the grouped-K/V path against transformers' copy,
and ppo.attention checked with the other settings."""

from __future__ import annotations

import pytest
import torch

from oppo.kernels import attention
from oppo.kernels.attention import GQA, REFERENCE, Measured
from validated import load_valid


def _m(first=10.0, steady=1.0, finite=True, err=1e-3) -> Measured:
    return Measured(first_ms=first, steady_ms=steady, finite=finite, max_err=err)


def test_decide_refuses_nan_and_unlike_math_and_weighs_first_calls():
    """The fastest path has NaN gradients: refused, named; one unlike the math path: refused; cuDNN
    refused before measuring; of the rest, a run's cost (first calls x shapes + steady x calls)
    decides, not the steady time alone; the math path only when every other is refused."""
    got = {REFERENCE: _m(50, 9.0, err=0.0),
           "oppo_sdpa_efficient": _m(5, 0.5, finite=False, err=float("nan")),  # fastest, NaN gradients
           GQA: _m(900, 1.0),               # faster steady, but a 0.9 s plan build per shape
           "sdpa": _m(5, 1.1),              # 24 * (5 + 499 * 1.1) < 24 * (900 + 499 * 1.0)
           "eager": _m(5, 0.8, err=0.4)}    # unlike the math path
    best, verdict = attention.decide(got, {"oppo_sdpa_cudnn": "cuDNN 90100 is older than 9.15.1"})
    assert best == "sdpa"
    assert verdict["oppo_sdpa_efficient"] == "refused: non-finite output or gradients"
    assert verdict["eager"].startswith(f"refused: differs from {REFERENCE} by 0.4")
    assert verdict["oppo_sdpa_cudnn"] == "refused: cuDNN 90100 is older than 9.15.1"
    assert verdict[GQA].startswith("first 900.0 ms, steady 1.00 ms")
    # the steady time alone would pick GQA: the first call is what tips it
    assert attention.decide(got, shapes=1, calls=10_000)[0] == GQA
    # every fast path refused (or failed): the math path, correct and slow; nothing ran: None
    only = {REFERENCE: _m(50, 9.0, err=0.0), GQA: "failed (RuntimeError: no kernel)", "sdpa": _m(err=float("nan"))}
    assert attention.decide(only) == (REFERENCE, attention.decide(only)[1])
    assert attention.decide({GQA: "failed (x)"})[0] is None


@pytest.mark.parametrize("version,cap,cuda,why", [
    (91500, (9, 0), "12.8", "older than 9.15.1"),    # CUDA 12 wheels: torch keeps cuDNN behind flash/efficient
    (90100, (9, 0), "13.0", "older than 9.15.1"),
    (91501, (9, 0), "13.0", None),                   # the H200 machine: torch 2.11 + CUDA 13, cuDNN 9.19
    (91900, (9, 0), "12.9", None),                   # minor 0 on CUDA 12: torch prefers it
    (91900, (10, 1), "12.9", "compute capability 10.1"),
    (91900, (8, 0), "13.0", "compute capability 8.0"),  # A100: never first in torch's order
    (None, (9, 0), "13.0", "no cuDNN"),
])
def test_cudnn_never_pinned_where_torch_would_not_choose_it(version, cap, cuda, why):
    """torch's ``check_prefer_cudnn_attention`` rule (sdp_utils.cpp) as a pure function."""
    got = attention.cudnn_refusal(version, cap, cuda)
    assert (got is None) if why is None else (why in str(got))
    assert attention.torch_prefers_cudnn(version, cap, cuda) == (why is None)
    assert "TORCH_CUDNN_SDPA_DEPRIORITIZED" in str(attention.cudnn_refusal(91900, (9, 0), "13.0", deprioritized=True))


def _policy(tiny_models):
    from oppo.models import load_causal_lm

    return load_causal_lm(str(tiny_models["policy"]), "policy", torch.device("cpu"), torch.float32)


def test_auto_with_injected_measurements_sets_the_choice_and_says_why(tiny_models):
    """The CUDA branch of ``auto`` on the CPU: cuDNN refused for its version and not measured, a fast
    path with NaN gradients refused, the choice set on every model and the log naming each verdict."""
    policy, other = _policy(tiny_models), _policy(tiny_models)
    asked: list[list[str]] = []

    def fake(model, rows, widths, paths, dtype=None):
        asked.append(paths)
        assert widths[0] % 128 == 64 and len(widths) == 3  # the check width, then ladder widths
        return {REFERENCE: _m(40, 8.0, err=0.0), GQA: _m(20, 1.5), "oppo_sdpa_efficient": _m(10, 1.0, finite=False)}

    said: list[str] = []
    got = attention.choose(policy, [other], "auto", 4, 640, said.append, measure_fn=fake,
                           cudnn_why="cuDNN 90100 is older than 9.15.1")
    assert got == GQA and asked == [[REFERENCE, GQA, "oppo_sdpa_efficient"]]  # cuDNN never measured
    assert all(m.config._attn_implementation == GQA for m in (policy, other))
    assert len(said) == 1 and "oppo_sdpa_cudnn: refused: cuDNN 90100" in said[0]
    assert "oppo_sdpa_efficient: refused: non-finite" in said[0]


def test_measure_times_first_calls_and_checks_against_math(tiny_models):
    """The real probe on the CPU (tiny model, fp32): every path finite and equal to the math path,
    a path that does not exist named with its error, the model left as it was."""
    policy = _policy(tiny_models)
    got = attention.measure(policy, 2, [24, 16], [GQA, "no_such_path"], repeats=1)
    for name in (GQA,):
        m = got[name]
        assert isinstance(m, Measured) and m.finite and m.max_err < 1e-4 and m.first_ms > 0 and m.steady_ms > 0
    assert REFERENCE not in got and "failed" in str(got["no_such_path"])
    assert policy.config._attn_implementation == "sdpa" and all(p.grad is None for p in policy.parameters())


def test_gqa_path_equals_repeat_kv_under_a_mask_without_copying(tiny_models, monkeypatch):
    """``oppo_sdpa_gqa`` on a GQA Llama (4 query heads, 2 K/V heads): a padded masked forward and a
    decode step against the KV cache under a mask equal transformers' ``sdpa`` (which copies K/V per
    head), and ``repeat_kv`` is never called on it."""
    import transformers.integrations.sdpa_attention as sdpa_mod

    policy = _policy(tiny_models)
    assert policy.config.num_key_value_heads < policy.config.num_attention_heads
    copies = {"n": 0}
    real_repeat = sdpa_mod.repeat_kv

    def counting(x, n):
        copies["n"] += n > 1
        return real_repeat(x, n)

    monkeypatch.setattr(sdpa_mod, "repeat_kv", counting)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    nxt = torch.tensor([[15], [16]])

    def run(path):
        attention.set_path(policy, path)
        copies["n"] = 0
        with torch.no_grad():
            first = policy(input_ids=ids, attention_mask=mask, use_cache=True)
            step = policy(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1),
                          past_key_values=first.past_key_values, use_cache=True)
        return first.logits, step.logits, copies["n"]

    ref_full, ref_step, ref_copies = run("sdpa")
    full, step, n = run(GQA)
    assert ref_copies > 0 and n == 0  # transformers copies K/V under a mask; the GQA path never does
    torch.testing.assert_close(full[1, 2:], ref_full[1, 2:], atol=1e-5, rtol=1e-5)  # (padding rows aside)
    torch.testing.assert_close(full[0], ref_full[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step, ref_step, atol=1e-5, rtol=1e-5)
    assert attention.takes_4d_mask(GQA)


def test_decode_path():
    """The masked forwards' path: transformers' sdpa and the paths that take no 4-D mask go to the
    grouped-K/V SDPA path; eager and oppo's SDPA paths stay."""
    assert attention.decode_path("sdpa") == GQA
    assert attention.decode_path("oppo_varlen") == GQA and attention.decode_path("flash_attention_2") == GQA
    assert attention.decode_path("eager") == "eager"
    assert attention.decode_path("oppo_sdpa_efficient") == "oppo_sdpa_efficient"


def test_attention_setting_checked_before_any_model(tmp_path):
    """ppo.attention=nonsense fails in the settings check, naming the setting and the choices; a hub
    kernel (org/repo) and every named path pass."""
    from oppo.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_valid(None, ["ppo.attention=nonsense", f"policy.path={tmp_path / 'absent'}"])
    msg = str(e.value)
    assert "ppo.attention='nonsense'" in msg and "oppo_sdpa_gqa" in msg and "flash_attention_2" in msg
    for ok in ("auto", "inherit", "sdpa", "eager", GQA, "oppo_sdpa_cudnn", "flex_attention", "flash_attention_3",
               "kernels-community/flash-attn3"):
        assert load_config(None, [f"ppo.attention={ok}"]).ppo.attention == ok
