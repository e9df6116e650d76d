"""GPU path (opt-in: skipped without CUDA). bf16 by default on CUDA: fp32 master weights that
actually move at lr 1e-5, bf16 serving copies in sync, the sampler-vs-trainer log-prob gap
reported. Not yet run on a GPU: no session so far had one."""

import pytest
import torch

from oppo.config import load_config
from oppo.trainer import Trainer

from test_precision import check_mixed_precision_steps

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("mode", ["sequential", "oppo"])
def test_bf16_mixed_precision_on_cuda(tiny_models, tiny_prompts, tmp_path, mode):
    cfg = load_config(None, [
        f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
        f"data.prompts={tiny_prompts}", "policy.device=cuda", "policy.dtype=auto",
        "ppo.batch_size=4", "ppo.minibatch_size=2", "ppo.micro_batch_size=1", "ppo.actor_lr=1e-5",
        "ppo.critic_lr=1e-5", "generation.max_new_tokens=12", f"overlap.mode={mode}", "overlap.delta=2",
        "overlap.max_lag=1", f"run.out_dir={tmp_path}", "log.progress=false"])
    t = Trainer.from_config(cfg, progress=False)
    try:
        assert next(t.roles.rollout_policy.parameters()).is_cuda
        m = check_mixed_precision_steps(t)
        assert m["memory/cuda0_peak_mb"] > 0
    finally:
        t.close()


@pytest.mark.parametrize("mode", ["intra", "inter", "oppo", "pipeline"])
def test_static_engine_with_cuda_graphs_in_every_overlapped_mode(tiny_models, tiny_prompts, tmp_path, mode):
    """generation.backend=auto is the static backend with CUDA graphs on CUDA, and its captures
    survive the scorer worker's and the learner thread's CUDA work (thread-local capture; issue 26
    item 2: the global mode failed with CUBLAS_STATUS_EXECUTION_FAILED, then
    cudaErrorStreamCaptureInvalidated). A few steps with rows carried and chunks streamed; every
    number finite, weights included."""
    import math

    from oppo.rollout.static import StaticBackend

    cfg = load_config(None, [
        f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
        f"data.prompts={tiny_prompts}", "policy.device=cuda", "policy.dtype=auto",
        "ppo.batch_size=8", "ppo.minibatch_size=4", "ppo.micro_batch_size=2", "generation.max_new_tokens=24",
        f"overlap.mode={mode}", "overlap.delta=2", "overlap.max_lag=1", f"run.out_dir={tmp_path}",
        "log.progress=false"])
    t = Trainer.from_config(cfg, progress=False)
    try:
        engine = t.roles.rollout
        assert isinstance(engine, StaticBackend) and engine.capture == "cuda_graph", t.roles.backend
        for step in range(4):
            m = t.run_step()
            bad = {k: v for k, v in m.items() if isinstance(v, (int, float)) and not math.isfinite(v)}
            assert not bad, f"{mode}, step {step}: non-finite {bad}"
        assert engine.captures >= 1
        torch.cuda.synchronize()
        for name, model in {**t.models(), "rollout": t.roles.rollout_policy}.items():
            for pname, p in model.named_parameters():
                assert torch.isfinite(p).all(), f"{name}.{pname}"
    finally:
        t.close()
