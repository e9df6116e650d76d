"""Which training-forward layouts give NaN gradients on this GPU (issue 26's root cause).

    PYTHONPATH=src python benchmarks/nan_probe.py [--widths 56-336] [--dtype bfloat16]

For each batch width (columns of left-padded prompt + right-padded response), a bf16 Llama with
head dim 64 runs one forward and backward of the actor's log-prob loss two ways:

- ``padded``: the old layout, left pads under a padding mask (each left pad is a query row
  that attends to no key);
- ``packed``: ``oppo.scoring.streaming.full_hidden``, rows packed left under the causal mask alone.

It prints the count of parameters with non-finite gradients per width, with the SDPA backends
PyTorch allows by default, then with cuDNN attention disabled. On an H100 with torch 2.11-2.13
the cuDNN backward is expected to give NaN at widths 64 mod 128 in the padded layout only
(pytorch#196678). Random weights; nothing is trained.
"""

from __future__ import annotations

import argparse

import torch


def _model(dtype, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).to(device, dtype)


def _bad_grads(model, width: int, packed: bool) -> int:
    device = next(model.parameters()).device
    from oppo.models import backbone_and_head
    from oppo.scoring.streaming import full_hidden, sequence_batch

    g = torch.Generator().manual_seed(width)
    lens = [width - 16, width // 2, 5, width // 3]  # prompt lengths: the widest row sets the width
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]
    responses = [torch.randint(3, 500, (16 if i == 0 else 8,), generator=g).tolist() for i in range(len(lens))]
    ids, valid, P, rmask = sequence_batch(prompts, responses, 0, device)
    model.zero_grad(set_to_none=True)
    backbone, head = backbone_and_head(model)
    if packed:
        hidden = full_hidden(backbone, ids, valid)
    else:
        pos = (valid.cumsum(1) - 1).clamp(min=0)
        hidden = backbone(input_ids=ids, attention_mask=valid, position_ids=pos, use_cache=False).last_hidden_state
    logp = head(hidden[:, P - 1:-1]).float().log_softmax(-1).gather(-1, ids[:, P:, None]).squeeze(-1)
    (logp * rmask).sum().backward()
    return sum(int(not torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="56-336", help="first-last (step 8) or a comma list")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", help="cuda (the probe) or cpu (checks this script only)")
    a = p.parse_args(argv)
    if "-" in a.widths:
        lo, hi = map(int, a.widths.split("-"))
        widths = list(range(lo, hi + 1, 8))
    else:
        widths = [int(w) for w in a.widths.split(",")]
    model = _model(getattr(torch, a.dtype), a.device)
    name = torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device
    print(f"# {name}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print("| width | width % 128 | padded: bad grads | packed: bad grads | padded, no cuDNN SDPA |")
    print("|---|---|---|---|---|")
    for w in widths:
        padded, packed = _bad_grads(model, w, False), _bad_grads(model, w, True)
        torch.backends.cuda.enable_cudnn_sdp(False)
        try:
            no_cudnn = _bad_grads(model, w, False)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(True)
        print(f"| {w} | {w % 128} | {padded} | {packed} | {no_cudnn} |")


if __name__ == "__main__":
    main()
