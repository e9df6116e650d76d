"""Weight loads into a local vLLM engine that do not serialise the model.

``collective_rpc`` would pickle the whole model at every update, so the trainer and vLLM's worker
share one buffer of checkpoint-format weights (:class:`BufferLayout`): a ``/dev/shm`` file on the CPU
(:class:`SharedWeights`), a CUDA tensor shared by its IPC handle on a GPU. The layout and handle
go once (:func:`map_in_worker`); each update copies every weight into its slot and sends a tiny RPC
(:func:`load_in_worker`). vLLM's worker loads into the live model (:class:`LiveLoader`: vLLM's
``load_weights`` plus its post-load processing), checks that every element arrived and that no
parameter aliases the buffer. The CUDA IPC path has not run yet. Design and costs: ``docs/vllm.md``,
"Weight loads".
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Protocol, cast

import torch
import torch.utils._python_dispatch

if TYPE_CHECKING:
    from multiprocessing.shared_memory import SharedMemory

ALIGN = 64  # bytes: each slot starts on a cache line (and any dtype's alignment)
SHM_DIR = "/dev/shm"
PREFIX = "oppo-vllm-"


class SharedUnavailable(RuntimeError):
    """No shared buffer here; the message says why (the caller falls back to the RPC path)."""


# ------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor lives in the buffer."""

    name: str
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]
    offset: int  # bytes from the buffer's start

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _dtype(self.dtype).itemsize


@dataclass(frozen=True)
class BufferLayout:
    """Every served tensor's slot, in the order the trainer sends them (vLLM's worker loads in this
    order: vLLM's loaders see the checkpoint's order)."""

    slots: tuple[Slot, ...]
    nbytes: int

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> "BufferLayout":
        """The layout of ``pairs``; floating-point tensors stored as ``dtype`` (the engine's: the cast
        vLLM's loaders would do), others as they are."""
        slots, offset = [], 0
        for name, w in pairs:
            dt = dtype if dtype is not None and w.is_floating_point() else w.dtype
            slot = Slot(name, str(dt).removeprefix("torch."), tuple(w.shape), offset)
            slots.append(slot)
            offset += -(-slot.nbytes // ALIGN) * ALIGN
        return cls(tuple(slots), max(offset, ALIGN))

    def index(self, pairs: list[tuple[str, torch.Tensor]]) -> list[int] | None:
        """The slot of each pair, or None if one has no slot of its name and shape."""
        where = {s.name: i for i, s in enumerate(self.slots)}
        out = []
        for name, w in pairs:
            i = where.get(name)
            if i is None or self.slots[i].shape != tuple(w.shape):
                return None
            out.append(i)
        return out if len(set(out)) == len(out) else None

    def runs(self, index: list[int], n: int) -> list[tuple[int, int]]:
        """``index`` (slots, in order) cut into at most ``n`` runs of about equal bytes, as
        (start, end) positions, cut only where the layer changes (``model.layers.3.``): the
        weights a fused vLLM layer loads from (q, k and v) stay in one run."""
        sizes = [self.slots[i].nbytes for i in index]
        target, runs, start, acc = sum(sizes) / max(n, 1), [], 0, 0
        for pos, i in enumerate(index):
            if pos > start and acc >= target and _layer(self.slots[i].name) != _layer(self.slots[index[pos - 1]].name):
                runs.append((start, pos))
                start, acc = pos, 0
            acc += sizes[pos]
        runs.append((start, len(index)))
        return runs

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Each slot as a tensor viewing the byte buffer ``buf`` (uint8, ``nbytes`` long)."""
        return [buf[s.offset:s.offset + s.nbytes].view(_dtype(s.dtype)).view(s.shape) for s in self.slots]


def _layer(name: str) -> str:
    """The layer a checkpoint tensor belongs to: its name up to the first number (``model.layers.3``),
    or the whole name."""
    m = re.match(r"(.*?\.\d+)\.", name)
    return m.group(1) if m else name


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ------------------------------------------------------------------------------------- trainer side


class SharedWeights:
    """The trainer's side of the shared buffer: created with a :class:`BufferLayout`, written at every
    update, closed (and on the CPU unlinked) by :meth:`close`. ``kind``: "shared-memory" or
    "cuda-ipc"."""

    def __init__(self, layout: BufferLayout, device: torch.device | str = "cpu"):
        device = torch.device(device)
        self.layout = layout
        self.kind = "cuda-ipc" if device.type == "cuda" else "shared-memory"
        self.name: str | None = None
        self._shm: SharedMemory | None = None
        self._buf: torch.Tensor | None = None  # None once closed
        if device.type == "cuda":
            buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        elif device.type == "cpu":
            buf = self._create_shm(layout.nbytes)
        else:
            raise SharedUnavailable(f"no shared weight buffer for device type {device.type!r}")
        self._buf = buf
        self._views = layout.views(buf)

    def _create_shm(self, nbytes: int) -> torch.Tensor:
        """A shared-memory file of ``nbytes`` (``self._shm``), as a byte tensor."""
        from multiprocessing import shared_memory

        if not os.path.isdir(SHM_DIR):
            raise SharedUnavailable(f"{SHM_DIR} does not exist (POSIX shared memory is not a file system here)")
        st = os.statvfs(SHM_DIR)
        free = st.f_bavail * st.f_frsize
        if free < nbytes:
            raise SharedUnavailable(f"{SHM_DIR} has {free / 2**20:.0f} MiB free, the weights need "
                                    f"{nbytes / 2**20:.0f} MiB (e.g. docker run --shm-size)")
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        # (registered with multiprocessing's resource tracker: unlinked if this process dies)
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        self.name = self._shm.name.lstrip("/")
        path = os.path.join(SHM_DIR, self.name)
        try:
            fd = os.open(path, os.O_RDWR)
            try:  # reserve the pages now: a full tmpfs raises here, not SIGBUS at a later write
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
        except OSError as e:
            self.close()
            raise SharedUnavailable(f"cannot reserve {nbytes / 2**20:.0f} MiB in {path}: {e}") from e
        return torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)

    @property
    def path(self) -> str | None:
        return os.path.join(SHM_DIR, self.name) if self.name else None

    def handle(self) -> dict:
        """What :func:`map_in_worker` needs to map the buffer (picklable, small)."""
        assert self._buf is not None, "the shared weight buffer is closed"
        if self.kind == "cuda-ipc":
            from torch.multiprocessing.reductions import reduce_tensor

            rebuild, args = reduce_tensor(self._buf)
            dev = self._buf.device
            return {"kind": self.kind, "rebuild": rebuild, "args": args,
                    "uuid": str(torch.cuda.get_device_properties(dev).uuid)}
        return {"kind": self.kind, "path": self.path, "nbytes": self.layout.nbytes}

    def write(self, pairs: Iterable[tuple[str, torch.Tensor]], index: list[int]) -> None:
        """Copy each tensor into its slot (``index``: :meth:`BufferLayout.index`); casts and moves across
        devices as ``Tensor.copy_`` does. On a GPU, waits for the copies."""
        assert self._buf is not None, "the shared weight buffer is closed"
        with torch.no_grad():
            for (_, w), i in zip(pairs, index):
                self._views[i].copy_(w)
        if self.kind == "cuda-ipc":
            torch.cuda.synchronize(self._buf.device)  # CPU-GPU sync point: vLLM's worker reads next

    def close(self) -> None:
        """Free the buffer; on the CPU unlink its file (idempotent)."""
        self._views, self._buf = [], None
        shm, self._shm = self._shm, None
        if shm is not None:
            try:
                shm.close()
            except BufferError:  # a view of it still lives somewhere: the mapping stays until it goes
                pass
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


# --------------------------------------------------------------------------------- vLLM's worker side


class _VLLMModel(Protocol):
    """What :class:`LiveLoader` calls on vLLM's model besides the ``torch.nn.Module`` methods."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str] | None: ...


class LiveLoader:
    """Loads checkpoint-format weights into vLLM's live model (``docs/vllm.md``, "Weight loads"): its
    ``load_weights``, then the post-load processing of each layer loaded. :meth:`build` returns
    None, with the reason, where the model holds layers it does not know how to reprocess."""

    def __init__(self, model: torch.nn.Module, unpacked: dict[str, torch.nn.Parameter]):
        self.model = model
        self.unpacked = unpacked  # layer name -> its checkpoint-format weight (CPU: repacked away)

    @classmethod
    def build(cls, model: torch.nn.Module) -> "tuple[LiveLoader | None, str]":
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        unpacked = {}
        for name, layer in model.named_modules():
            qm = getattr(layer, "quant_method", None)
            if qm is None:
                continue
            if not isinstance(qm, QuantizeMethodBase):
                continue  # (attention layers' kv-cache settings: nothing loaded from a checkpoint)
            if type(qm) not in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
                return None, f"layer {name} uses {type(qm).__name__}"
            w = layer._parameters.get("weight")
            if w is None:
                return None, f"layer {name} has no weight parameter"
            meta = _restore_weight(layer)
            if meta is None:
                return None, f"vLLM keeps no checkpoint-format record of layer {name}"
            if tuple(w.shape) != tuple(meta.shape):  # repacked and dropped (the CPU's oneDNN/sgl kernels)
                unpacked[name] = _materialize(meta, layer)
        return cls(model, unpacked), ""

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], expected_numel: int | None = None) -> dict:
        """Load ``weights``. ``expected_numel`` (the checkpoint tensors' total): count what vLLM's
        weight loaders copy and raise if it is less (a loader that loads nothing, or a part, as
        vLLM's own reload leaves in its records: :func:`_materialize`), by a dispatch mode over the
        loaders' ops (its cost: ``docs/benchmarks-notes.md``)."""
        model = self.model
        kept = {n: model.get_submodule(n)._parameters["weight"] for n in self.unpacked}
        t = time.perf_counter()
        for n, p in self.unpacked.items():
            model.get_submodule(n).weight = p  # the unpacked weight, with vLLM's weight loader
        loaded: set[str] | None = None
        counter = _CopyCounter()  # (entered only where the load is checked)
        try:
            with torch.no_grad(), counter if expected_numel is not None else contextlib.nullcontext():
                loaded = cast(_VLLMModel, model).load_weights(weights)
        finally:
            t_load = time.perf_counter()
            layers = _layers_loaded(model, loaded)
            for n, w in kept.items():  # not loaded this time: back as it was, no reprocessing
                if n not in layers:
                    model.get_submodule(n).register_parameter("weight", w)
            for n in layers:
                layer: Any = model.get_submodule(n)  # a vLLM layer: quant_method and the hooks are its own
                if self._lazy(layer):
                    continue
                layer.quant_method.process_weights_after_loading(layer)  # the CPU repacks here
                if hasattr(layer, "update_param_tp_status"):
                    layer.update_param_tp_status()
        if expected_numel is not None and counter.numel < expected_numel:
            raise RuntimeError(f"vLLM's weight loaders copied {counter.numel} elements of the {expected_numel} sent: "
                               f"the engine's weights are not the trainer's")
        return {"load_s": t_load - t, "process_s": time.perf_counter() - t_load, "layers": len(layers)}


    @staticmethod
    def _lazy(layer: torch.nn.Module) -> bool:
        """An input embedding on the CPU: its repacked copy (for use as an output head) is rebuilt
        at its first use, not now. vLLM's CPU backend packs every embedding for a matmul, but embeds
        with ``F.embedding`` of the live weight; the pack is used only where a model computes its
        logits with the embedding module itself (a tied head in some models; Llama ties by sharing
        the parameter with a separate head module, reprocessed as loaded). Saves a vocabulary x
        hidden repack per load (``docs/benchmarks-notes.md``). Needs eager execution (a
        Python closure replaces the kernel until its first call): oppo runs vLLM eager."""
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        if type(layer) is not VocabParallelEmbedding or not callable(getattr(layer, "cpu_linear", None)):
            return False

        def first_use(x, weight, bias):
            layer.quant_method.process_weights_after_loading(layer)  # sets layer.cpu_linear
            return layer.cpu_linear(x, weight, bias)

        # (torch's stub types a module attribute as a tensor or a module; any value may be set)
        layer.cpu_linear = first_use  # type: ignore[assignment]
        return True


class _CopyCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the elements ``copy_`` writes (vLLM's weight loaders narrow, then copy)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.numel += args[0].numel()
        return func(*args, **(kwargs or {}))


def _restore_weight(layer: torch.nn.Module) -> torch.Tensor | None:
    """vLLM's meta-device record of ``layer``'s checkpoint-format weight (with its weight loader),
    taken when the model was built (``record_metadata_for_reloading``)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return None
    info = LAYERWISE_INFO.get(layer)
    if info is None:
        return None
    return info.restore_metadata[0].get("weight")


def _materialize(meta: torch.Tensor, layer: torch.nn.Module) -> torch.nn.Parameter:
    """A real parameter shaped as the meta record, with its attributes (weight loader bound to
    ``layer``), as vLLM's reload materialises it (the record itself is left as it is)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    with LAYERWISE_INFO[layer].restore_device:
        p = materialize_meta_tensor(meta)  # (of the record's class, a Parameter, with a copy of its attributes)
    p = cast(torch.nn.Parameter, restore_layer_refs(p, layer))
    # after one of vLLM's own in-place reloads the record holds its deferring wrapper of the loader
    # (``online_process_loader``), which outside that reload loads nothing: unwrap it, as vLLM does
    loader = getattr(p, "weight_loader", None)
    if loader is not None:
        while getattr(loader, "__name__", "") == "online_process_loader":
            loader = loader.__wrapped__
        p.weight_loader = loader  # type: ignore[attr-defined]  # (vLLM's attribute of its parameters)
    return p


def _layers_loaded(model: torch.nn.Module, loaded: set[str] | None) -> list[str]:
    """The names of the layers with a quantization method (vLLM's post-load processing) holding a
    parameter in ``loaded`` (vLLM's names; None: a model that does not say, so every such layer).
    By identity, not name: a head tied to the embedding holds the embedding's parameter under the
    embedding's name only, and must be reprocessed too."""
    ids = None if loaded is None else {id(p) for n, p in model.named_parameters() if n in loaded}
    out = []
    for name, layer in model.named_modules():
        if not hasattr(getattr(layer, "quant_method", None), "process_weights_after_loading"):
            continue
        if ids is None or any(id(p) in ids for p in layer._parameters.values() if p is not None):
            out.append(name)
    return out


@dataclass
class _Mapped:
    """vLLM's worker's view of the buffer (kept on vLLM's worker object between RPCs)."""

    buf: torch.Tensor
    layout: BufferLayout
    views: list[torch.Tensor]
    loader: LiveLoader | None
    why_not_live: str
    version: int = -1


def open_buffer(handle: dict) -> torch.Tensor:
    if handle["kind"] == "shared-memory":
        return torch.from_file(handle["path"], shared=True, size=handle["nbytes"], dtype=torch.uint8)
    if handle["kind"] == "cuda-ipc":
        here = torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(here).uuid)
        if handle["uuid"] != uuid:  # (another GPU: loads would copy across devices, or fail)
            raise SharedUnavailable(f"the buffer lives on GPU {handle['uuid']}, vLLM's worker runs on {uuid}")
        args = list(handle["args"])
        args[6] = here  # storage_device: this process's index of that GPU (its CUDA_VISIBLE_DEVICES may differ)
        return handle["rebuild"](*args)
    raise SharedUnavailable(f"unknown buffer kind {handle['kind']!r}")


def map_in_worker(worker, handle: dict, layout: BufferLayout) -> str:
    """Runs in vLLM's worker process (``collective_rpc``), once per buffer: map it and choose the
    loader. Returns "live" or "reload: <why>" (the loader it will use)."""
    old = getattr(worker, "_oppo_mapped", None)
    worker._oppo_mapped = None
    del old
    buf = open_buffer(handle)
    model = worker.model_runner.get_model()
    try:
        loader, why = LiveLoader.build(model)
    except Exception as e:  # noqa: BLE001 (another vLLM's internals: its own reload path then)
        loader, why = None, f"{type(e).__name__}: {e}"
    worker._oppo_mapped = _Mapped(buf, layout, layout.views(buf), loader, why)
    return "live" if loader is not None else f"reload: {why}"


def unmap_in_worker(worker) -> None:
    """Runs in vLLM's worker process: drop the mapping (before the trainer frees the buffer)."""
    worker._oppo_mapped = None


def load_in_worker(worker, version: int, index: list[int] | None = None) -> dict:
    """Runs in vLLM's worker process (``collective_rpc``): load the weights the trainer wrote into
    the mapped buffer (``index``: those slots only; None: every slot) and sample as ``version``
    from now on. Returns the version and its timings."""
    m: _Mapped | None = getattr(worker, "_oppo_mapped", None)
    if m is None:
        raise RuntimeError("no shared weight buffer is mapped in this vLLM worker")
    t = time.perf_counter()
    slots = range(len(m.views)) if index is None else index
    weights = ((m.layout.slots[i].name, m.views[i]) for i in slots)
    if m.loader is not None:
        stats = m.loader.load(weights, sum(_numel(m.layout.slots[i].shape) for i in slots))
    else:
        worker.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        stats = {}
    runner = worker.model_runner
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as reload_weights does
        if hasattr(runner, reset):
            getattr(runner, reset)()
    if m.buf.is_cuda:
        torch.cuda.synchronize(m.buf.device)  # CPU-GPU sync point: the trainer may write again after we return
    _check_not_aliased(runner.get_model(), m.buf)
    m.version = version
    return {"version": version, "worker_s": time.perf_counter() - t, **stats}


def _check_not_aliased(model: torch.nn.Module, buf: torch.Tensor) -> None:
    """Raise if a parameter or buffer of ``model`` lives in the shared buffer: the trainer's next
    write would change the engine's weights without a load."""
    lo = buf.data_ptr()
    hi = lo + buf.numel()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device == buf.device and t.numel() and lo <= t.data_ptr() < hi:
            raise RuntimeError(f"vLLM's {name} aliases the shared weight buffer (a weight loader kept a view "
                               f"instead of copying); oppo cannot load weights this way into this model")
