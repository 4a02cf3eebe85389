"""Compress: the tensors autograd saves for backward from named forward ops, kept packed.

NOTE [compression through saved-tensor hooks]
    A plan's ``compressed`` entries name a forward op outside every checkpointed region by its
    innermost module and a key ``"<overload>#<k>"`` local to that module's call (the k-th call
    of that overload while the module runs, its children's ops included, from 0 at each
    call), and a codec (``memfit.runtime.codecs``). While the model's forward runs:

    1. A ``saved_tensors_hooks`` pair is entered around the model's whole forward; around
       each named module's forward a dispatch mode counts the calls of the named overloads
       and tags the named outputs with their codec (by storage, held weakly: a later storage
       at the same address is not tagged). The mode runs only inside the named modules: a
       Python dispatch mode costs tens of microseconds per op on a CPU, so a mode over the
       whole forward would cost more than the codecs (measured: +8 ms on a 14 ms GPT step).
    2. The pack hook encodes a saved tensor whose storage is tagged, and keeps every other
       saved tensor as it is; unpack decodes. A tagged tensor saved by several nodes is
       encoded once and shared. The original storage is then held only by whoever else holds
       it: saved only packed, it is freed at its last use in the forward.
    3. ``sign_bit`` (NOTE [sign-only readers]) tags the output only for the one pack that
       directly follows the op: the op's own node saving its result.
    4. Inside a checkpointed region the checkpoint's own saved-tensor hooks take the saves
       (innermost hooks win), so a region's ops are never compressed here: the planner names
       only ops outside regions.
    5. ``shape_only`` (NOTE [geometry-only readers]) names a max pool: a function mode over
       the module marks that call's input while the call runs; its node's save of it is packed.
    The codecs' own ops run with Python dispatch off, so they are neither counted nor traced.

NOTE [sign-only readers]
    ``relu``'s node saves its result and its backward (``threshold_backward(grad, result,
    0)``) reads it only as ``result <= 0``: the 1-bit ``sign_bit`` form gives the same
    gradient bit for bit. Any other node that saves the same tensor (the next convolution's
    input, max-pool's input) reads its values, so only the relu node's own save may be given
    the bits: autograd saves a node's outputs right after the op returns, before any other op
    runs, so that save is the first pack after the op's dispatch, of a tensor whose
    ``grad_fn`` is the op's node. A later save of the same tensor keeps it whole (correct;
    then the bits save nothing, and the planner does not choose them: it compresses only a
    result no other node saves).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from memfit._torch import TorchDispatchMode, no_python_dispatch
from memfit.ops import op_name
from memfit.planning.compression import (
    ABN_ACTIVATIONS,
    ABN_NORMS,
    BN_FROM_OUTPUT,
    OUTPUT_BN_ACTIVATIONS,
    SHAPE_READERS,
    SIGN_READERS,
)
from memfit.runtime.bn_rebuild import (
    Rebuilt,
    ReluOf,
    activation_in_place,
    check_not_replaced,
    norm_taken,
    relu_out_of_place,
)
from memfit.runtime.codecs import Codec, Exactness, Packed, codec, prepare_bits

__all__ = ["Compressor", "SIGN_READERS"]

# (module path, "<overload>#<k>", codec name, output index[, call of the module or None: every call])
Entry = tuple[Any, ...]
# per overload (or max pool functional), per k: per call of the module (None: any) the codec and output
Planned = dict[str, dict[int, dict[int | None, tuple["Codec", int]]]]


class _Begin:
    """The model's forward pre-hook: the saved-tensor hooks on (returns None: the inputs stay)."""

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor

    def __call__(self, m: nn.Module, a: Any) -> None:
        self.compressor.__enter__()


class _End:
    """The model's forward hook: the saved-tensor hooks off."""

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor

    def __call__(self, m: nn.Module, a: Any, o: Any) -> None:
        self.compressor.__exit__(None, None, None)


class _TaggingHooks:
    """A compressed module's hooks: the tagging mode over its forward (one per call, nested
    calls stacked)."""

    def __init__(self, compressor: Compressor, ops: Planned, shape: bool = False) -> None:
        self.compressor = compressor
        self.ops = ops
        self.shape = shape  # a function mode's: calls keyed by the functional's name
        self.modes: list[Any] = []
        self.calls = 0  # calls of the module in this forward (Compressor.__enter__ resets)

    def enter(self, m: nn.Module, a: Any) -> None:
        call, self.calls = self.calls, self.calls + 1
        mode: Any = (_CallTagging(self.compressor, self.ops, call) if self.shape
                     else _Tagging(self.compressor, self.ops, call))
        self.modes.append(mode)
        mode.__enter__()

    def leave(self, m: nn.Module, a: Any, o: Any) -> None:
        if self.modes:
            self.modes.pop().__exit__(None, None, None)


class Compressor:
    """Saved-tensor compression for one model (NOTE [compression through saved-tensor hooks]);
    ``install`` puts it on the model, as ``apply`` does.

    Args:
        entries: ``(module path, op key, codec name, output index)`` per compressed output;
            the key counts the overload's calls within that module's call (max-pool's
            indices are output 1).

    Attributes:
        raw_bytes: bytes of the saved tensors encoded so far (their storages).
        packed_bytes: bytes of their packed forms.
        kept_whole: tagged saves kept whole (the codec's assumption did not hold, a view).

    Example:
        >>> comp = Compressor([("1", "aten.relu.default#0", "sign_bit", 0)])   # doctest: +SKIP
        >>> handles = comp.install(model); model(x).sum().backward()          # doctest: +SKIP
    """

    def __init__(self, entries: Iterable[Entry]) -> None:
        self.by_module: dict[str, Planned] = {}
        self.calls_by_module: dict[str, Planned] = {}
        for module, key, name, output, *rest in entries:
            call = rest[0] if rest else None
            overload, sep, k = key.rpartition("#")
            if not sep or not k.isdigit():
                raise ValueError(f"compress key {key!r} is not of the form '<overload>#<k>'")
            c = codec(name)
            if c.exactness is Exactness.SIGN and overload not in SIGN_READERS:
                raise ValueError(f"{key}: the codec {name!r} keeps only the sign, which only the "
                                 f"nodes of {sorted(SIGN_READERS)} read alone")
            if c.exactness is Exactness.REBUILT:  # NOTE [in-place activated batch norm]
                acts = OUTPUT_BN_ACTIVATIONS if name == BN_FROM_OUTPUT.name else ABN_ACTIVATIONS
                calls_of = {**ABN_NORMS, **acts}
                if overload not in calls_of:
                    raise ValueError(f"{key}: the codec {name!r} rebuilds the input of "
                                     f"{sorted(ABN_NORMS)} from the output of {sorted(acts)}")
                calls = self.calls_by_module.setdefault(module, {})
                calls.setdefault(calls_of[overload], {}).setdefault(int(k), {})[call] = (c, int(output))
                continue
            if c.exactness is Exactness.SHAPE:
                if overload not in SHAPE_READERS:
                    raise ValueError(f"{key}: the codec {name!r} keeps only the geometry, which only "
                                     f"the nodes of {sorted(SHAPE_READERS)} read alone (their input)")
                calls = self.calls_by_module.setdefault(module, {})
                calls.setdefault(SHAPE_READERS[overload], {}).setdefault(int(k), {})[call] = (c, int(output))
                continue
            planned = self.by_module.setdefault(module, {}).setdefault(overload, {})
            planned.setdefault(int(k), {})[call] = (c, int(output))
        self.raw_bytes = 0
        self.packed_bytes = 0
        self.kept_whole = 0
        self.geometry_saves = 0  # saves packed as shape_only (no bytes: not in raw/packed_bytes)
        self.shape: tuple[weakref.ref, Any] | None = None  # NOTE [geometry-only readers]
        self.abn_pending: Rebuilt | None = None  # a norm's, until its activation runs
        # NOTE [output-activated batch norm]: the norm whose relu runs now; the relu results
        # by storage address (the storage, weakly; the norm's Rebuilt)
        self.relu_pending: Rebuilt | None = None
        self.relu_results: dict[int, tuple[weakref.ref, Rebuilt]] = {}
        self.replaced: dict[int, weakref.ref] = {}  # norm outputs whose in-place relu ran out of place
        # storage address -> (the storage, weakly; codec; the shared Packed, weakly, or None)
        self.tagged: dict[int, tuple[weakref.ref, Codec, Any]] = {}
        self.sign: tuple[weakref.ref, Codec, str] | None = None  # NOTE [sign-only readers]
        self._hooks: Any = None
        self._depth = 0
        self._tagging: list[_TaggingHooks] = []

    def install(self, model: nn.Module) -> list[Any]:
        """Hooks on ``model`` (saved-tensor hooks over its forward) and on each named module
        (the tagging mode over its forward); returns their handles (``remove()`` each).

        Raises:
            ValueError: a module path ``model`` does not have.
        """
        # hooks are objects, not closures: a fitted model pickles (NOTE [a fitted model
        # pickles] in memfit.job.shape_plans)
        handles = [model.register_forward_pre_hook(_Begin(self)),
                   model.register_forward_hook(_End(self), always_call=True)]
        prepare_bits({t.device for t in (*model.parameters(), *model.buffers())} | {torch.device("cpu")})
        modules = [(path, ops, False) for path, ops in self.by_module.items()]
        modules += [(path, calls, True) for path, calls in self.calls_by_module.items()]
        for path, ops, shape in modules:
            try:
                module = model.get_submodule(path)
            except AttributeError:
                raise ValueError(f"the plan compresses an op of module {path!r}, which "
                                 f"{type(model).__name__} does not have") from None
            tagging = _TaggingHooks(self, ops, shape)
            self._tagging.append(tagging)
            # prepended/appended around the root's hooks: the tagging mode sits inside them
            handles.append(module.register_forward_pre_hook(tagging.enter))
            handles.append(module.register_forward_hook(tagging.leave, always_call=True))
        return handles

    def __enter__(self) -> Compressor:
        self._depth += 1
        if self._depth == 1:
            for tagging in self._tagging:  # a new forward: its modules' calls count from 0
                tagging.calls = 0
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            hooks, self._hooks = self._hooks, None
            self.tagged.clear()  # the forward is over: nothing more is saved
            self.sign = None
            self.shape = None
            self.abn_pending = None
            self.relu_pending = None
            self.relu_results.clear()
            self.replaced.clear()
            if hooks is not None:
                hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> Any:
        if self.shape is not None and self.shape[0]() is t.untyped_storage():
            if isinstance(self.shape[1], Rebuilt):  # the norm's save of its input
                self.raw_bytes += t.untyped_storage().nbytes()
                return self.shape[1]
            packed = self.shape[1].encode(t)  # no ops: nothing to dispatch
            if packed.raw:
                self.kept_whole += 1
                return t
            self.geometry_saves += 1
            return packed
        if self.relu_pending is not None or self.relu_results:
            if self.replaced:
                check_not_replaced(self, t)
            found = self._relu_result(t)
            if found is not None:
                return ReluOf(*found)
        tag = self._take(t)
        if tag is None:
            return t
        c, shared = tag
        if shared is not None and (packed := shared()) is not None:
            return packed
        with no_python_dispatch():
            packed = c.encode(t)
        if packed.raw:
            self.kept_whole += 1
            return t
        self.raw_bytes += t.untyped_storage().nbytes()
        self.packed_bytes += packed.nbytes
        self._share(t, packed)
        return packed

    def _relu_result(self, t: torch.Tensor) -> tuple[Rebuilt, bool] | None:
        """The norm whose kept output rebuilds ``t``, a relu result, and whether this save is
        the relu's own (NOTE [output-activated batch norm]); or None."""
        storage = t.untyped_storage()
        pending = self.relu_pending
        if pending is not None and type(t.grad_fn).__name__.startswith("ReluBackward"):
            self.relu_results[storage.data_ptr()] = (weakref.ref(storage), pending)
            return pending, True
        held = self.relu_results.get(storage.data_ptr())
        if held is None or held[0]() is not storage or t.shape != held[1].out.shape:  # type: ignore[union-attr]
            return None
        return held[1], False

    def _take(self, t: torch.Tensor) -> tuple[Codec, Any] | None:
        """The codec for this save of ``t`` (and a Packed to share), or None: keep it whole."""
        if not self.tagged and self.sign is None:
            return None
        storage = t.untyped_storage()
        sign, self.sign = self.sign, None
        if sign is not None and sign[0]() is storage:
            node = type(t.grad_fn).__name__ if t.grad_fn is not None else ""
            return (sign[1], None) if node.startswith(sign[2]) else None
        held = self.tagged.get(storage.data_ptr())
        if held is None or held[0]() is not storage:
            return None
        return held[1], held[2]

    def _share(self, t: torch.Tensor, packed: Packed) -> None:
        storage = t.untyped_storage()
        held = self.tagged.get(storage.data_ptr())
        if held is not None and held[0]() is storage:
            self.tagged[storage.data_ptr()] = (held[0], held[1], weakref.ref(packed))


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, (Rebuilt, ReluOf)):
        with no_python_dispatch():
            return packed.rebuild()
    if isinstance(packed, Packed):
        with no_python_dispatch():
            return codec(packed.codec).decode(packed)
    return packed


class _Tagging(TorchDispatchMode):
    """Over one call of a named module: counts the named overloads' calls (from 0) and tags
    the outputs of the named ones in its Compressor."""

    def __init__(self, owner: Compressor, ops: Planned, call: int) -> None:
        super().__init__()
        self.owner = owner
        self.ops = ops
        self.call = call
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        owner = self.owner
        owner.sign = None  # any op in between: the next pack is not the relu node's own
        out = func(*args, **(kwargs or {}))
        name = op_name(func)
        planned = self.ops.get(name)
        if planned is None:
            return out
        k = self.counts.get(name, 0)
        self.counts[name] = k + 1
        found = _for_call(planned.get(k), self.call)
        if found is None:
            return out
        c, index = found
        outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        t = outs[index] if index < len(outs) else None
        if not isinstance(t, torch.Tensor) or not c.accepts(t.dtype):
            return out  # not what was planned: kept whole
        storage = t.untyped_storage()
        if c.exactness is Exactness.SIGN:
            owner.sign = (weakref.ref(storage), c, SIGN_READERS[name])
        else:
            owner.tagged[storage.data_ptr()] = (weakref.ref(storage), c, None)
        return out


# torch.nn.functional's max pools (and torch's own), by name: the SHAPE_READERS call each runs;
# and the batch norms and activations of NOTE [in-place activated batch norm]
_FUNCTIONAL_CALLS = {name: call for call in SHAPE_READERS.values()
                for name in (call, f"{call}_with_indices")}
_FUNCTIONAL_CALLS.update({call: call for call in (*ABN_NORMS.values(), *ABN_ACTIVATIONS.values())})
_FUNCTIONAL_CALLS.update({name: call for call in OUTPUT_BN_ACTIVATIONS.values() for name in (call, f"{call}_")})


class _CallTagging(TorchFunctionMode):
    """Over one call of a named module: counts its ``torch.nn.functional`` calls of the planned
    kinds (from 0); for the planned max pool, marks its input while it runs (NOTE
    [geometry-only readers]); for the planned batch norm and leaky relu, takes the norm's input
    save (NOTE [in-place activated batch norm])."""

    def __init__(self, owner: Compressor, calls: Planned, call: int) -> None:
        super().__init__()
        self.owner = owner
        self.calls = calls
        self.call = call
        self.counts: dict[str, int] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        call = _FUNCTIONAL_CALLS.get(getattr(func, "__name__", ""))
        planned = None if call is None else self.calls.get(call)
        if call is None or planned is None:
            return func(*args, **kwargs)
        k = self.counts.get(call, 0)
        self.counts[call] = k + 1
        found = _for_call(planned.get(k), self.call)
        x = args[0] if args else kwargs.get("input")
        if found is None or not isinstance(x, torch.Tensor):
            return func(*args, **kwargs)
        if found[0].exactness is Exactness.REBUILT:
            from_output = found[0].name == BN_FROM_OUTPUT.name
            if call == "batch_norm":
                return norm_taken(self.owner, func, args, kwargs, from_output)
            if from_output:
                return relu_out_of_place(self.owner, func, args, kwargs)
            return activation_in_place(self.owner, func, args, kwargs)
        self.owner.shape = (weakref.ref(x.untyped_storage()), found[0])
        try:
            return func(*args, **kwargs)
        finally:
            self.owner.shape = None


def _for_call(by_call: dict[int | None, tuple[Codec, int]] | None, call: int) -> tuple[Codec, int] | None:
    """The codec and output planned for this call of the module (or for every call), if any."""
    if not by_call:
        return None
    found = by_call.get(call)
    return found if found is not None else by_call.get(None)
