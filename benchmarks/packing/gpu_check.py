"""Packed rows on a GPU (issue 35): a tiny random Llama, sdpa, on CUDA. fp32: packed micro-batch
log-probs, entropy and gradients against each sequence alone; bf16 autocast: finite gradients
at widths 64 mod 128 (the cuDNN case of issue 26). Prints one JSON line.

    PYTHONPATH=src python benchmarks/packing/gpu_check.py
"""

import json
import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from oppo.config import PPOConfig
from oppo.forward import LayoutRule, layout_rule
from oppo.learner.batch import build_experience, micro_slices
from oppo.learner.local import Learner
from oppo.models import backbone_and_head
from oppo.rollout.eager.backend import Rollout

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, eos_token_id=1,
                  bos_token_id=None)
model = LlamaForCausalLM(cfg).to(dev).eval()
rng = random.Random(0)
lens = [(rng.randrange(3, 40), rng.randrange(1, 90)) for _ in range(8)]
rolls = [Rollout(i, i, "", [rng.randrange(2, 512) for _ in range(p)], 0, response_ids=[rng.randrange(2, 512) for _ in range(r)],
                 logprobs=[0.0] * r, versions=[0] * r, finished=True, ended_with_eos=False) for i, (p, r) in enumerate(lens)]
exp = build_experience(rolls, 0, dev)
out = {"plan": str(layout_rule(backbone_and_head(model)[0])), "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
for dtype in (torch.float32, torch.bfloat16):
    lrn = Learner(model, None, PPOConfig(entropy_coef=0.01), 1.0, seed=0, compute_dtype=dtype)
    w = torch.randn(exp.mask.shape, device=dev)

    def loss(mb, rows):
        lp, ent = lrn._actor_logprobs(mb)
        m = exp.mask[rows][:, :mb.T]
        return lp, ((lp + ent) * w[rows][:, :mb.T] * m).sum()

    alone_lp, alone_g = [], None
    for i in range(len(rolls)):
        r = torch.tensor([i], device=dev)
        lp, lo = loss(micro_slices(exp, r, LayoutRule(False)), r)
        lo.backward()
        alone_lp.append(lp[0, : len(rolls[i].response_ids)])
    alone_g = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    rows = torch.arange(len(rolls), device=dev)
    for name, plan in (("own_plan", layout_rule(backbone_and_head(model)[0])), ("rows", LayoutRule(True, 0.05))):
        mb = micro_slices(exp, rows, plan)
        lp, lo = loss(mb, rows)
        lo.backward()
        g = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        d_lp = max(float((lp[i, : len(a)].detach() - a.detach()).abs().max()) for i, a in enumerate(alone_lp))
        d_g = max(float((a - b).abs().max() / (b.abs().max() + 1e-12)) for a, b in zip(g, alone_g))
        out[f"{str(dtype)[6:]}_{name}"] = {"rows": mb.layout.rows, "width": mb.layout.width, "max_dlogp": d_lp,
                                           "max_rel_dgrad": d_g, "finite": all(bool(x.isfinite().all()) for x in g)}
print(json.dumps(out))
