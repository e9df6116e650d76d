"""``ppo.micro_batch_tokens=-1`` resolved for every learner engine (issue 51): the data-parallel and
FSDP2 ranks resolve it for their own device, as the local learner is on the controller's, and agree on
the smallest budget. CPU tests: the device and its free memory are injected."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from oppo.config import PPOConfig
from oppo.learner.dp import resolve_token_budget

GIB = 2**30


class _OnCuda(torch.nn.Module):
    """A stand-in for a trained model on a GPU: its parameters report a CUDA device, its config a
    1B-like shape (what ``budget.activation_bytes`` reads)."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16)

    def parameters(self, recurse: bool = True):
        yield SimpleNamespace(device=torch.device("cuda", 0))


def _learner(model, **ppo):
    cfg = PPOConfig(batch_size=64, minibatch_size=32, micro_batch_size=4, **ppo)
    return SimpleNamespace(ppo=cfg, actor=model, critic=None, device=torch.device("cpu"))


def test_a_rank_on_cuda_gets_a_budget_and_the_ranks_agree_on_the_smallest(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (100 * GIB, 141 * GIB))
    said: list[str] = []
    one = _learner(_OnCuda())
    assert one.ppo.micro_batch_tokens == -1
    resolve_token_budget(one, False, 1, say=said.append)
    # 35% of 100 GiB over (20 h + 8 i) x 16 layers = 1.63 MiB a token: 21,504 tokens (1024s), in [4096, 131072]
    assert one.ppo.micro_batch_tokens == 21504 and one.ppo.micro_batch_size == 32  # the budget alone cuts
    assert any("21504 tokens" in line for line in said), said
    two = _learner(_OnCuda())
    resolve_token_budget(two, False, 2, smallest=lambda n: min(n, 9216), say=said.append)  # another rank: less free
    assert two.ppo.micro_batch_tokens == 9216 and "smallest of the 2 ranks" in said[-1]


def test_cpu_ranks_and_a_given_budget_are_left_as_they_mean():
    cpu = _learner(torch.nn.Linear(2, 2))
    resolve_token_budget(cpu, False, 1, say=print)
    assert cpu.ppo.micro_batch_tokens == 0 and cpu.ppo.micro_batch_size == 4  # no budget, as before
    given = _learner(_OnCuda(), micro_batch_tokens=2048)
    before = dataclasses.replace(given.ppo)
    resolve_token_budget(given, False, 2, smallest=lambda n: pytest.fail("no agreement needed"), say=print)
    assert given.ppo == before


def test_the_data_parallel_engine_resolves_it_on_its_rank(tiny_models, tmp_path):
    """``Replicated.build`` (the replicate engine's ranks; FSDP2's ``Sharded.build`` calls the same)
    in a process group of one: -1 is resolved (no budget on the CPU), not passed on."""
    import torch.distributed as dist

    from oppo.api.specs import ModelSpec
    from oppo.learner.dp import Replicated
    from oppo.learner.group import LearnerSpec

    spec = LearnerSpec(actor=ModelSpec("policy", str(tiny_models["policy"]), device="cpu"), critic=None,
                       ppo=PPOConfig(batch_size=4, minibatch_size=4, micro_batch_size=2), temperature=1.0, seed=0)
    assert spec.ppo.micro_batch_tokens == -1
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        learner = Replicated().build(spec, 1, "cpu")
    finally:
        dist.destroy_process_group()
    assert learner.ppo.micro_batch_tokens == 0 and learner.micro.micro_batch_tokens == 0
