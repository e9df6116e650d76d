"""The collective, bucketed weight sync (``weights/sync.py``), on CPU with gloo.

- the bucket plan: every byte of every tensor exactly once, in order; a tensor larger than a
  bucket spans several;
- one sender and three receivers (``torch.multiprocessing``): weights arrive exactly, cast to the
  wire dtype (bf16) and into a bf16 model (bytes copied straight in), an fp32 one (staged and
  cast) and a sink that takes whole tensors (vLLM's reload); a wrong version or a changed
  manifest makes every member raise before any weights move, and the group still works after; a receiver whose model does not match the manifest (a wrong
  shape, a missing name) makes every member raise, naming the tensors;
- FSDP2: 2 learner ranks (``group.LearnerRank`` with the ``fsdp.Sharded`` strategy, as Ray runs it, without Ray) gather one parameter at
  a time and rank 0 streams it to a rollout replica (``RolloutHost``), whose engine then samples
  exactly as a local engine given the learner's weights; a refused version fails on every rank
  (no rank left waiting in a gather);
- on Ray, the Trainer with FSDP2 ranks and a rollout replica synced collectively trains as the
  local sequential run; a vLLM rollout replica synced collectively samples from each update's
  weights;
- bad settings are refused before any model loads.
"""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch

from oppo.weights.sync import Manifest, TensorMeta, full_tensors
from validated import load_valid

MP_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ====================================================================== the plan

def test_plan_covers_every_byte_once_and_a_big_tensor_spans_buckets():
    m = Manifest((TensorMeta("a", "float32", (3,)),  # 12 bytes
                  TensorMeta("empty", "float32", (0,)),
                  TensorMeta("big", "bfloat16", (5, 5)),  # 50 bytes > a bucket of 16
                  TensorMeta("c", "int64", ())))  # 8 bytes
    assert m.total_bytes == 12 + 0 + 50 + 8
    plan = m.plan(16)
    # bytes 0..70 in buckets of 16: a[0:12] + big[0:4] | big[4:20] | big[20:36] | big[36:50] + c[0:2] | c[2:8]
    assert plan == [[(0, 0, 12, 0), (2, 0, 4, 12)], [(2, 4, 20, 0)], [(2, 20, 36, 0)],
                    [(2, 36, 50, 0), (3, 0, 2, 14)], [(3, 2, 8, 0)]]
    for bucket_bytes in (1, 7, 16, 64, 1000):
        seen: dict[int, list[tuple[int, int]]] = {}
        for pieces in m.plan(bucket_bytes):
            assert sum(b - a for _, a, b, _ in pieces) <= bucket_bytes
            end = 0
            for i, a, b, off in pieces:
                assert off == end and b > a  # packed from the bucket's start, no gaps
                end += b - a
                seen.setdefault(i, []).append((a, b))
        for i, meta in enumerate(m.tensors):
            spans = seen.get(i, [])
            starts = [0] + [b for _, b in spans[:-1]] if spans else []  # each piece starts where the last ended
            assert [a for a, _ in spans] == starts, (bucket_bytes, meta.name)
            assert (spans[-1][1] if spans else 0) == meta.nbytes


def test_manifest_wire_dtypes_and_digest():
    named = [("w", torch.zeros(2, 3)), ("steps", torch.zeros(4, dtype=torch.long))]
    m = Manifest.of(named, torch.bfloat16)
    assert [(t.dtype, t.shape) for t in m.tensors] == [("bfloat16", (2, 3)), ("int64", (4,))]  # ints keep theirs
    assert Manifest.of(named, {"w": torch.float16}).tensors[0].dtype == "float16"
    assert Manifest.of(named).tensors[0].dtype == "float32"
    assert m.digest() == Manifest.of(named, torch.bfloat16).digest() != Manifest.of(named).digest()
    assert [n for n, _ in full_tensors(named)] == ["w", "steps"]


# ====================================================================== sender and receivers

def _model(seed: int, dtype=torch.float32, hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(50, hidden), torch.nn.Linear(hidden, 8), torch.nn.LayerNorm(8))
    m.register_parameter("empty", torch.nn.Parameter(torch.zeros(0)))
    return m.to(dtype)


def _expect_refusal(fn, *words: str) -> str:
    from oppo.weights.sync import WeightSyncError

    with pytest.raises(WeightSyncError) as e:
        fn()
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    return str(e.value)


def _members_main(rank: int, port: int) -> None:
    """Rank 0 sends an fp32 model as bf16 in buckets of 100 bytes (the embedding, 1600 bytes on the
    wire, spans 16 of them); rank 1 receives into a bf16 model, rank 2 into an fp32 one, rank 3
    hands whole tensors to a sink (as a vLLM worker's reload takes them)."""
    import torch.distributed as dist

    from oppo.weights.sync import SyncGroup, WeightReceiver, WeightSender

    torch.set_num_threads(1)
    world = 4
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
    group = SyncGroup("127.0.0.1", port, rank, world, "cpu", timeout_s=MP_TIMEOUT_S, store=store)
    assert group.backend == "gloo"
    src = _model(0)
    named = [(n, p) for n, p in src.named_parameters()]
    manifest = Manifest.of(named, torch.bfloat16)
    sunk: list = []
    if rank == 0:
        member = WeightSender.connect(group, manifest, bucket_bytes=100)
        assert len(member.plan) > 16
    elif rank == 3:
        member = WeightReceiver.connect(group, None, sink=lambda pairs, version: sunk.append((dict(pairs), version)))
    else:
        dst = _model(rank, torch.bfloat16 if rank == 1 else torch.float32)
        member = WeightReceiver.connect(group, dst)

    def sync(version: int, sent: int | None = None, manifest=manifest):
        if rank == 0:
            member.send(version if sent is None else sent, manifest, full_tensors(named))
        else:
            member.receive(version)

    def check():
        if rank == 0:
            return
        if rank == 3:
            got, version = sunk[-1]
            assert version == member.version and got.keys() == src.state_dict().keys()
            for name, t in got.items():
                assert torch.equal(t, src.state_dict()[name].to(torch.bfloat16)), name
            return
        for name, p in dst.state_dict().items():
            want = src.state_dict()[name].to(torch.bfloat16).to(p.dtype)  # cast once, on the wire
            assert torch.equal(p, want), name

    for version in (1, 2):
        sync(version)
        check()
        with torch.no_grad():  # new weights (the same in every process): the next sync must bring them
            g = torch.Generator().manual_seed(version)
            for p in src.parameters():
                p.add_(torch.randn(p.shape, generator=g))
    # a sync sent as the wrong version: every member refuses before any weights move
    before = {k: v.clone() for k, v in (dst.state_dict() if rank in (1, 2) else src.state_dict()).items()}
    _expect_refusal(lambda: sync(4, sent=3), "sends weights version 3", "expects version 4")
    assert len(sunk) == (2 if rank == 3 else 0), "the sink got nothing"
    if rank in (1, 2):
        assert all(torch.equal(v, before[k]) for k, v in dst.state_dict().items()), "nothing moved"
    # the sender's tensors no longer those agreed on (here: sent as fp32)
    _expect_refusal(lambda: sync(4, manifest=Manifest.of(named)), "differ from those receivers [1, 2, 3]")
    sync(4)  # the group is still usable
    check()
    assert rank == 0 or member.version == 4
    if rank == 3:
        group.close()
        return
    world = 3

    # a second group on the same store: receivers whose models do not fit the manifest
    group2 = SyncGroup("127.0.0.1", port, rank, world, "cpu", timeout_s=MP_TIMEOUT_S, store=store, name="second")
    if rank == 0:
        msg = _expect_refusal(lambda: WeightSender.connect(group2, manifest, 100), "cannot form")
        assert "receiver 1" in msg and "receiver 2" in msg
    elif rank == 1:  # another shape
        _expect_refusal(lambda: WeightReceiver.connect(group2, _model(0, hidden=12)), "shapes differ", "0.weight")
    else:  # a name the sender does not send, and the receiver wants all of them
        bigger = _model(0)
        bigger.register_buffer("extra", torch.zeros(2))
        _expect_refusal(lambda: WeightReceiver.connect(group2, bigger, partial=False), "missing ['extra']")
    for g in (group, group2):
        g.close()


def test_sender_and_three_receivers_exact_versions_checked_and_bad_models_refused():
    import torch.multiprocessing as mp

    mp.spawn(_members_main, args=(_free_port(),), nprocs=4, join=True)


# ====================================================================== FSDP2 ranks -> a rollout replica

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def _rows(start_uid: int = 0):
    from oppo.rollout.eager.backend import Rollout

    return [Rollout(start_uid + i, i, "", list(p), 0) for i, p in enumerate(PROMPTS)]


def _settings(pad: int):
    from oppo.rollout.registry import BackendSettings

    return BackendSettings((1,), pad, 8, 1.0, 0, 1.0, None, 0, "eager", max_rows=4, max_len=16)


def _fsdp_main(rank: int, ports: tuple[int, int], paths: dict) -> None:
    """Ranks 0 and 1: FSDP2 learner ranks (their own default group); rank 2: a rollout replica
    (bf16, no default group). Rank 0 writes the learner's full weights for rank 2 to compare."""
    import torch.distributed as dist

    from oppo.config import PPOConfig
    from oppo.learner.fsdp import Sharded, full_model_state
    from oppo.learner.group import LearnerRank, LearnerSpec
    from oppo.rollout.ray import RolloutHost
    from oppo.api.specs import ModelSpec
    from oppo.rollout.registry import build_backend

    torch.set_num_threads(1)
    learn_port, sync_port = ports
    wire = torch.bfloat16
    want_path = f"{paths['tmp']}/want.pt"
    if rank < 2:
        spec = LearnerSpec(actor=ModelSpec("policy", paths["policy"], device="cpu"), critic=None,
                           ppo=PPOConfig(batch_size=4, minibatch_size=2, micro_batch_size=1), temperature=1.0, seed=0)
        me = LearnerRank(spec, rank, 2, 1, Sharded())
        me.join("127.0.0.1", learn_port, "gloo", MP_TIMEOUT_S)
        assert me.open_weight_sync("127.0.0.1", sync_port, 2, 1000, wire, MP_TIMEOUT_S) == ""
        with torch.no_grad():  # the learner's weights move (each rank its own shards)
            g = torch.Generator().manual_seed(rank)
            for p in me.learner.actor.parameters():
                local = p.to_local()
                local.add_(0.3 * torch.randn(local.shape, generator=g))
        full = full_model_state(me.learner.actor)  # (a collective; the test's reference only)
        if rank == 0:
            assert max(v.numel() * 2 for v in full.values()) > 1000, "a tensor spans buckets"
            torch.save({k: v.to(wire) for k, v in full.items()}, want_path)
        dist.barrier()
        # one parameter at a time: count the gathered tensors still alive at each gather
        import weakref

        import oppo.learner.group as dp_module

        gathered, most_alive = [], 0

        def counting(named):
            nonlocal most_alive
            for name, t in full_tensors(named):
                gathered.append(weakref.ref(t))
                most_alive = max(most_alive, sum(r() is not None for r in gathered))
                yield name, t
                del t

        dp_module.full_tensors, real = counting, dp_module.full_tensors
        me.send_weights(7)
        dp_module.full_tensors = real
        n = len(list(me.learner.actor.parameters()))
        assert len(gathered) == n and most_alive == 1, (len(gathered), n, most_alive)
        _expect_refusal(lambda: me.send_weights(8), "version 8" if rank == 0 else "rank 0's weight sync was refused")
        me.send_weights(9)
        me.close()
        return
    store = dist.TCPStore("127.0.0.1", sync_port, is_master=True, wait_for_workers=False)  # (any member may host)
    spec = ModelSpec("policy", paths["policy"], wire, device="cpu", pad_id=paths["pad"])
    host = RolloutHost(spec, _settings(paths["pad"]), seed=3, threads=1, name="rollout0")
    assert host.join_weight_sync("127.0.0.1", sync_port, 1, 2, MP_TIMEOUT_S) == ""
    host.receive_weights(7)
    want = torch.load(want_path)
    got = host.model.state_dict()
    assert got.keys() >= want.keys()
    moved = 0
    for k, v in want.items():
        assert torch.equal(got[k], v), k
        moved += 1
    assert moved == len(list(host.model.parameters()))
    # the engine samples from the new weights: exactly as a local engine holding them
    host.backend.admit(_rows())
    remote = {r.uid: (r.response_ids, r.logprobs, r.versions) for r in host.backend.generate_all()}
    local_model = spec.load().requires_grad_(False)
    local_model.load_state_dict(want, strict=False)
    local = build_backend(local_model, dataclasses.replace(_settings(paths["pad"]), seed=3))
    local.set_version(7)
    local.admit(_rows())
    for r in local.generate_all():
        assert remote[r.uid] == (r.response_ids, r.logprobs, r.versions)
        assert set(r.versions) == {7}
    stale = build_backend(spec.load().requires_grad_(False), dataclasses.replace(_settings(paths["pad"]), seed=3))
    stale.admit(_rows())
    assert any(r.logprobs != remote[r.uid][1] for r in stale.generate_all()), "the old weights sample otherwise"
    _expect_refusal(lambda: host.receive_weights(9), "version 8", "expects version 9")
    host.receive_weights(9)
    assert host.backend.version == 9
    del store


def test_fsdp2_ranks_stream_to_a_rollout_replica_one_parameter_at_a_time(tiny_models, tmp_path):
    import torch.multiprocessing as mp

    from oppo.models import load_tokenizer

    pad = load_tokenizer(str(tiny_models["policy"])).pad_token_id
    mp.spawn(_fsdp_main, args=((_free_port(), _free_port()), {"policy": str(tiny_models["policy"]), "pad": pad,
                                                                 "tmp": str(tmp_path)}),
             nprocs=3, join=True)


# ====================================================================== on Ray, in the Trainer

@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("placement", [
    ("placement.learner=fsdp2", "placement.ray.rollout_replicas=1"),  # FSDP2 ranks -> a rollout replica
    ("placement.learner=replicate",),  # replica rank 0 -> the controller's engine
], ids=["fsdp2-to-replica", "replicas-to-controller"])
def test_trainer_syncs_collectively(ray_local, tiny_models, tiny_prompts, tmp_path, placement):
    """2 learner ranks stream each update to the rollout backend (placement.ray.weight_sync=collective,
    buckets of ~1 KB): a Ray rollout replica, or the backend in the controller. The run samples and
    trains as the local sequential run, step for step (its step-2 samples come from the synced
    weights), and the engine ends holding the learner's weights exactly, as the last version."""
    pytest.importorskip("ray")
    import ray

    from oppo.weights.sync import CollectiveSync
    from oppo.trainer import Trainer
    from test_ray_trainer import _cfg

    steps = 2
    with Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path / "l", "overlap.mode=sequential"), progress=False) as t:
        want = []
        for _ in range(steps):
            m = t.run_step()
            want.append((t.last_result.exp.ids.clone(), m))
    with Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path / "r", "overlap.mode=sequential", "placement.name=ray",
                      "learner.replicate.ranks=2", *placement, "placement.ray.weight_sync=collective",
                      "placement.ray.weight_sync_bucket_mb=0.001", "learner.replicate.cpus=0.25",
                      "placement.ray.scorer_cpus=0.25", "placement.ray.rollout_cpus=0.25"), progress=False) as t:
        links = [c.__self__ for c in t.roles.closers if isinstance(getattr(c, "__self__", None), CollectiveSync)]
        assert len(links) == 1, "the collective sync was formed"
        for ids, m_local in want:
            m = t.run_step()
            assert torch.equal(t.last_result.exp.ids, ids), "the same responses"
            for k in ("reward/mean", "kl/mean", "loss/policy", "loss/value"):
                assert m[k] == pytest.approx(m_local[k], abs=1e-4, rel=1e-3), k
            assert m["time/weight_sync"] > 0
        if "placement.ray.rollout_replicas=1" in placement:
            replica = t.roles.rollout.replicas[0]
            got, version = ray.get(replica.__ray_call__.remote(lambda self: (self.model.state_dict(),
                                                                              self.backend.version)))
        else:
            got, version = t.roles.rollout_policy.state_dict(), t.roles.rollout.version
            assert links[0].receiver.version == steps, "the controller received every sync"
        trained = t.roles.learner.actor_state()
    assert version == steps
    for k, v in trained.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("overrides, expected", [
    (["placement.name=ray", "placement.ray.weight_sync_bucket_mb=-1"], "weight_sync_bucket_mb must be >= 0"),
    (["placement.name=ray", "placement.ray.weight_sync=nccl"], "collective"),  # the allowed values are named
])
def test_bad_weight_sync_settings_are_refused_before_any_model_loads(overrides, expected):
    from oppo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=expected):
        load_valid(None, overrides)
