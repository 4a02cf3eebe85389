"""Offload: the outputs of OFFLOAD ops kept for a region's replay in host memory.

NOTE [offload through the selective-checkpoint cache]
    torch's selective checkpoint keeps a MUST_SAVE op's outputs in a dict that its two
    dispatch modes share (``create_selective_checkpoint_contexts``): the caching mode stores
    ``storage[op][k] = tree of _VersionWrapper(detached output)`` during the forward, the
    cached mode hands entry ``k`` back instead of rerunning the op during the replay.
    Offload is the same thing with the kept tensors in host memory, so memfit gives both
    modes its own dict (:class:`OffloadStorage`, through ``memfit._torch.sac_set_storage``):

    1. The region's policy answers MUST_SAVE for an OFFLOAD op and notes ``(op, k)``
       (``RegionPolicy.offloads``); NOTE [forced recompute] applies to it as to SAVE.
    2. When the caching mode stores that entry, each tensor leaf is copied into a host buffer
       from the pool (D2H on a side stream, an event recorded after it) and the entry keeps
       only the host copy (:class:`HostCopy`). The device storage is then held only by
       whoever else holds it: it is freed at its last use in the forward, or lives on as the
       plain step keeps it if it escapes the region (its host copy is then extra but exact).
    3. Entering the recompute context (the backward reached the region's recompute point)
       starts the H2D of every host copy of the region (prefetch); the cached mode's
       ``get_val`` waits for its copy (or starts it, if none was prefetched) and returns a
       tensor with the original dtype, size, strides and storage offset, and the host buffer
       goes back to the pool once the H2D has finished (an event, on CUDA).
    4. A host copy never read returns its buffer to the pool: when the recompute context is
       left (the replay stopped early, once backward had every tensor it needed), or when the
       entry is dropped (the step had no backward; an in-place write turned the entry back
       into recompute).
    5. Not offloaded, kept on the device as SAVE keeps them: outputs of view ops (they alias
       an input, whose storage someone else holds), non-strided or empty tensors, and any
       tensor for which the pool has no room under its cap (said once in the log).

    A cleaner route, ``torch.autograd.graph.saved_tensors_hooks`` around the region, does not
    reach these tensors: inside a checkpoint the saved-tensor hooks are the checkpoint's own,
    and the selective-checkpoint cache holds the outputs outside autograd.

NOTE [host pool]
    Pinned host memory costs milliseconds per allocation, so buffers are pooled: a buffer
    freed by an H2D (with the event that ends it) is handed out again for the next D2H of the
    same rounded size, after waiting for that event. ``cap_bytes`` bounds the bytes the pool
    holds (handed out + free): a request that does not fit, even after the free buffers are
    dropped, is refused and the tensor stays on the device. On a CPU device the same code
    runs synchronously with ordinary CPU buffers standing in for the host.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import Any

import torch

from memfit._torch import (
    require_sac_storage,
    sac_is_entry,
    sac_saved_tensor,
    sac_set_storage,
    tree_flatten,
    tree_map,
)

__all__ = ["HostPool", "HostCopy", "OffloadStorage", "selective_contexts", "pool_of"]

log = logging.getLogger(__name__)

_ALIGN = 512  # bytes: host buffers are rounded up to this, so sizes recur and buffers reuse


class HostPool:
    """Pooled host buffers for offloaded tensors, never holding more than ``cap_bytes``.

    Args:
        cap_bytes: most bytes of host buffers the pool holds at once (handed out + free);
            None (default): no cap.

    Attributes:
        allocated_bytes: bytes of host buffers the pool holds now.
        in_use_bytes: bytes of them holding an offloaded tensor now.
        peak_bytes: the most ``allocated_bytes`` has been.
        allocations: host buffers allocated so far (a warm pool allocates none).
        offloaded_bytes: bytes copied to the host so far.
        refused: tensors kept on the device because the cap left no room.

    Example:
        >>> pool = HostPool(cap_bytes=1 << 20)
        >>> buf = pool.acquire(1000, torch.device("cpu")); pool.in_use_bytes
        1024
    """

    def __init__(self, cap_bytes: int | None = None) -> None:
        if cap_bytes is not None and (not isinstance(cap_bytes, int) or cap_bytes < 0):
            raise ValueError(f"cap_bytes must be a non-negative int or None, got {cap_bytes!r}")
        self.cap_bytes = cap_bytes
        self.allocated_bytes = 0
        self.in_use_bytes = 0
        self.peak_bytes = 0
        self.allocations = 0
        self.offloaded_bytes = 0
        self.refused = 0
        self._free: defaultdict[int, list[tuple[torch.Tensor, Any]]] = defaultdict(list)
        self._streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, tuple[int | None]]:
        # Copies (deepcopy, pickle) start empty: buffers and streams belong to this process.
        return HostPool, (self.cap_bytes,)

    def __repr__(self) -> str:
        return (f"HostPool(cap_bytes={self.cap_bytes}, allocated_bytes={self.allocated_bytes}, "
                f"in_use_bytes={self.in_use_bytes})")

    def acquire(self, nbytes: int, device: torch.device) -> torch.Tensor | None:
        """A host buffer (uint8, at least ``nbytes``) to copy a tensor of ``device`` into, or
        None if the cap leaves no room (NOTE [host pool])."""
        size = -(-nbytes // _ALIGN) * _ALIGN
        with self._lock:
            free = self._free.get(size)
            if free:
                buf, event = free.pop()
                if event is not None:
                    event.synchronize()  # its last H2D must have read it
            else:
                if self.cap_bytes is not None and self.allocated_bytes + size > self.cap_bytes:
                    self._drop_free(self.allocated_bytes + size - self.cap_bytes)
                    if self.allocated_bytes + size > self.cap_bytes:
                        self.refused += 1
                        if self.refused == 1:
                            log.warning(
                                "offload: the host cap of %d bytes leaves no room for %d more "
                                "(%d held); such tensors stay on the device (said once)",
                                self.cap_bytes, size, self.allocated_bytes)
                        return None
                pin = device.type == "cuda"
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
                self.allocations += 1
                self.allocated_bytes += size
                self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
            self.in_use_bytes += size
            return buf

    def release(self, buf: torch.Tensor, event: Any = None) -> None:
        """Give a buffer back; it is handed out again once ``event`` (if any) completed."""
        with self._lock:
            self.in_use_bytes -= buf.numel()
            self._free[buf.numel()].append((buf, event))

    def _drop_free(self, needed: int) -> None:
        """Drop free buffers, largest first, until ``needed`` bytes are gone or none is left."""
        for size in sorted(self._free, reverse=True):
            free = self._free[size]
            while free and needed > 0:
                buf, event = free.pop()
                if event is not None:
                    event.synchronize()
                self.allocated_bytes -= size
                needed -= size
            if needed <= 0:
                return

    def stream(self, device: torch.device) -> Any:
        """The side stream of copies to and from ``device`` (None on a CPU device)."""
        if device.type != "cuda":
            return None
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as a flat uint8 tensor (shares it)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class HostCopy:
    """One offloaded tensor: its bytes in a pooled host buffer, and how to rebuild it.

    Stands in for torch's ``_VersionWrapper`` in the selective-checkpoint cache: the cached
    mode calls :meth:`get_val` (NOTE [offload through the selective-checkpoint cache]).
    """

    __slots__ = ("pool", "host", "nbytes", "dtype", "device", "offset", "size", "stride",
                 "_device_bytes", "_h2d", "__weakref__")

    def __init__(self, t: torch.Tensor, host: torch.Tensor, pool: HostPool) -> None:
        self.pool = pool
        self.host: torch.Tensor | None = host
        self.nbytes = t.untyped_storage().nbytes()
        self.dtype, self.device = t.dtype, t.device
        self.offset, self.size, self.stride = t.storage_offset(), t.size(), t.stride()
        self._device_bytes: torch.Tensor | None = None
        self._h2d: Any = None
        source = _bytes_of(t)
        stream = pool.stream(t.device)
        if stream is None:
            host[: self.nbytes].copy_(source)
        else:
            stream.wait_stream(torch.cuda.current_stream(t.device))  # the output is written
            with torch.cuda.stream(stream):
                host[: self.nbytes].copy_(source, non_blocking=True)
            # The allocator may reuse the device block only after the side stream read it.
            source.record_stream(stream)
        pool.offloaded_bytes += self.nbytes

    def prefetch(self) -> None:
        """Start the H2D copy (once); on a CPU device it runs now."""
        if self._device_bytes is not None or self.host is None:
            return
        stream = self.pool.stream(self.device)
        if stream is None:
            self._device_bytes = self.host[: self.nbytes].clone()
            return
        with torch.cuda.stream(stream):  # after this stream's D2H of the same buffer
            self._device_bytes = self.host[: self.nbytes].to(self.device, non_blocking=True)
            self._h2d = torch.cuda.Event()
            self._h2d.record(stream)

    def get_val(self, allow_cache_entry_mutation: bool = False) -> torch.Tensor:
        """The tensor back on its device (the cached mode's call; mutation cannot be checked
        on a copy, and the copy holds the forward's values, so the flag is moot)."""
        self.prefetch()
        data = self._device_bytes
        if data is None:
            raise RuntimeError("an offloaded tensor was read twice; backward through a "
                               "checkpointed region runs once")
        if self._h2d is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(self._h2d)
            data.record_stream(main)  # allocated on the side stream, used on this one
        self._device_bytes = None
        self._give_back()
        return torch.empty(0, dtype=self.dtype, device=self.device).set_(
            data.untyped_storage(), self.offset, self.size, self.stride)

    def drop(self) -> None:
        """Forget the copy (never to be read): its host buffer goes back to the pool."""
        self._device_bytes = None
        self._give_back()

    def _give_back(self) -> None:
        host, self.host = self.host, None
        if host is not None:
            self.pool.release(host, self._h2d)

    def __del__(self) -> None:
        self._give_back()


class _Slots(dict):
    """The entries of one op in :class:`OffloadStorage`: offloads an entry as it is stored."""

    def __init__(self, owner: OffloadStorage, key: Any) -> None:
        super().__init__()
        self.owner, self.key = owner, key

    def __setitem__(self, index: int, value: Any) -> None:
        owner = self.owner
        if (self.key, index) in owner.offloads:
            value = tree_map(owner.offload_leaf, value)
        super().__setitem__(index, value)


class OffloadStorage(dict):
    """The selective-checkpoint cache of one region call, with OFFLOAD entries on the host.

    Args:
        offloads: the ``(op, k)`` occurrences to offload; the region's policy adds to it
            during the forward, before the caching mode stores each entry.
        pool: where the host copies go.
    """

    def __init__(self, offloads: set[tuple[Any, int]], pool: HostPool) -> None:
        super().__init__()
        self.offloads = offloads
        self.pool = pool

    def __missing__(self, key: Any) -> _Slots:
        slots = self[key] = _Slots(self, key)
        return slots

    def offload_leaf(self, leaf: Any) -> Any:
        if not sac_is_entry(leaf):
            return leaf
        saved = sac_saved_tensor(leaf)
        if saved is None:
            return leaf
        t, _ = saved
        if (t.layout is not torch.strided or t.device.type not in ("cpu", "cuda")
                or t.untyped_storage().nbytes() == 0):
            return leaf
        host = self.pool.acquire(t.untyped_storage().nbytes(), t.device)
        return leaf if host is None else HostCopy(t, host, self.pool)

    def host_copies(self) -> list[HostCopy]:
        """The entries still on the host, in no particular order."""
        out: list[HostCopy] = []
        for slots in self.values():
            for entry in slots.values():
                leaves, _ = tree_flatten(entry)
                out.extend(x for x in leaves if isinstance(x, HostCopy))
        return out

    def prefetch(self) -> None:
        """Start the H2D of every host copy of the region (its recompute is starting)."""
        for copy in self.host_copies():
            copy.prefetch()

    def release_unread(self) -> None:
        """Give back the buffers of host copies the replay did not read (it stopped early
        once backward had every tensor it needed); the recompute context is leaving."""
        for copy in self.host_copies():
            copy.drop()


def selective_contexts(region_policy: Any, pool: HostPool) -> tuple[Any, Any, OffloadStorage]:
    """torch's selective-checkpoint modes for ``region_policy``, sharing an
    :class:`OffloadStorage` (NOTE [offload through the selective-checkpoint cache]).

    Returns:
        (caching mode, cached mode, the storage); enter ``storage.prefetch`` with the
        recompute context.

    Raises:
        UnsupportedTorch: this torch's selective checkpoint is laid out otherwise.
    """
    require_sac_storage()
    caching, cached = torch.utils.checkpoint.create_selective_checkpoint_contexts(region_policy)
    storage = OffloadStorage(region_policy.offloads, pool)
    sac_set_storage(caching, cached, storage)
    return caching, cached, storage


def pool_of(policy: Any) -> HostPool | None:
    """The host pool of a ``memfit.runtime.policies`` policy with OFFLOAD decisions (None: it
    offloads nothing): ``by_key(..., host=)``'s, or the first found in ``a | b``."""
    host = getattr(policy, "host", None)
    if isinstance(host, HostPool):
        return host
    for part in (getattr(policy, "first", None), getattr(policy, "second", None)):
        if part is not None and (found := pool_of(part)) is not None:
            return found
    return None
