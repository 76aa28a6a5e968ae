"""The activation store: one chunk's saved activations go to host memory after its forward and come back
before its backward.

A chunk is one stage's forward of one microbatch, keyed by anything hashable (the runtime uses
``(stage_index, microbatch_index)``). Its life in the store, driven by the schedule's actions::

    with store.capture(key, keep=...):   # F: autograd's saved tensors are recorded, not copied yet
        out = stage(x)
    store.offload(key)                    # OFFLOAD: device -> host, device memory released
    store.reload(key)                     # RELOAD: host -> one device buffer per dtype
    ...backward (I, then W)...            # both unpack saved tensors: the chunk stays reloaded
    store.release(key)                    # after the chunk's last backward: buffers dropped / pooled

Why saved-tensor hooks: they see exactly what autograd keeps for backward (the activation memory that
pipeline schedules trade against bubbles), whatever the model is, with no change to it. What is not
worth moving stays where it is: parameters and views of them (they live on the device anyway), tiny
tensors (copy latency dominates; "tiny" is measured on the whole storage, since keeping a small view of
a large tensor would keep all of it), tensors the pipeline already holds (``keep``: the stage input
sits in torch's receive buffer for the whole step), and tensors on another device. A tensor that is a
view of a storage already recorded for the chunk is recorded as a view of it and copied once.

The copies are planned when the capture ends: per storage, the span its saved views cover (one copy),
unless the views cover less than half of that span (a small slice of a large tensor), then each view is
copied compactly. Segments of one dtype are laid out back to back, 256-byte aligned, in one host buffer;
reload is therefore one host-to-device copy per dtype, into one contiguous device buffer, and every saved
tensor is rebuilt with ``as_strided`` on it.

CUDA: copies run on one copy stream per direction (``lanes="duplex"``, the default) or on one, ordered by
``wait_stream`` after the compute that produced the tensors (offload) or that may still read the memory a
reload buffer reuses; host buffers are pinned and pooled per dtype (`pp_offload.runtime.host_pool`).
Compute waits on a reload's event only when it first unpacks a tensor of that chunk (once per stream), so
it never waits on a copy it does not need. CPU: exactly the same code, with synchronous copies into
ordinary host buffers, so views, dtypes, pooling and the order checks are testable everywhere.

autograd skips its in-place modification check for tensors saved through hooks; the store redoes it
(at offload, and at unpack of a chunk never offloaded), so a saved tensor changed in place is an error
here as it is without the store, never a silently wrong gradient. A reloaded chunk's device buffers are
checked too (at every unpack): a recomputation that changed an unpacked tensor in place would otherwise
feed the changed values to the chunk's next backward pass (W after I).

Selective recompute (`pp_offload.runtime.recompute`) keeps the outputs of the ops it does not recompute
in a cache of its own, outside autograd's saved tensors. While a capture runs, that cache hands them to
the store instead (`save_in_capture`), so they join the chunk being captured (its views, its copies, its
version checks, its stats: ``ChunkStats.cached``) and move with it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from pp_offload.runtime.host_pool import HostPool, PoolStats

__all__ = [
    "KEEP_REASONS",
    "ActivationStore",
    "ChunkStats",
    "PoolStats",
    "SavedInCapture",
    "StoreStats",
    "save_in_capture",
]

_ALIGN_BYTES = 256
"""Segments start on this boundary in host and device buffers, and a storage span starts on it relative
to the original storage: reloaded tensors keep the original pointer alignment modulo 256 bytes, which
vectorized kernels and cuBLAS/cuDNN algorithm choice depend on."""

# chunk states
_CAPTURING = "capturing"
_CAPTURED = "captured"
_OFFLOADED = "offloaded"
_RELOADED = "reloaded"
_RELEASED = "released"

# why a saved tensor was left in place (ChunkStats.kept keys)
KEEP_REASONS = ("parameter", "small", "keep", "other_device", "unsupported")


@dataclass(frozen=True)
class ChunkStats:
    """One chunk as the store sees it. Bytes are device bytes unless said otherwise."""

    state: str
    """capturing, captured, offloaded (on CUDA the copy may still be in flight) or reloaded."""
    captured_bytes: int
    """What offload moves and frees: the planned copy segments (views counted once)."""
    offloaded_bytes: int
    """Bytes of this chunk held in host memory (0 before offload)."""
    resident_bytes: int
    """Device bytes the store keeps alive for it now: its recorded tensors until offload, its reload
    buffers after reload, 0 in between."""
    kept_bytes: int
    """Bytes of the distinct storages left in place on the device, parameters excepted (owned elsewhere:
    they stay resident whatever the store does)."""
    stored: int
    """Saved tensors that started a new storage record."""
    views: int
    """Saved tensors recorded as views of an already recorded storage (no copy of their own)."""
    copies: int
    """Device-to-host copies offload issues for the chunk."""
    kept: dict[str, int]
    """Saved tensors left in place, by reason (see KEEP_REASONS)."""
    cached: int = 0
    """Of the recorded or kept tensors, those handed over by selective recompute's cache (outputs of
    the ops it does not recompute, `save_in_capture`) rather than saved by autograd."""


@dataclass(frozen=True)
class StoreStats:
    chunks: dict[Hashable, ChunkStats]
    host_pool: dict[torch.dtype, PoolStats]
    resident_bytes: int
    host_pool_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (keys as strings)."""
        return {
            "chunks": {str(k): asdict(v) for k, v in self.chunks.items()},
            "host_pool": {str(k).removeprefix("torch."): asdict(v) for k, v in self.host_pool.items()},
            "resident_bytes": self.resident_bytes,
            "host_pool_bytes": self.host_pool_bytes,
        }


class _Chunk:
    """Everything the store knows about one chunk; saved-tensor handles point here."""

    __slots__ = (
        "key",
        "state",
        "keep_ptrs",
        "keep_refs",
        "records",
        "originals",
        "versions",
        "groups",
        "group_of",
        "kept",
        "kept_storages",
        "stored",
        "n_views",
        "views",
        "segments",
        "totals",
        "captured_bytes",
        "copies",
        "host",
        "device",
        "offload_event",
        "reload_event",
        "alloc_stream",
        "waited",
        "device_versions",
        "cached",
    )

    def __init__(self, key: Hashable, keep: list[torch.Tensor]) -> None:
        self.key = key
        self.state = _CAPTURING
        # held during the capture so that no kept storage is freed and its address reused meanwhile
        self.keep_refs = keep
        self.keep_ptrs = {t.untyped_storage().data_ptr() for t in keep} - {0}
        # per recorded tensor: (group, size, stride, storage_offset), and its detached original until offload
        self.records: list[tuple[int, torch.Size, tuple[int, ...], int]] = []
        self.originals: list[torch.Tensor] | None = []
        self.versions: list[int] = []  # their version counters when saved
        # per recorded storage and dtype: [dtype, first record, lo, hi, covered numel, record indices]
        self.groups: list[list[Any]] = []
        self.group_of: dict[tuple[int, int, torch.dtype], int] = {}
        self.kept = dict.fromkeys(KEEP_REASONS, 0)
        self.kept_storages: dict[int, int] = {}  # data_ptr -> nbytes
        self.stored = 0
        self.n_views = 0
        # planned when the capture ends: per record (dtype, size, stride, offset in the dtype's buffer);
        # per copy (dtype, source, offset, numel, shape for a compact copy or None for a span)
        self.views: list[tuple[torch.dtype, torch.Size, tuple[int, ...], int]] = []
        self.segments: list[tuple[torch.dtype, torch.Tensor, int, int, torch.Size | None]] | None = []
        self.totals: dict[torch.dtype, int] = {}
        self.captured_bytes = 0
        self.copies = 0
        self.host: dict[torch.dtype, torch.Tensor] = {}
        self.device: dict[torch.dtype, torch.Tensor] = {}
        self.offload_event: Any = None
        self.reload_event: Any = None
        self.alloc_stream: int | None = None
        self.waited: set[int] = set()
        self.device_versions: dict[torch.dtype, int] = {}  # of the reload buffers, after their copy
        self.cached = 0


class ActivationStore:
    """Saved activations of pipeline chunks, moved to host memory between forward and backward.

    Args:
        device: the compute device whose activations are moved (``"cuda"``, ``"cuda:1"``, ``"cpu"``).
            Saved tensors on any other device are left in place.
        min_numel: saved tensors whose whole storage holds at most this many elements (of their dtype)
            stay on the device (copying them costs more latency than their memory is worth).
        pin_memory: pin host buffers (default: True on CUDA; CUDA only). Pinned memory is what makes
            the copies asynchronous and full-bandwidth.
        copy_stream: the CUDA stream offloads run on (default: a new stream of ``device``).
        reload_stream: the CUDA stream reloads run on (default: per ``lanes``).
        lanes: ``"duplex"`` (default): reloads get a stream of their own (a new one unless
            ``reload_stream`` is given), one copy lane per direction, so a reload never queues behind an
            offload on a full-duplex host link (what the planner and the simulator assume by default,
            `pp_offload.order.offload.OffloadPolicy.lanes`); ``"shared"``: reloads run on ``copy_stream``,
            one lane, copies in action order.
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        min_numel: int = 1024,
        pin_memory: bool | None = None,
        copy_stream: Any = None,
        reload_stream: Any = None,
        lanes: str = "duplex",
    ) -> None:
        if lanes not in ("duplex", "shared"):
            raise ValueError(
                f"lanes must be 'duplex' (one copy stream per direction) or 'shared', got {lanes!r}"
            )
        if lanes == "shared" and reload_stream is not None:
            raise ValueError("lanes='shared' runs reloads on copy_stream; do not pass a reload_stream too")
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    "offload asked to use CUDA streams on a machine without CUDA; "
                    "use device='cpu' or run on a GPU"
                )
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        elif device.type != "cpu":
            raise ValueError(f"ActivationStore supports device 'cuda' or 'cpu', got {str(device)!r}")
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel must be an int >= 0, got {min_numel!r}")
        cuda = device.type == "cuda"
        if pin_memory is None:
            pin_memory = cuda
        if pin_memory and not cuda:
            raise ValueError("pin_memory=True needs a CUDA device; pinned memory only speeds up GPU copies")
        if (copy_stream is not None or reload_stream is not None) and not cuda:
            raise ValueError("copy_stream/reload_stream are CUDA streams; a CPU store copies synchronously")
        if cuda and copy_stream is None:
            copy_stream = torch.cuda.Stream(device=device)
        if cuda and reload_stream is None and lanes == "duplex":
            reload_stream = torch.cuda.Stream(device=device)
        self.device = device
        self.min_numel = min_numel
        self.copy_stream = copy_stream
        """The CUDA stream offloads run on (None on CPU); synchronize it to wait for them."""
        self.reload_stream = reload_stream if reload_stream is not None else copy_stream
        """The CUDA stream reloads run on (its own with ``lanes="duplex"``, else ``copy_stream``; None on
        CPU)."""
        self._cuda = cuda
        self._two_lanes = cuda and self.reload_stream is not self.copy_stream
        self._pool = HostPool(pin_memory=bool(pin_memory))
        self._chunks: dict[Hashable, _Chunk] = {}
        self.last_captured: dict[Hashable, int] = {}
        """Per chunk key, the bytes its latest capture recorded (what offload moves: the chunk's saved
        activations, views counted once). Kept after release and reset, so a step's chunk sizes can be
        read after the step (e.g. by `pp_offload.plan.auto.measure_step`); one entry per key."""

    # --- the chunk's life ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def capture(self, key: Hashable, *, keep: Any = ()) -> Iterator[None]:
        """Record the tensors autograd saves while the body runs (the forward of chunk ``key``).

        ``keep``: tensors the pipeline holds anyway (the stage's inputs from its receive buffers, buffers
        of the module): saved tensors sharing storage with one of them are not copied. Lists, tuples and
        dicts are searched, other objects ignored, so a stage's arguments can be passed as they are.
        Nothing is copied here; the copies are planned when the body ends.
        """
        if key in self._chunks:
            raise ValueError(
                f"chunk {key!r} is already in the store ({self._chunks[key].state}); "
                "release it before capturing it again"
            )
        chunk = _Chunk(key, [t for t in _tensors_in(keep) if t.layout is torch.strided])
        self._chunks[key] = chunk
        captures = _active_captures()
        captures.append((self, chunk))
        try:
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, chunk), self._unpack):
                yield
        finally:
            captures.pop()
            self._plan(chunk)
            chunk.state = _CAPTURED
            self.last_captured[key] = chunk.captured_bytes

    def offload(self, key: Hashable) -> None:
        """Start copying chunk ``key`` to host memory; its device memory is released when the copy ends.

        A chunk already reloaded (its backward's I ran, its W has not) is offloaded again without a copy:
        its host copy is still exact, so its device buffers are just dropped; reload it again before W.

        CUDA: the copy stream first waits for the work already queued on the current stream (the forward
        that produced the tensors), copies into pinned pool buffers, and records an event. Each source is
        marked with ``record_stream(copy_stream)`` and the store drops its references at once: the
        caching allocator then keeps the memory from reuse until the copy stream has passed the copies
        (checked without a host sync when it next allocates). That frees memory as soon as the copy ends,
        instead of at the store's next call that polls an event.
        """
        chunk = self._get(key, "offload")
        if chunk.state is _CAPTURING:
            raise RuntimeError(f"offload of chunk {key!r} inside its own capture; offload after its forward")
        if chunk.state is _RELOADED:
            # Saved tensors are read-only to backward, so the host copy is still exact: dropping the device
            # buffers frees them with no copy (zero-bubble orders: between I and W). CUDA: the buffers were
            # marked used by the streams that read them, so the allocator keeps them until those pass.
            _check_device_versions(chunk)
            chunk.device = {}
            chunk.state = _OFFLOADED
            return
        if chunk.state is not _CAPTURED:
            raise RuntimeError(f"chunk {key!r} is already {chunk.state}: offload it once, after its forward")
        for i in range(len(chunk.originals)):
            _check_version(chunk, i)
        waits = []
        for dtype, numel in chunk.totals.items():
            chunk.host[dtype], last_use = self._pool.take(dtype, numel)
            waits.append(last_use)
        with self._on(self.copy_stream, after=waits if self._two_lanes else ()):
            for dtype, src, offset, numel, shape in chunk.segments:
                dst = chunk.host[dtype].narrow(0, offset, numel)
                if shape is not None:
                    dst = dst.view(shape)
                dst.copy_(src, non_blocking=self._cuda)
            chunk.offload_event = self._record_event(self.copy_stream)
        if self.device.type == "cuda":
            for _, src, _, _, _ in chunk.segments:
                src.record_stream(self.copy_stream)
        chunk.segments = None
        chunk.originals = None
        chunk.versions = []
        chunk.state = _OFFLOADED

    def reload(self, key: Hashable) -> None:
        """Start copying chunk ``key`` back into one new device buffer per dtype; its saved tensors are
        rebuilt as views of those buffers when backward unpacks them.

        CUDA: the buffers are allocated on the current (compute) stream, so they reuse memory the
        activations freed; the reload stream therefore first waits for the work queued on it (that memory
        may still be read by kernels queued earlier), and, with two lanes, for the chunk's offload. The
        first unpack of a tensor of this chunk on a stream makes that stream wait on the reload's event.
        """
        chunk = self._get(key, "reload")
        if chunk.state is not _OFFLOADED:
            if chunk.state is _RELOADED:
                raise RuntimeError(f"chunk {key!r} is already reloaded: reload it once, before its backward")
            raise RuntimeError(
                f"reload of chunk {key!r} before its offload (it is {chunk.state}): "
                "the order must OFFLOAD a chunk after its F before it can RELOAD it"
            )
        chunk.device = {
            dtype: torch.empty(numel, dtype=dtype, device=self.device)
            for dtype, numel in chunk.totals.items()
        }
        with self._on(self.reload_stream, after=[chunk.offload_event] if self._two_lanes else ()):
            for dtype, buf in chunk.device.items():
                buf.copy_(chunk.host[dtype].narrow(0, 0, buf.numel()), non_blocking=self._cuda)
            chunk.reload_event = self._record_event(self.reload_stream)
        chunk.device_versions = {dtype: buf._version for dtype, buf in chunk.device.items()}
        if self.device.type == "cuda":
            chunk.alloc_stream = torch.cuda.current_stream(self.device).cuda_stream
            for buf in chunk.device.values():
                buf.record_stream(self.reload_stream)
        chunk.waited = set()
        chunk.state = _RELOADED

    def release(self, key: Hashable) -> None:
        """Forget chunk ``key``: device buffers dropped, host buffers back to the pool.

        Call it after the chunk's last backward (W with split backward: I and W both unpack saved
        tensors). A backward of the chunk after this raises instead of reading freed memory.
        """
        chunk = self._chunks.pop(key, None)
        if chunk is None:
            raise KeyError(
                f"release of chunk {key!r}, which is not in the store (never captured, or released)"
            )
        self._drop(chunk)

    def reset(self) -> None:
        """Release every chunk (e.g. after a failed step); the host pool is kept for the next step."""
        chunks, self._chunks = self._chunks, {}
        for chunk in chunks.values():
            self._drop(chunk)

    # --- measurements ---------------------------------------------------------------------------------

    def capturing(self) -> Hashable | None:
        """The key of this store's innermost capture running on this thread, None when none runs."""
        return next((c.key for store, c in reversed(_active_captures()) if store is self), None)

    def recorded(self, key: Hashable) -> int:
        """How many saved tensors chunk ``key``'s running capture has recorded so far: a mark for
        `recorded_bytes`."""
        return len(self._capturing(key, "recorded").records)

    def recorded_bytes(self, key: Hashable, start: int, stop: int) -> int:
        """Bytes a capture of only the tensors chunk ``key`` recorded from mark ``start`` to ``stop``
        (`recorded`) would move: its own copy plan (storages grouped, views counted once, whole spans or
        compact views), as if those tensors had been captured under a key of their own.

        Why: budget offload captures each decoder layer, or each sub-layer unit, under its own key; a
        probe that captures whole chunks (`pp_offload.plan.probe.measure_step`) marks the units'
        boundaries and reads here what each unit would move, by the rules that move it."""
        chunk = self._capturing(key, "recorded_bytes")
        if not 0 <= start <= stop <= len(chunk.records):
            raise ValueError(f"marks {start}..{stop} out of the {len(chunk.records)} records of {key!r}")
        groups: dict[int, list[Any]] = {}  # group -> [lo, hi, covered, distinct views]
        for g, size, stride, offset in chunk.records[start:stop]:
            end = _extent(size, stride, offset)
            span = groups.setdefault(g, [offset, end, 0, set()])
            span[0], span[1] = min(span[0], offset), max(span[1], end)
            span[2] += math.prod(size)
            span[3].add((tuple(size), tuple(stride), offset))
        total = 0
        for g, (lo, hi, covered, views) in groups.items():
            dtype = chunk.groups[g][0]
            whole = _whole_span(dtype, lo, hi, covered)
            numel = whole[1] if whole is not None else sum(math.prod(v[0]) for v in views)
            total += numel * dtype.itemsize
        return total

    def _capturing(self, key: Hashable, what: str) -> _Chunk:
        chunk = self._get(key, what)
        if chunk.state is not _CAPTURING:
            raise ValueError(f"{what} reads a running capture; chunk {key!r} is {chunk.state}")
        return chunk

    def state(self, key: Hashable) -> str | None:
        """Chunk ``key``'s state (capturing, captured, offloaded, reloaded), None when not in the store."""
        chunk = self._chunks.get(key)
        return None if chunk is None else chunk.state

    def resident_bytes(self) -> int:
        """Device bytes the store keeps alive now (see ChunkStats.resident_bytes)."""
        return sum(_resident(c) for c in self._chunks.values())

    def stats(self) -> StoreStats:
        chunks = {}
        for key, c in self._chunks.items():
            state = c.state
            if state is _OFFLOADED and c.offload_event is not None and not c.offload_event.query():
                state = "offloading"
            chunks[key] = ChunkStats(
                state=state,
                captured_bytes=c.captured_bytes,
                offloaded_bytes=c.captured_bytes if c.host else 0,
                resident_bytes=_resident(c),
                kept_bytes=sum(c.kept_storages.values()),
                stored=c.stored,
                views=c.n_views,
                copies=c.copies,
                kept=dict(c.kept),
                cached=c.cached,
            )
        pool = self._pool.stats()
        return StoreStats(
            chunks=chunks,
            host_pool=pool,
            resident_bytes=sum(s.resident_bytes for s in chunks.values()),
            host_pool_bytes=sum(p.bytes for p in pool.values()),
        )

    # --- internals ------------------------------------------------------------------------------------

    def _get(self, key: Hashable, what: str) -> _Chunk:
        chunk = self._chunks.get(key)
        if chunk is None:
            raise KeyError(
                f"{what} of chunk {key!r}, which is not in the store (never captured, or released)"
            )
        return chunk

    def _drop(self, chunk: _Chunk) -> None:
        last_use = chunk.reload_event if chunk.reload_event is not None else chunk.offload_event
        for buf in chunk.host.values():
            self._pool.give(buf, last_use)
        chunk.host = {}
        chunk.device = {}
        chunk.originals = None
        chunk.segments = None
        chunk.state = _RELEASED

    def _pack(self, chunk: _Chunk, t: torch.Tensor) -> Any:
        """Saved-tensor pack hook: a tensor left in place is returned detached (a saved output would
        otherwise hold its own grad_fn: a reference cycle), a recorded one as (chunk, record index)."""
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            chunk.kept["parameter"] += 1
            return t.detach()
        if t.device != self.device:
            return self._keep(chunk, t, "other_device")
        if (
            type(t) is not torch.Tensor
            or t.layout is not torch.strided
            or t.is_quantized
            or t.is_nested
            or t.is_conj()
            or t.is_neg()
        ):
            return self._keep(chunk, t, "unsupported")
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in chunk.keep_ptrs:
            return self._keep(chunk, t, "keep")
        numel = t.numel()
        nbytes = storage.nbytes()
        if numel == 0 or nbytes <= self.min_numel * t.element_size():
            return self._keep(chunk, t, "small")
        size, stride, offset = t.shape, t.stride(), t.storage_offset()
        end = _extent(size, stride, offset)
        index = len(chunk.records)
        gkey = (ptr, nbytes, t.dtype)
        g = chunk.group_of.get(gkey)
        if g is None:
            g = chunk.group_of[gkey] = len(chunk.groups)
            chunk.groups.append([t.dtype, index, offset, end, numel, [index]])
            chunk.stored += 1
        else:
            group = chunk.groups[g]
            group[2] = min(group[2], offset)
            group[3] = max(group[3], end)
            group[4] += numel
            group[5].append(index)
            chunk.n_views += 1
        chunk.records.append((g, size, stride, offset))
        chunk.originals.append(t.detach())
        chunk.versions.append(t._version)
        return (chunk, index)

    @staticmethod
    def _keep(chunk: _Chunk, t: torch.Tensor, reason: str) -> torch.Tensor:
        chunk.kept[reason] += 1
        if reason != "other_device" and t.layout is torch.strided and type(t) is torch.Tensor:
            storage = t.untyped_storage()
            chunk.kept_storages[storage.data_ptr()] = storage.nbytes()
        return t.detach()

    def _unpack(self, packed: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: a tensor left in place as is, a recorded one rebuilt."""
        if isinstance(packed, torch.Tensor):
            return packed
        chunk, index = packed
        state = chunk.state
        if state is _RELOADED:
            dtype, size, stride, offset = chunk.views[index]
            _check_device_versions(chunk)
            if self.device.type == "cuda":
                self._wait_for_reload(chunk)
            return chunk.device[dtype].as_strided(size, stride, offset)
        if state is _CAPTURED or state is _CAPTURING:
            _check_version(chunk, index)
            return chunk.originals[index]
        if state is _OFFLOADED:
            raise RuntimeError(
                f"activations of {chunk.key!r} were offloaded but not reloaded before backward: "
                "the order has no RELOAD for this chunk before its I/B/W"
            )
        raise RuntimeError(
            f"activations of {chunk.key!r} were released before a backward used them: "
            "release a chunk only after its last backward (W with split backward)"
        )

    def _wait_for_reload(self, chunk: _Chunk) -> None:
        """CUDA: the current stream waits for the chunk's reload, once per stream. A stream other than
        the one the buffers were allocated on also marks them used, so the allocator does not hand
        their memory out at release while kernels queued there may still read it."""
        stream = torch.cuda.current_stream(self.device)
        if stream.cuda_stream in chunk.waited:
            return
        stream.wait_event(chunk.reload_event)
        chunk.waited.add(stream.cuda_stream)
        if stream.cuda_stream != chunk.alloc_stream:
            for buf in chunk.device.values():
                buf.record_stream(stream)

    @contextlib.contextmanager
    def _on(self, stream: Any, *, after: Iterable[Any] = ()) -> Iterator[None]:
        """CUDA: run the body on ``stream``, after the work queued so far on the current stream and after
        the given events. CPU: run it as is (copies are synchronous)."""
        if self.device.type == "cuda":
            stream.wait_stream(torch.cuda.current_stream(self.device))
            for event in after:
                if event is not None:
                    stream.wait_event(event)
            with torch.cuda.stream(stream):
                yield
        else:
            yield

    def _record_event(self, stream: Any) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(stream)
            return event
        return None

    @staticmethod
    def _plan(chunk: _Chunk) -> None:
        """Lay the chunk's recorded storages out in one buffer per dtype (see the module docstring)."""
        views: list[Any] = [None] * len(chunk.records)
        segments = []
        totals: dict[torch.dtype, int] = {}
        for dtype, first, lo, hi, covered, indices in chunk.groups:
            align = max(1, _ALIGN_BYTES // dtype.itemsize)
            whole = _whole_span(dtype, lo, hi, covered)
            if whole is not None:
                span_lo, span = whole
                offset = _round_up(totals.get(dtype, 0), align)
                totals[dtype] = offset + span
                src = chunk.originals[first].as_strided((span,), (1,), span_lo)
                segments.append((dtype, src, offset, span, None))
                for i in indices:
                    _, size, stride, storage_offset = chunk.records[i]
                    views[i] = (dtype, size, stride, offset + storage_offset - span_lo)
                continue
            # a small part of a large storage: copy each distinct view compactly
            placed: dict[tuple[Any, ...], tuple[Any, ...]] = {}
            for i in indices:
                _, size, stride, storage_offset = chunk.records[i]
                where = (size, stride, storage_offset)
                if where not in placed:
                    numel = math.prod(size)
                    offset = _round_up(totals.get(dtype, 0), align)
                    totals[dtype] = offset + numel
                    segments.append((dtype, chunk.originals[i], offset, numel, size))
                    placed[where] = (dtype, size, _contiguous_strides(size), offset)
                views[i] = placed[where]
        chunk.views = views
        chunk.segments = segments
        chunk.copies = len(segments)
        chunk.totals = totals
        chunk.captured_bytes = sum(numel * dtype.itemsize for dtype, _, _, numel, _ in segments)
        chunk.groups = []
        chunk.group_of = {}
        chunk.keep_refs = []


def _extent(size: Any, stride: Any, offset: int) -> int:
    """One past the last storage element a strided view reaches."""
    return offset + 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))


def _whole_span(dtype: torch.dtype, lo: int, hi: int, covered: int) -> tuple[int, int] | None:
    """(aligned start, length) of the one copy of a storage's span its views ``lo..hi`` cover, or None
    when they cover less than half of it (each view is then copied compactly)."""
    align = max(1, _ALIGN_BYTES // dtype.itemsize)
    span_lo = lo - lo % align
    span = hi - span_lo
    return (span_lo, span) if span <= 2 * covered else None


def _check_version(chunk: _Chunk, index: int) -> None:
    """autograd skips its in-place check for tensors saved through hooks; this restores it."""
    now = chunk.originals[index]._version
    if now != chunk.versions[index]:
        raise RuntimeError(
            f"a tensor saved for backward in chunk {chunk.key!r} was modified by an in-place operation after "
            f"it was saved (version {chunk.versions[index]}, now {now}); autograd refuses this too: use the "
            "out-of-place op"
        )


def _check_device_versions(chunk: _Chunk) -> None:
    """A reloaded chunk's buffers are only read by backward; a change means a recomputation modified an
    unpacked saved tensor in place, which the chunk's next backward pass (W after I) must not read."""
    for dtype, buf in chunk.device.items():
        if buf._version != chunk.device_versions[dtype]:
            raise RuntimeError(
                f"a saved tensor of chunk {chunk.key!r} was modified in place after its reload (by a "
                "recomputation in backward); its next backward pass would read the modified values. "
                "Make the recomputed code use the out-of-place op"
            )


def _resident(chunk: _Chunk) -> int:
    if chunk.state is _CAPTURED or chunk.state is _CAPTURING:
        return chunk.captured_bytes
    return sum(b.nbytes for b in chunk.device.values())


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _contiguous_strides(size: torch.Size) -> tuple[int, ...]:
    strides = []
    acc = 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


# --- tensors handed over outside autograd ---------------------------------------------------------------

_THREAD = threading.local()


def _active_captures() -> list[tuple[ActivationStore, _Chunk]]:
    """The captures running on this thread, innermost last (a forward runs on one thread; captures of
    different stores or threads never see each other's tensors)."""
    captures = getattr(_THREAD, "captures", None)
    if captures is None:
        captures = _THREAD.captures = []
    return captures


class SavedInCapture:
    """A tensor recorded in a chunk by `save_in_capture`; `get` gives it back as autograd's unpack would:
    the original before offload (version-checked), the reloaded copy after reload, an error in between.
    """

    __slots__ = ("_packed", "_store", "_version")

    def __init__(self, store: ActivationStore, packed: Any, version: int) -> None:
        self._store = store
        self._packed = packed
        self._version = version

    def get(self) -> torch.Tensor:
        packed = self._packed
        if isinstance(packed, torch.Tensor):  # left in place (small, a parameter, kept): check it here
            if packed._version != self._version:
                raise RuntimeError(
                    "a tensor cached for recomputation was modified in place after its forward "
                    f"(version {self._version}, now {packed._version}); use the out-of-place op"
                )
            return packed
        return self._store._unpack(packed)


def save_in_capture(t: torch.Tensor) -> SavedInCapture | None:
    """Record ``t`` in the chunk whose capture is running on this thread, exactly as if autograd had saved
    it (kept or recorded by the same rules, copied with the chunk's other tensors); None when no capture
    runs. Why: code that keeps tensors for backward outside autograd's saved tensors (selective recompute's
    cache of op outputs) must not keep device memory an offload was meant to free."""
    captures = _active_captures()
    if not captures:
        return None
    store, chunk = captures[-1]
    chunk.cached += 1
    return SavedInCapture(store, store._pack(chunk, t), t._version)
