"""Weights from the learner to the rollout backends: two paths, chosen by ``placement.ray.weight_sync``.

**Object store** (:func:`pack` / :func:`unpack_into`): numpy views, which Ray stores out of band and
hands a reader on the same node without a copy (torch tensors would be pickled); bf16 travels as its
int16 bit pattern. **Collective** (:class:`WeightSender` / :class:`WeightReceiver` in a
:class:`SyncGroup`): a process group of its own (NCCL between GPUs, gloo otherwise) streaming a fixed
:class:`Manifest` in buckets, so a sync needs two buckets of memory beside the models whatever their
size, and an FSDP2 learner gathers one parameter at a time. Every sync first agrees on (version,
manifest digest), so a rollout backend never samples silently from other weights than it was told.
Design, figures and why ``auto`` picks as it does: ``docs/distributed.md``, "The weight sync".
"""

from __future__ import annotations

import hashlib
import math
import pickle
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from .remote import RemoteWeights as RemoteWeights  # (its own file, that api.protocols names; importable here too)

if TYPE_CHECKING:
    from ..kernels.streams import Role
    from ..api.protocols import WeightLinkReceiver, WeightLinkSender, WeightSource

Packed = dict[str, tuple[object, str]]  # name -> (numpy array, torch dtype name)


def pack(module: torch.nn.Module, trainable_only: bool = False) -> Packed:
    """``module``'s state dict as numpy arrays (views of CPU tensors; a device copy on GPU).
    ``trainable_only``: only the parameters that train (what an update changes: with LoRA the
    adapters, not the frozen base), for :func:`unpack_into` with ``partial=True``."""
    state = module.state_dict()
    if trainable_only:
        state = {k: p for k, p in module.named_parameters() if p.requires_grad}
    return pack_state(state)


def pack_state(state: dict[str, torch.Tensor]) -> Packed:
    """:func:`pack` of a state dict (e.g. a sharded model's, all-gathered)."""
    out: Packed = {}
    for name, t in state.items():
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            out[name] = (t.view(torch.int16).numpy(), "bfloat16")
        else:
            out[name] = (t.numpy(), str(t.dtype).removeprefix("torch."))
    return out


@torch.no_grad()
def unpack_into(module: torch.nn.Module, packed: Packed, partial: bool = False) -> None:
    """Copy :func:`pack`'s arrays into ``module``'s tensors of the same names (cast to their
    dtype and device). Every name of ``module``'s state dict must be there (``partial``: some
    may be left out), and no other."""
    targets = module.state_dict(keep_vars=True)
    if not packed.keys() <= targets.keys() or (not partial and targets.keys() != packed.keys()):
        missing, extra = sorted(targets.keys() - packed.keys()), sorted(packed.keys() - targets.keys())
        raise KeyError(f"weights do not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the object store's arrays are read-only: we only read
        for name, (arr, dtype) in packed.items():
            src = torch.from_numpy(arr)
            if dtype == "bfloat16":
                src = src.view(torch.bfloat16)
            targets[name].data.copy_(src)


def is_packed(weights) -> bool:
    return isinstance(weights, dict) and all(isinstance(v, tuple) and len(v) == 2 for v in weights.values())


# ====================================================================== collective, bucketed

# The bucket size by backend when none is given. NCCL: large buckets amortise each collective's
# launch (a few hundred MB, as peers use). gloo on one CPU node: small buckets were as fast as large
# ones or faster (benchmarks/weight_sync/README.md).
DEFAULT_BUCKET_BYTES = {"nccl": 256 * 2**20, "gloo": 4 * 2**20}


class WeightSyncError(RuntimeError):
    """The members of a weight sync disagree (version, names, shapes): every member raises it."""


@dataclass(frozen=True)
class TensorMeta:
    """One tensor on the wire: its name, its dtype there (``torch`` dtype name) and its shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class Manifest:
    """What every sync of a group sends, in order (module docstring)."""

    tensors: tuple[TensorMeta, ...]

    @classmethod
    def of(cls, named: Iterable[tuple[str, torch.Tensor]],
           wire_dtype: torch.dtype | dict[str, torch.dtype] | None = None) -> Manifest:
        """The manifest of ``named`` tensors (only their metadata is read: a DTensor's global shape),
        floating-point ones as ``wire_dtype`` (None: their own dtype; a dict: by name, where named)."""
        out = []
        for name, t in named:
            want = wire_dtype.get(name) if isinstance(wire_dtype, dict) else wire_dtype
            dtype = want if want is not None and t.is_floating_point() else t.dtype
            out.append(TensorMeta(name, str(dtype).removeprefix("torch."), tuple(t.shape)))
        return cls(tuple(out))

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.tensors)

    def digest(self) -> int:
        """A 63-bit hash of the names, dtypes and shapes (what a sync's header compares)."""
        h = hashlib.sha256(repr(self.tensors).encode()).digest()
        return int.from_bytes(h[:8], "little") & (2**63 - 1)

    def plan(self, bucket_bytes: int) -> list[list[tuple[int, int, int, int]]]:
        """The buckets: each a list of pieces ``(tensor index, first byte, end byte, offset in the
        bucket)``; the byte stream is the tensors in order, cut every ``bucket_bytes``."""
        buckets: list[list[tuple[int, int, int, int]]] = [[]]
        used = 0
        for i, meta in enumerate(self.tensors):
            start, n = 0, meta.nbytes
            while start < n:
                if used == bucket_bytes:
                    buckets.append([])
                    used = 0
                take = min(n - start, bucket_bytes - used)
                buckets[-1].append((i, start, start + take, used))
                start += take
                used += take
        return [b for b in buckets if b]


def trained_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters an update changes (with LoRA, the adapters): what a sync sends."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def full_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor whole, one at a time: a sharded one (FSDP2's ``DTensor``) all-gathered just
    before it is yielded (a collective: every rank of its mesh must iterate), and dropped after."""
    for name, t in named:
        yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t.detach())


def serve_store(timeout_s: float = 600.0):
    """A ``TCPStore`` server on a free port of this host (``.port``) for a :class:`SyncGroup` to meet
    at; keep it alive as long as the group."""
    import torch.distributed as dist

    return dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def _device_id(device: torch.device) -> str:
    """Which physical device: "cpu", or the GPU's UUID (indices are per process under Ray's
    CUDA_VISIBLE_DEVICES; two members on one GPU must be told apart from two GPUs)."""
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is None:  # (older torch) the host and the PCI address name the GPU
        import socket

        uuid = f"{socket.gethostname()}/{getattr(props, 'pci_bus_id', '?')}:{getattr(props, 'pci_device_id', device)}"
    return f"cuda:{uuid}"


class SyncGroup:
    """A process group of the sender (rank 0) and ``world - 1`` receivers, met at the ``TCPStore``
    ``host:port`` (``store``: the server itself, when this process hosts it) under the prefix
    ``name``. ``device``: where this member's weights live. The backend is NCCL when every member
    has a CUDA device and no two share one, else gloo over CPU buffers (module docstring)."""

    def __init__(self, host: str, port: int, rank: int, world: int, device: torch.device | str = "cpu", *,
                 timeout_s: float = 600.0, name: str = "oppo-weights", store=None):
        import torch.distributed as dist

        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.rank, self.world, self.timeout = rank, world, timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, is_master=False, timeout=self.timeout)
        self.store = dist.PrefixStore(f"{name}/", store)
        self.store.set(f"device/{rank}", _device_id(device))
        ids = [self.store.get(f"device/{r}").decode() for r in range(world)]  # waits for every member
        nccl = all(i.startswith("cuda:") for i in ids) and len(set(ids)) == world
        self.backend = "nccl" if nccl else "gloo"
        self.device = device if nccl else torch.device("cpu")  # where the buckets live
        # a c10d backend, NCCL or gloo (None once closed); Any: torch's stubs lack its collectives
        # (broadcast, allgather), which the backends have
        self.pg: Any
        if nccl:
            torch.cuda.set_device(device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", self.store), rank, world, opts)
        else:
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", self.store), rank, world, self.timeout)

    def broadcast(self, t: torch.Tensor):
        """Rank 0's ``t`` into every member's ``t``; returns the work (``.wait()``)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return self.pg.broadcast([t], opts)

    def gather_rows(self, row: list[int]) -> list[list[int]]:
        """Every member's ``row`` of integers, in rank order (an all-gather)."""
        t = torch.tensor(row, dtype=torch.int64, device=self.device)
        out = [torch.empty_like(t) for _ in range(self.world)]
        self.pg.allgather([out], [t]).wait()
        return [o.tolist() for o in out]  # CPU-GPU sync point

    def close(self) -> None:
        if self.backend == "nccl" and hasattr(self.pg, "shutdown"):
            self.pg.shutdown()
        self.pg = None


def _agree(group: SyncGroup, ok: bool) -> None:
    """Every member learns whether every member is ok with the group's manifest (a collective);
    raises on every member if one is not, with the receivers' reasons from the store."""
    rows = group.gather_rows([int(ok)])
    if all(r[0] for r in rows):
        return
    why = [f"receiver {r}: {group.store.get(f'verdict/{r}').decode()}" for r in range(1, group.world)
           if not rows[r][0]]
    raise WeightSyncError("the weight sync group cannot form: " + "; ".join(why))


def _check_header(group: SyncGroup, version: int, digest: int) -> None:
    """The header of a sync: every member's (version, manifest digest); any disagreement raises on
    every member, before any weights move."""
    rows = group.gather_rows([version, digest])
    sent_version, sent_digest = rows[0]
    bad_version = [(r, v) for r, (v, _) in enumerate(rows) if v != sent_version]
    bad_digest = [r for r, (_, d) in enumerate(rows) if d != sent_digest]
    if not bad_version and not bad_digest:
        return
    msgs = [f"the learner sends weights version {sent_version}, receiver {r} expects version {v} "
            f"(a sync skipped or repeated)" for r, v in bad_version]
    if bad_digest:
        msgs.append(f"the learner's tensors (names, shapes or dtypes) differ from those receivers {bad_digest} "
                    f"agreed on when the group formed")
    raise WeightSyncError("weight sync refused: " + "; ".join(msgs))


def _as_bytes(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` cast to ``dtype``, as a flat view of its bytes."""
    return t.detach().to(dtype=dtype).contiguous().reshape(-1).view(torch.uint8)


class WeightSender:
    """Rank 0 of a :class:`SyncGroup`: streams the tensors of its :class:`Manifest` in buckets of
    ``bucket_bytes`` (module docstring). :meth:`connect` forms the group."""

    def __init__(self, group: SyncGroup, manifest: Manifest, bucket_bytes: int):
        self.group, self.manifest = group, manifest
        self.bucket_bytes = max(1, int(bucket_bytes))
        self.plan = manifest.plan(self.bucket_bytes)

    @classmethod
    def connect(cls, group: SyncGroup, manifest: Manifest, bucket_bytes: int = 0) -> WeightSender:
        """Publish the manifest and the bucket size (0: :data:`DEFAULT_BUCKET_BYTES` for the group's
        backend), and wait for every receiver's verdict on it (raises if one refuses)."""
        bucket_bytes = int(bucket_bytes) or DEFAULT_BUCKET_BYTES[group.backend]
        # (torch's stub types a store value as str; the store takes bytes as well)
        group.store.set("manifest", pickle.dumps((manifest, bucket_bytes)))  # type: ignore[arg-type]
        _agree(group, True)
        return cls(group, manifest, bucket_bytes)

    def send(self, version: int, manifest: Manifest, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send ``tensors`` (name, tensor: consumed one at a time, in the manifest's order: a lazy
        iterator may gather each one just in time) as weights ``version``. ``manifest``: what they
        are (:meth:`Manifest.of` on their metadata), checked against the group's in the header."""
        self.header(version, manifest)
        self.stream(tensors)

    def header(self, version: int, manifest: Manifest) -> None:
        """A sync's first half: every member agrees on (version, manifest) or raises."""
        _check_header(self.group, version, manifest.digest())

    def stream(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A sync's second half (after :meth:`header`): the buckets."""
        metas, dev = self.manifest.tensors, self.group.device
        it = iter(tensors)
        cur, cur_i = None, -1

        def advance(to: int) -> torch.Tensor:
            nonlocal cur, cur_i
            while cur_i < to:
                cur_i += 1
                cur = None  # the last tensor is dropped before the next is gathered: one alive at a time
                name, t = next(it)
                meta = metas[cur_i]
                if name != meta.name or tuple(t.shape) != meta.shape:
                    raise RuntimeError(f"internal error: weight sync streams {name} {tuple(t.shape)} where its "
                                       f"manifest has {meta.name} {meta.shape}")
                cur = _as_bytes(t, getattr(torch, meta.dtype))
                del t  # (cur keeps what is needed)
            assert cur is not None  # (to >= 0: tensor ``to`` has been read)
            return cur

        size = min(self.bucket_bytes, self.manifest.total_bytes)
        bufs = [torch.empty(size, dtype=torch.uint8, device=dev) for _ in range(min(2, len(self.plan)))]
        works: list = [None] * len(bufs)
        for k, pieces in enumerate(self.plan):
            slot = k % len(bufs)
            if works[slot] is not None:
                works[slot].wait()  # the buffer's previous broadcast is done before it is refilled
            buf = bufs[slot]
            for i, a, b, off in pieces:
                buf[off: off + b - a].copy_(advance(i)[a:b])
            works[slot] = self.group.broadcast(buf[: pieces[-1][3] + pieces[-1][2] - pieces[-1][1]])
        if metas:
            advance(len(metas) - 1)  # trailing empty tensors: every tensor is consumed (FSDP2's gathers)
        cur = None
        for w in works:
            if w is not None:
                w.wait()
        if next(it, None) is not None:
            raise RuntimeError("internal error: weight sync was given more tensors than its manifest names")


class WeightReceiver:
    """A receiving member of a :class:`SyncGroup`: copies every sync's bytes straight into
    ``module``'s tensors (or, where the dtype differs, through a staging buffer and a cast). With no
    module, ``sink(pairs, version)`` gets every tensor whole, as (name, tensor) pairs, at the end of
    each sync (a backend that loads weights itself, in place)."""

    def __init__(self, group: SyncGroup, module: torch.nn.Module | None, manifest: Manifest, bucket_bytes: int,
                 sink=None):
        self.group, self.manifest, self.bucket_bytes, self.sink = group, manifest, bucket_bytes, sink
        self.plan = manifest.plan(bucket_bytes)
        targets = module.state_dict(keep_vars=True) if module is not None else {}
        self.targets = [targets[m.name].data if module is not None else None for m in manifest.tensors]
        self.digest = manifest.digest()
        self.version: int | None = None

    @classmethod
    def connect(cls, group: SyncGroup, module: torch.nn.Module | None, partial: bool = False,
                sink=None) -> WeightReceiver:
        """Read the sender's manifest and check it against ``module`` (every name it sends must be
        one of the module's, of the same shape; unless ``partial``, every one of the module's must
        be sent); every member raises if any receiver refuses (naming the tensors). With ``sink``
        instead of a module, the backend behind it checks the names when it loads them."""
        if (module is None) == (sink is None):
            raise ValueError("internal error: a weight receiver writes into a module or hands tensors to a sink")
        manifest, bucket_bytes = pickle.loads(group.store.get("manifest"))
        problem = _mismatch(manifest, module, partial) if module is not None else ""
        group.store.set(f"verdict/{group.rank}", problem)
        _agree(group, not problem)
        return cls(group, module, manifest, bucket_bytes, sink)

    @torch.no_grad()
    def receive(self, version: int) -> None:
        """The next sync's weights into the module; the sender must send ``version`` (else every
        member raises, before any weights move)."""
        _check_header(self.group, version, self.digest)
        dev, metas = self.group.device, self.manifest.tensors
        size = min(self.bucket_bytes, self.manifest.total_bytes)
        bufs = [torch.empty(size, dtype=torch.uint8, device=dev) for _ in range(min(2, len(self.plan)))]

        def post(k: int):
            p = self.plan[k][-1]
            return self.group.broadcast(bufs[k % len(bufs)][: p[3] + p[2] - p[1]])

        stage: dict[int, torch.Tensor] = {}  # tensors that need a cast (or are not contiguous), or for the sink
        whole: list[tuple[str, torch.Tensor]] = []  # for the sink
        work = post(0) if self.plan else None
        for k, pieces in enumerate(self.plan):
            nxt = post(k + 1) if k + 1 < len(self.plan) else None  # into the other buffer, meanwhile
            assert work is not None  # (bucket k was posted: post(0), then each nxt)
            work.wait()
            buf = bufs[k % len(bufs)]
            for i, a, b, off in pieces:
                meta, target = metas[i], self.targets[i]
                wire = getattr(torch, meta.dtype)
                if target is not None and target.dtype == wire and target.is_contiguous():
                    target.reshape(-1).view(torch.uint8)[a:b].copy_(buf[off: off + b - a])
                    continue
                if i not in stage:
                    stage[i] = torch.empty(meta.nbytes, dtype=torch.uint8, device=dev)
                stage[i][a:b].copy_(buf[off: off + b - a])
                if b == meta.nbytes:
                    t = stage.pop(i).view(wire).view(meta.shape)
                    if target is None:
                        whole.append((meta.name, t))
                    else:
                        target.copy_(t)
            work = nxt
        if self.sink is not None:
            whole += [(m.name, torch.empty(m.shape, dtype=getattr(torch, m.dtype), device=dev))
                      for m in metas if m.nbytes == 0]  # (no bytes: never in a bucket)
            self.sink(whole, version)
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()  # the backend may read the weights from any stream
        self.version = version


def _mismatch(manifest: Manifest, module: torch.nn.Module, partial: bool) -> str:
    """Why ``module`` cannot take ``manifest``'s tensors ("" if it can)."""
    targets = module.state_dict(keep_vars=True)
    names = {m.name for m in manifest.tensors}
    extra = sorted(names - targets.keys())
    missing = [] if partial else sorted(targets.keys() - names)
    shapes = [f"{m.name} {m.shape} vs {tuple(targets[m.name].shape)}" for m in manifest.tensors
              if m.name in targets and tuple(targets[m.name].shape) != m.shape]
    if not (extra or missing or shapes):
        return ""
    return (f"weights do not match the model: missing {missing[:3]}, unexpected {extra[:3]}, "
            f"shapes differ {shapes[:3]}")


class WeightSyncUnavailable(RuntimeError):
    """The collective group could not form (``placement.ray.weight_sync=auto`` falls back)."""


class CollectiveSync:
    """The controller's handle on the collective path (``placement.ray.weight_sync``): forms the group
    once, then each call is one sync of the actor's trained parameters as a version.

    Members: the learner (rank 0 of the group: a :class:`~oppo.api.protocols.WeightLinkSender`), the
    ``rollout`` replicas (a :class:`~oppo.api.protocols.WeightLinkReceiver`) and, when the rollout backend is
    local, this process receiving into ``local``. Only those Protocols' methods are called. This
    process hosts the group's ``TCPStore``. ``wire_dtype``: the serving models' dtypes (per name).
    Raises :class:`WeightSyncUnavailable` if the group cannot form, :class:`WeightSyncError` if a
    receiver refuses the manifest.
    """

    def __init__(self, learner: WeightLinkSender, rollout: WeightLinkReceiver | None = None,
                 local: torch.nn.Module | None = None, *, bucket_bytes: int, wire_dtype=None,
                 timeout_s: float = 600.0):
        import ray

        if (rollout is None) == (local is None):
            raise ValueError("internal error: a collective weight sync goes to rollout replicas or to a local module")
        self.learner, self.rollout, self.local = learner, rollout, local
        self.store = serve_store(timeout_s)
        host, port = ray.util.get_node_ip_address(), self.store.port
        members = rollout.link_members if rollout is not None else 0
        world = 1 + members + (local is not None)
        senders = learner.open_weight_link(host, port, world, bucket_bytes, wire_dtype, timeout_s)
        receivers = rollout.open_weight_link(host, port, 1, world, timeout_s) if rollout is not None else None
        problems: list[str] = []
        refused = None
        self.receiver = None
        if local is not None:
            try:
                group = SyncGroup(host, port, world - 1, world, next(local.parameters()).device,
                                  timeout_s=timeout_s, store=self.store)
                self.receiver = WeightReceiver.connect(group, local, partial=True)
            except WeightSyncError as e:
                refused = e
            except Exception as e:  # noqa: BLE001 (reported: auto falls back)
                problems.append(f"the controller: {type(e).__name__}: {e}")
        problems += [w for w in senders() if w]
        if receivers is not None:
            problems += [w for w in receivers() if w]
        if refused is not None:
            raise refused
        if problems:
            raise WeightSyncUnavailable("the collective weight sync group could not form: " + "; ".join(problems))

    def __call__(self, version: int) -> None:
        """One sync: the learner sends the trained actor as ``version``; every receiver loads it (the
        rollout replicas' backends then sample as ``version``; a local backend's version is the
        caller's to set)."""
        sent = self.learner.send_weights(version)
        received = self.rollout.receive_weights(version) if self.rollout is not None else None
        failed = None
        if self.receiver is not None:
            try:
                self.receiver.receive(version)
            except Exception as e:  # noqa: BLE001 (the senders' outcome first: they name the cause too)
                failed = e
        sent()
        if received is not None:
            received()
        if failed is not None:
            raise failed

    def close(self) -> None:
        """Drop this process's member and the store (the remote members go with their actors)."""
        if self.receiver is not None:
            self.receiver.group.close()
        self.receiver = self.store = None


def load_source(target: torch.nn.Module, source: WeightSource, role: Role | None = None) -> None:
    """Copy the weights of ``source`` (``LearnerEngine.weights_out``: a module, ``(name, tensor)``
    pairs or :class:`~oppo.weights.remote.RemoteWeights`) into ``target``, cast to its dtypes; the
    pairs and remote weights may name only some of its tensors (the trained ones).

    ``role`` (the rollout backend's, ``kernels.streams``): the copy runs on its stream, after the last
    write of ``source`` by another role (the learner's update: an event, no host sync) and after the
    other roles that read ``target``; ``target`` is then marked written by it. A ``source`` that is
    ``target`` (fp32, no in-flight updates: the backend samples with the trained module) copies
    nothing; the backend's next decode step waits on the learner's event all the same."""
    from .precision import copy_weights

    if role is not None:
        with role:
            if isinstance(source, torch.nn.Module):
                role.read(source)
            if source is not target:
                role.write(target)
                load_source(target, source)
                role.wrote(target)
                if isinstance(source, torch.nn.Module):
                    role.read_done(source)  # (the learner's next write waits for the copy, not later decode steps)
        return
    if isinstance(source, torch.nn.Module):
        copy_weights(source, target)
    elif isinstance(source, RemoteWeights):
        import ray

        unpack_into(target, ray.get(source.ref), partial=True)
    else:
        own = target.state_dict()
        with torch.no_grad():
            for name, t in source:
                own[name].copy_(t)


def as_pairs(source: WeightSource) -> Iterable[tuple[str, torch.Tensor]]:
    """``source`` as ``(name, tensor)`` pairs (a backend that loads by name: ``BackendSpec.loads_own_weights``)."""
    if isinstance(source, torch.nn.Module):
        return source.state_dict().items()
    if isinstance(source, RemoteWeights):
        import ray

        return unpacked_tensors(ray.get(source.ref))
    return source


def unpacked_tensors(packed: Packed) -> list[tuple[str, torch.Tensor]]:
    """:func:`pack`'s arrays as (name, tensor) pairs, without a copy (read-only views)."""
    import warnings

    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only arrays: the reader only reads them
        for name, (arr, dtype) in packed.items():
            t = torch.from_numpy(arr)
            out.append((name, t.view(torch.bfloat16) if dtype == "bfloat16" else t))
    return out
