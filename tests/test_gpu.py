"""GPU path (opt-in: skipped without CUDA). Not yet run on a GPU: no session so far had one."""

import pytest
import torch

from oppo.config import load_config
from oppo.trainer import Trainer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("mode", ["sequential", "oppo"])
def test_bf16_steps_on_cuda(tiny_models, tiny_prompts, tmp_path, mode):
    cfg = load_config(None, [
        f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
        f"data.prompts={tiny_prompts}", "policy.device=cuda", "policy.dtype=bfloat16",
        "ppo.batch_size=4", "ppo.minibatch_size=2", "ppo.micro_batch_size=1",
        "generation.max_new_tokens=12", f"overlap.mode={mode}", "overlap.delta=2", "overlap.max_lag=1",
        f"run.out_dir={tmp_path}"])
    t = Trainer(cfg, progress=False)
    try:
        for _ in range(2):
            m = t.run_step()
            assert all(v == v for k, v in m.items() if k.startswith(("loss/", "reward/")))  # no NaN
        assert next(t.policy.parameters()).dtype == torch.bfloat16
    finally:
        t.close()
