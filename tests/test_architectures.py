"""oppo's numbers equal Hugging Face's own forward on many architectures (issue 10).

For each architecture a tiny random model is built from its config (no hub), saved, and loaded
back through oppo's loaders, as a user's model is. The oracle is always the model's own Hugging
Face forward on ONE UNPADDED sequence ``model(input_ids=seq[None])``, never oppo's one-shot path.
With ``P`` the prompt length and ``a_t`` the response tokens:

    reference / learner / behaviour log-probs:  log_softmax(HF logits / T)[P+t-1, a_t]
    critic values:  model.score(HF hidden_states[-1])[P+t-1]  (its last entry is checked against
                    HF's own pooled logit, so the oracle is HF's and not a guess)
    reward score:   HF's pooled logit, i.e. at the last token (the pad id never occurs in a sequence)

The architectures are chosen for the places where oppo could go wrong by applying heads itself
or by padding and caching: logits post-processed outside ``lm_head`` (Gemma2 final softcap,
Cohere ``logit_scale``, Granite ``logits_scaling``), sliding-window attention (Mistral, window 4,
a third of most sequences here), learned absolute positions (GPT-2), partial rotary and
parallel residual (GPT-NeoX), fused qkv (Phi-3), qkv bias (Qwen2). The attention implementation
is whatever ``from_pretrained`` picks by default on CPU: sdpa, except eager for Gemma2 (sdpa
has no attention softcap). Gemma2's bf16 differences come out exactly 0: eager attention with
masked padding and the same per-row matmuls gives bitwise HF's numbers here.

Weights are initialised with std 0.2 (not the configs' 0.02) so that logits spread over several
units, as a trained model's do: with near-zero logits a missing softcap or logit scale would
change nothing measurable.

The max |oppo - HF| of every (architecture, path, dtype) is printed in a table at the end of
the module (shown without ``-s``).
"""

from __future__ import annotations

import copy
import random
import zlib
from dataclasses import dataclass

import pytest
import torch

import oppo.models
from oppo.config import PPOConfig
from oppo.learner.batch import build_experience
from oppo.learner.local import Learner
from oppo.models import ModelLoadError, load_causal_lm, load_critic, load_reward_model
from oppo.rollout.eager.backend import Rollout, EagerBackend
from oppo.forward import sequence_batch
from oppo.scoring.streaming import StreamingScorer, response_outputs, score_full

CPU = torch.device("cpu")
V, PAD, EOS = 96, 0, 1  # token ids 2..V-1 are ordinary; PAD never occurs inside a sequence
TEMP = 0.8

# Tolerances on max |oppo - HF| (log-probs in nats; values and scores in the head's units).
# fp32: padding, batching and the KV cache only change summation order; observed <= 5e-6.
# bf16: rounding under another summation order (padding, batch shape, cached vs one-shot;
#   sdpa's CPU kernel blocks by length) is not systematic but is visible on a 2-layer random
#   model with std-0.2 weights: observed max 0.042 (Qwen2 log-probs), over every architecture and
#   path where oppo is right. 0.1 is ~2.4x that. The systematic errors this file exists to catch
#   are far above it (measured on the unfixed source 747a8be, bf16 as fp32: Gemma2 final softcap
#   0.70, Cohere logit_scale 3.5, Granite logits_scaling 3.1, Mistral streamed with cache holes
#   0.46 to 2.3).
TOL = {"fp32": 1e-4, "bf16": 0.1}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Arch:
    config: str  # transformers class names
    causal: str
    seqcls: str
    kwargs: dict
    sliding: bool = False  # has sliding-window layers: streaming may refuse (see _check_streamed)


_LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=128)
ARCHS = {
    "llama": Arch("LlamaConfig", "LlamaForCausalLM", "LlamaForSequenceClassification", _LLAMA_LIKE),
    "qwen2": Arch("Qwen2Config", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification", _LLAMA_LIKE),
    "gpt2": Arch("GPT2Config", "GPT2LMHeadModel", "GPT2ForSequenceClassification",
                 dict(n_embd=32, n_layer=2, n_head=4, n_positions=128)),
    "mistral": Arch("MistralConfig", "MistralForCausalLM", "MistralForSequenceClassification",
                    dict(_LLAMA_LIKE, sliding_window=4), sliding=True),
    # Gemma2 alternates sliding (window left at its default 4096, never reached here) and full layers
    "gemma2": Arch("Gemma2Config", "Gemma2ForCausalLM", "Gemma2ForSequenceClassification",
                   dict(_LLAMA_LIKE, head_dim=8, query_pre_attn_scalar=8, final_logit_softcapping=5.0,
                        attn_logit_softcapping=5.0), sliding=True),
    "cohere": Arch("CohereConfig", "CohereForCausalLM", "CohereForSequenceClassification",
                   dict(_LLAMA_LIKE, logit_scale=0.25)),
    "granite": Arch("GraniteConfig", "GraniteForCausalLM", "GraniteForSequenceClassification",
                    dict(_LLAMA_LIKE, logits_scaling=4.0)),
    "gpt_neox": Arch("GPTNeoXConfig", "GPTNeoXForCausalLM", "GPTNeoXForSequenceClassification",
                     dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          max_position_embeddings=128)),
    "phi3": Arch("Phi3Config", "Phi3ForCausalLM", "Phi3ForSequenceClassification", _LLAMA_LIKE),
}

# One set of sequences for every scorer path. Mixed lengths: left padding of prompts and right
# padding of responses in every batch; four of the six sequences are over 3x Mistral's window.
PROMPT_LENS = (3, 1, 8, 5, 2, 6)
RESPONSE_LENS = (12, 1, 5, 9, 2, 7)
STREAM_CHUNKS = (1, 2, 5)  # each streamed round gives each row one of these chunk sizes, or nothing

MEASURED: dict[tuple[str, str, str], str] = {}  # (arch, path, dtype) -> max |diff| (printed at the end)
PATHS = ("ref_full", "ref_stream", "learner", "actor", "rollout", "reward_full", "reward_stream",
         "critic_full", "critic_stream")


def _data() -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(2, V) for _ in range(n)] for n in PROMPT_LENS]
    responses = [[rng.randrange(2, V) for _ in range(n)] for n in RESPONSE_LENS]
    for r in responses[::2]:
        r[-1] = EOS  # some responses end with EOS, as real ones do
    return prompts, responses


# ---------------------------------------------------------------------------------------------
# models, built once per module


def _class(name: str):
    import transformers

    return getattr(transformers, name, None)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread; two threads on a busy 2-core machine spin against
    other processes (measured: 2.3 ms vs 236 ms per forward). Restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    """``load(arch, role, dtype)``: the model of ``role`` (policy/reward/critic). fp32: written
    once from its config, loaded back through oppo's loaders as a user's model is. bf16: a copy
    of it cast with ``.to(torch.bfloat16)`` (what ``weights.serving_copy`` does)."""
    models: dict[tuple[str, str, str], torch.nn.Module] = {}

    def build(arch: str, role: str) -> torch.nn.Module:
        a = ARCHS[arch]
        cls = _class(a.causal if role == "policy" else a.seqcls)
        cfg = _class(a.config)(vocab_size=V, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=2,
                               initializer_range=0.2, num_labels=1, **a.kwargs)
        torch.manual_seed(zlib.crc32(f"{arch}-{role}".encode()))  # the same weights whatever runs first
        d = tmp_path_factory.mktemp(f"{arch}-{role}")
        cls(cfg).save_pretrained(d)
        if role == "policy":
            return load_causal_lm(str(d), "policy", CPU, torch.float32)
        if role == "reward":
            return load_reward_model(str(d), CPU, torch.float32, PAD)
        return load_critic(str(d), CPU, torch.float32, PAD)

    def get(arch: str, role: str, dtype: str) -> torch.nn.Module:
        if (arch, role, "fp32") not in models:
            models[arch, role, "fp32"] = build(arch, role).eval()  # as the trainer: no dropout (GPT-2 has some)
        if (arch, role, dtype) not in models:
            models[arch, role, dtype] = copy.deepcopy(models[arch, role, "fp32"]).to(DTYPES[dtype]).eval()
        return models[arch, role, dtype]

    return get


def _version() -> str:
    import transformers

    return transformers.__version__


# ---------------------------------------------------------------------------------------------
# Hugging Face oracles: one unpadded sequence at a time, the model's own forward


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], response: list[int], temperature: float = TEMP) -> torch.Tensor:
    """[T] log_softmax(logits / T) at each response token, from HF's own CausalLM forward."""
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float() / temperature  # [P+T, V]
    P = len(prompt)
    return torch.log_softmax(logits, -1)[P - 1:-1].gather(-1, torch.tensor(response)[:, None])[:, 0]


@torch.no_grad()
def hf_values(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """[T] the score head at the state before each response token (P+t-1)."""
    out = model(input_ids=torch.tensor([prompt + response]), output_hidden_states=True)
    values = model.score(out.hidden_states[-1])[0, :, 0].float()  # [P+T]
    # hidden_states[-1] is what HF's own head reads: its pooled logit is the last position's value
    torch.testing.assert_close(values[-1], out.logits[0, 0].float(), atol=0, rtol=0)
    return values[len(prompt) - 1:-1]


@torch.no_grad()
def hf_reward(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([prompt + response])).logits[0, 0].float()


_ORACLE: dict[tuple, torch.Tensor] = {}


def oracle(kind: str, model, arch: str, dtype: str) -> torch.Tensor:
    """HF's numbers for every sequence of ``_data()``, concatenated; computed once per model."""
    key = (kind, arch, dtype)
    if key not in _ORACLE:
        fn = {"reference": hf_logprobs, "reward": hf_reward, "critic": hf_values}[kind]
        _ORACLE[key] = _cat(fn(model, p, r) for p, r in zip(*_data()))
    return _ORACLE[key]


def _cat(rows) -> torch.Tensor:
    return torch.cat([torch.as_tensor(r, dtype=torch.float64).reshape(-1) for r in rows])


def _record(arch: str, path: str, dtype: str, got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, f"{arch} {path} {dtype}: shapes {tuple(got.shape)} != {tuple(want.shape)}"
    diff = (got.double() - want.double()).abs().max().item()  # nan if oppo gave nan
    MEASURED[arch, path, dtype] = f"{diff:.2g}"
    return diff


def _check(arch: str, path: str, dtype: str, got: torch.Tensor, want: torch.Tensor) -> None:
    diff = _record(arch, path, dtype, got, want)
    assert diff <= TOL[dtype], f"{arch} {path} {dtype}: max |oppo - HF| = {diff:.3g} > {TOL[dtype]}"


def _outputs(kind: str, outs) -> torch.Tensor:
    """ScoredOutputs of every sequence, concatenated like ``oracle``."""
    if kind == "reward":
        return _cat(o.score for o in outs)
    return _cat(o.logprobs if kind == "reference" else o.values for o in outs)


# ---------------------------------------------------------------------------------------------
# the streaming scorer, driven as the overlapped modes drive it


def _stream(kind, model, prompts, responses, seed: int = 0) -> list:
    """Admit half the rows, stream a chunk to them, admit the rest (rows of different ages); then
    every round each row gets a chunk of 1, 2 or 5 tokens, or none (holes in its cache). A row
    whose chunk ends exactly at its last token is sometimes completed by an empty final chunk."""
    rng = random.Random(seed)
    s = StreamingScorer(kind, model, PAD, temperature=TEMP)
    n, half = len(prompts), len(prompts) // 2
    emitted = [0] * n

    def next_chunk(u):
        toks = responses[u][emitted[u]: emitted[u] + rng.choice(STREAM_CHUNKS)]
        emitted[u] += len(toks)
        at_end = emitted[u] >= len(responses[u])
        return tuple(toks), at_end and not (toks and u % 3 == 1)  # else an empty final chunk follows

    s.admit(list(range(half)), prompts[:half])
    s.feed({u: next_chunk(u) for u in range(half)})
    s.admit(list(range(half, n)), prompts[half:])
    for _ in range(1000):
        if len(s.done) == n:
            break
        s.feed({u: next_chunk(u) for u in list(s.uids) if rng.random() >= 0.3})
    done = s.take_done()
    assert sorted(done) == list(range(n)) and s.kv.rows == 0
    return [done[u] for u in range(n)]


def _check_streamed(arch: str, dtype: str, kind: str, model, path: str) -> None:
    """Streamed outputs equal HF's, or (sliding-window models only) streaming is refused with an
    error that says why: exact numbers or a clear refusal, never silently wrong numbers."""
    try:
        got = _cat(_outputs(kind, _stream(kind, model, *_data(), seed=s)) for s in (0, 1))
    except ValueError as e:  # ModelLoadError is one
        if ARCHS[arch].sliding and "sliding" in str(e).lower():
            MEASURED[arch, path, dtype] = "refused"
            return
        raise
    _check(arch, path, dtype, got, oracle(kind, model, arch, dtype).repeat(2))


# The reward model and critic of an architecture whose transformers has no XxxForSequenceClassification
# cannot be built (AutoModelForSequenceClassification has none to pick): nothing to compare, so no
# test of theirs ('-' in the table). transformers 5.19 has none for Cohere and Granite.
SCORING_ARCHS = [a for a in ARCHS if _class(ARCHS[a].seqcls) is not None]
each_arch = pytest.mark.parametrize("arch", list(ARCHS))
each_scoring_arch = pytest.mark.parametrize("arch", SCORING_ARCHS)
each_dtype = pytest.mark.parametrize("dtype", list(DTYPES))


def test_only_known_architectures_lack_a_reward_model_class():
    """Leaving an architecture's reward and critic tests out is meant only where transformers lacks
    the class; any other missing one is a lost test."""
    assert set(ARCHS) - set(SCORING_ARCHS) <= {"cohere", "granite"}, _version()


# ---------------------------------------------------------------------------------------------
# 1. reference log-probs


@each_arch
@each_dtype
def test_reference_one_shot(load, arch, dtype):
    model = load(arch, "policy", dtype)
    got = score_full("reference", model, *_data(), PAD, temperature=TEMP)
    assert [len(o.logprobs) for o in got] == list(RESPONSE_LENS)
    _check(arch, "ref_full", dtype, _outputs("reference", got), oracle("reference", model, arch, dtype))


@each_arch
@each_dtype
def test_reference_streamed(load, arch, dtype):
    _check_streamed(arch, dtype, "reference", load(arch, "policy", dtype), "ref_stream")


# ---------------------------------------------------------------------------------------------
# 2. learner log-probs: response_outputs (one-shot scorers, critic loss) and the actor's own
#    path (Learner.old_logprobs recomputes them for off-policy tokens with the training forward)


@each_arch
@each_dtype
def test_learner_logprobs(load, arch, dtype):
    model = load(arch, "policy", dtype)
    prompts, responses = _data()
    want = oracle("reference", model, arch, dtype)

    ids, valid, P, rmask = sequence_batch(prompts, responses, PAD, CPU)
    with torch.no_grad():
        out = response_outputs("reference", model, ids, valid, P, TEMP)  # [B, T]
    d1 = _record(arch, "learner", dtype, _cat(row[: len(r)] for row, r in zip(out, responses)), want)

    rollouts = [Rollout(i, i, "", p, 0, response_ids=list(r), logprobs=[0.0] * len(r), versions=[0] * len(r),
                        finished=True, ended_with_eos=r[-1] == EOS)
                for i, (p, r) in enumerate(zip(prompts, responses))]
    exp = build_experience(rollouts, PAD, CPU)
    exp = Learner(model, model, PPOConfig(), TEMP, seed=0).old_logprobs(exp, version=1)  # every token off-policy
    d2 = _record(arch, "actor", dtype, _cat(row[: len(r)] for row, r in zip(exp.old_logprobs, responses)), want)
    assert max(d1, d2) <= TOL[dtype], (f"{arch} {dtype}: max |oppo - HF| response_outputs {d1:.3g}, "
                                       f"Learner {d2:.3g} > {TOL[dtype]}")


# ---------------------------------------------------------------------------------------------
# 3. behaviour log-probs from the rollout backend


@each_arch
@each_dtype
def test_behaviour_logprobs(load, arch, dtype):
    model = load(arch, "policy", dtype)
    rng = random.Random(5)

    def group(uids, prompt_lens):
        return [Rollout(u, u, "", [rng.randrange(2, V) for _ in range(n)], 0) for u, n in zip(uids, prompt_lens)]

    # three groups join 0, 2 and 5 steps in (rows of different ages, merged with left padding);
    # the older groups retire while the younger decode (rows removed, cache compacted)
    eng = EagerBackend(model, EOS, PAD, max_new_tokens=8, temperature=TEMP, top_k=0, top_p=1.0, seed=11)
    groups = [group([0, 1], [2, 8]), group([2, 3], [6, 1]), group([4, 5], [7, 3])]
    joins = {0: groups[0], 2: groups[1], 5: groups[2]}
    done = {}  # the engine's records (it never changes the rows it is given)
    for step in range(100):
        eng.admit(joins.get(step, []))
        if not eng.active:
            break
        done.update((r.uid, r) for r in eng.step())
    rows = [done[r.uid] for g in groups for r in g]
    assert all(r.finished for r in rows)
    _check(arch, "rollout", dtype, _cat(r.logprobs for r in rows),
           _cat(hf_logprobs(model, r.prompt_ids, r.response_ids) for r in rows))


# ---------------------------------------------------------------------------------------------
# 4. reward scores and critic values (XxxForSequenceClassification, one label)


@each_scoring_arch
@each_dtype
def test_reward_one_shot(load, arch, dtype):
    model = load(arch, "reward", dtype)
    got = score_full("reward", model, *_data(), PAD)
    _check(arch, "reward_full", dtype, _outputs("reward", got), oracle("reward", model, arch, dtype))


@each_scoring_arch
@each_dtype
def test_reward_streamed(load, arch, dtype):
    _check_streamed(arch, dtype, "reward", load(arch, "reward", dtype), "reward_stream")


@each_scoring_arch
@each_dtype
def test_critic_one_shot(load, arch, dtype):
    model = load(arch, "critic", dtype)
    got = score_full("critic", model, *_data(), PAD)
    _check(arch, "critic_full", dtype, _outputs("critic", got), oracle("critic", model, arch, dtype))


@each_scoring_arch
@each_dtype
def test_critic_streamed(load, arch, dtype):
    _check_streamed(arch, dtype, "critic", load(arch, "critic", dtype), "critic_stream")


# ---------------------------------------------------------------------------------------------
# 5. packed training forwards (issue 35): several sequences end to end in a row, position ids
#    restarting at 0, the model's own packed mask, equal each sequence's own unpadded forward in
#    log-probs, entropy, values AND gradients. The oracle here is oppo's micro-batch of that one
#    sequence alone (one row, no padding): its log-probs are HF's by tests 1-2.


def _grads(model) -> list[torch.Tensor]:
    out = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


@each_arch
def test_packed_forward_equals_each_sequence_alone(load, arch):
    from oppo.forward import LayoutRule, layout_rule
    from oppo.learner.batch import CriticBatch, micro_slices
    from oppo.learner.local import response_hidden
    from oppo.models import backbone_and_head

    prompts, responses = _data()
    rollouts = [Rollout(i, i, "", p, 0, response_ids=list(r), logprobs=[0.0] * len(r), versions=[0] * len(r),
                        finished=True, ended_with_eos=r[-1] == EOS) for i, (p, r) in enumerate(zip(prompts, responses))]
    exp = build_experience(rollouts, PAD, CPU)
    rows = torch.arange(len(prompts))
    gen = torch.Generator().manual_seed(1)
    wl, we = torch.randn(exp.mask.shape, generator=gen), torch.randn(exp.mask.shape, generator=gen)  # [B, T]
    roles = ["policy"] + (["critic"] if _class(ARCHS[arch].seqcls) is not None else [])
    for role in roles:
        model = copy.deepcopy(load(arch, role, "fp32")).requires_grad_(True)
        backbone, head = backbone_and_head(model)
        plan = layout_rule(backbone)
        assert plan.packed, f"{arch} {role}: the model's own attention should keep packed sequences apart"
        lp_learner = Learner(model, None, PPOConfig(entropy_coef=0.01), TEMP, seed=0)  # (entropy in the loss)

        def loss(mb, r):
            m = exp.mask[r][:, :mb.T]
            if role == "policy":
                lp, ent = lp_learner._actor_logprobs(mb)  # [b, T] each
                out = torch.cat([lp, ent], 1)
                return out, ((lp * wl[r][:, :mb.T] + ent * we[r][:, :mb.T]) * m).sum()
            v = mb.spread(head(response_hidden(backbone, mb)).float().reshape(-1))  # [b, T]
            return v, (v * wl[r][:, :mb.T] * m).sum()

        alone_out, alone_loss = [], 0.0
        for i in rows.tolist():
            r = torch.tensor([i])
            out, lo = loss(micro_slices(exp, r, LayoutRule(False)), r)
            lo.backward()
            alone_out.append(out[0])
            alone_loss += lo.item()
        alone_grads = _grads(model)
        # the model's own plan (one row here) and a costly attention (several rows, padding at their ends)
        for packed in (plan, LayoutRule(True, attention_cost=0.05)):
            mb = micro_slices(exp if role == "policy" else CriticBatch.of(_with_values(exp)), rows, packed)
            assert packed.attention_cost < 0.05 or mb.layout.rows > 1  # (the several-rows case is one)
            out, lo = loss(mb, rows)
            lo.backward()
            for i, want in enumerate(alone_out):
                T = len(responses[i])
                half = want.shape[0] // 2 if role == "policy" else want.shape[0]  # (lp | entropy)
                got_i = torch.cat([out[i, :T], out[i, mb.T: mb.T + T]]) if role == "policy" else out[i, :T]
                want_i = torch.cat([want[:T], want[half: half + T]]) if role == "policy" else want[:T]
                torch.testing.assert_close(got_i, want_i, atol=1e-5, rtol=1e-5, msg=lambda m: f"{arch} {role} row {i} {packed}: {m}")
            assert abs(lo.item() - alone_loss) <= 1e-4 * max(1.0, abs(alone_loss))
            for g, w in zip(_grads(model), alone_grads):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4, msg=f"{arch} {role} gradients")


def _with_values(exp):
    import dataclasses

    return dataclasses.replace(exp, values=torch.zeros_like(exp.mask), returns=torch.zeros_like(exp.mask))


# ---------------------------------------------------------------------------------------------
# loaders: what oppo cannot score exactly is refused with a message that names the problem


@pytest.mark.parametrize("loader", [load_reward_model, load_critic], ids=["reward", "critic"])
def test_encoder_reward_model_is_rejected(tmp_path, loader):
    """A DeBERTa reward model (the common OpenAssistant kind) is bidirectional: scoring it
    through a causal KV cache, chunk by chunk, cannot give its numbers."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    torch.manual_seed(0)
    cfg = DebertaV2Config(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=64, num_labels=1, pad_token_id=PAD)
    DebertaV2ForSequenceClassification(cfg).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"(?i)causal|decoder"):
        loader(str(tmp_path), CPU, torch.float32, PAD)


def _word_tokenizer(path, words):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + list(words))}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.save_pretrained(path)
    return tok


def test_tokenizer_mismatch_is_rejected(tmp_path):
    """A reward model, critic or reference with another vocabulary would read the policy's token
    ids as other tokens: silently wrong scores. The other role's directory holds its tokenizer."""
    from conftest import WORDS

    policy = _word_tokenizer(tmp_path / "policy", WORDS)
    _word_tokenizer(tmp_path / "same", WORDS)
    _word_tokenizer(tmp_path / "permuted", list(reversed(WORDS)))  # same size, other ids
    _word_tokenizer(tmp_path / "bigger", list(WORDS) + ["extra", "words"])

    oppo.models.check_tokenizer_match(policy, str(tmp_path / "same"), "reward")  # identical vocabularies pass
    for other in ("permuted", "bigger"):
        with pytest.raises(ModelLoadError, match=r"(?i)reward") as e:
            oppo.models.check_tokenizer_match(policy, str(tmp_path / other), "reward")
        assert "token" in str(e.value).lower() or "vocab" in str(e.value).lower(), str(e.value)


# ---------------------------------------------------------------------------------------------
# the table of measured differences


@pytest.fixture(scope="module", autouse=True)
def _print_table(request):
    yield
    if not MEASURED:
        return
    rows = [f"max |oppo - HF| per architecture x path (tolerance fp32 {TOL['fp32']}, bf16 {TOL['bf16']}; "
            f"'-' not run: no such class in this transformers)"]
    head = f"{'arch':<9} {'dtype':<5} " + " ".join(f"{p:>13}" for p in PATHS)
    rows.append(head)
    for arch in ARCHS:
        for dtype in DTYPES:
            if any((arch, p, dtype) in MEASURED for p in PATHS):
                rows.append(f"{arch:<9} {dtype:<5} " + " ".join(f"{MEASURED.get((arch, p, dtype), '-'):>13}"
                                                                for p in PATHS))
    # written past pytest's output capture, so the table shows without -s
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        print("\n".join(rows))
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        for line in rows:
            reporter.write_line(line)
