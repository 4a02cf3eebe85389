"""What one training step is, and running it with the model left as found.

A :class:`Step` is data: the model, what the forward is called with (example inputs, or a
callable of the user's such as a LightningModule's ``training_step``), how the loss is made,
and the autocast state around it. Profiling, measurement, verification and the trade-off sweep
all run the same object, so they all mean the same step. :class:`ModelState` snapshots what a
run changes (``.grad``, buffers, the RNG of every device used) and puts it back.

NOTE [autocast is part of the step]
    A step made inside ``torch.autocast(...)`` records that state and runs under it wherever
    it is run later (a profile made in autocast and a verify called outside it run the same
    kernels). A step made outside autocast runs under whatever autocast surrounds the run.

NOTE [a fresh autocast cache per run]
    1. Autocast caches the low-precision copies of parameters it makes (``_to_copy`` of each
       weight) until the outermost ``torch.autocast`` block exits.
    2. A training loop enters autocast once per step, so every real step casts its weights
       anew, and the copies (saved for backward) are activation memory of the step.
    3. A step run inside an enclosing autocast block (``fit`` called within ``with
       torch.autocast(...)``) would otherwise find the cache filled by the run before it: the
       first run casts (its ops and bytes), later runs do not, so a profile's timing runs and
       traced run see different ops, and measurement misses the copies.
    4. So ``Step.run`` clears the cache before the forward and after the backward whenever
       autocast is on: every run casts, like a real step, and leaves no copies behind.
    5. It also clears it when the forward and loss end, where a training loop's autocast block
       ends (PyTorch's AMP recipe runs backward outside autocast). Run inside an enclosing
       block, the cache would hold every cast weight through backward, long after autograd
       let go of it: the profile counted them live to the step's end, and a plan's regions,
       which run without the cache (NOTE [autocast cache] in ``memfit.runtime.checkpoint``),
       were predicted up to 20.8% over their measured peak (a 4-layer GPT, every block
       checkpointed). A loop that keeps backward inside autocast holds those copies longer
       than memfit counts.

Example:
    >>> model = torch.nn.Linear(4, 1)
    >>> step = Step.of(model, torch.ones(2, 4))
    >>> with ModelState(model, step.inputs) as state:
    ...     step.run()
    ...     state.reset()                 # grads None, buffers and RNG as before the first run
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from memfit.step.inputs import (
    LossFn,
    call_user,
    check_differentiable,
    default_loss,
    iter_tensors,
    model_name,
    normalize_inputs,
)

__all__ = ["Autocast", "Step", "ModelState", "model_device"]

_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Autocast:
    """An autocast state: the device type it applies to and the dtype it casts to."""

    device_type: str
    dtype: torch.dtype

    @classmethod
    def ambient(cls) -> tuple[Autocast, ...]:
        """The autocast states enabled where this is called (at most one per device type)."""
        out = []
        for dev in _AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(dev):
                out.append(cls(dev, torch.get_autocast_dtype(dev)))
        return tuple(out)

    def context(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.dtype)


@dataclass(frozen=True)
class Step:
    """One training step: forward, loss, backward.

    Attributes:
        model: the module whose step this is (its parameters get the gradients).
        args, kwargs: what the forward is called with (``model(*args, **kwargs)``).
        loss_fn: output -> scalar loss; ``None``: ``memfit.step.inputs.default_loss``.
        call: a callable returning the loss, used instead of ``model(...)`` + ``loss_fn``
            (e.g. ``lambda: module.training_step(batch, 0)``).
        autocast: the autocast states the step runs under (NOTE [autocast is part of the step]).
    """

    model: nn.Module
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    loss_fn: LossFn | None = None
    call: Callable[[], Any] | None = None
    autocast: tuple[Autocast, ...] = ()

    @classmethod
    def of(cls, model: nn.Module, example_inputs: Any = None, *, loss_fn: LossFn | None = None,
           call: Callable[[], Any] | None = None) -> Step:
        """The step of ``model`` on ``example_inputs`` (or of ``call``), under the autocast
        state of the caller.

        Raises:
            TypeError: ``model`` is not a module, or both or neither of ``example_inputs`` and
                ``call`` are given.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"a step needs an nn.Module, got {type(model).__name__}")
        _require_materialized(model)
        if call is not None:
            if example_inputs is not None or loss_fn is not None:
                raise TypeError("give either example_inputs (and loss_fn) or call, not both")
            if not callable(call):
                raise TypeError(f"call must be a function returning the loss, got {type(call).__name__}")
            return cls(model, call=call, autocast=Autocast.ambient())
        if example_inputs is None:
            raise TypeError("a step needs example_inputs (a tensor, a tuple or a dict) or call=")
        args, kwargs = normalize_inputs(example_inputs)
        return cls(model, args, kwargs, loss_fn, autocast=Autocast.ambient())

    def with_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Step:
        """The same step on other inputs (fresh copies, fake tensors)."""
        return Step(self.model, args, kwargs, self.loss_fn, self.call, self.autocast)

    def with_input_copies(self) -> Step:
        """The same step on fresh leaf copies of its input tensors (same ``requires_grad``), so
        that running it never sets ``.grad`` on the caller's tensors. A step given as a
        callable is returned as it is (its inputs are the callable's business)."""
        if self.call is not None:
            return self
        return self.with_inputs(_leaf_copies(self.args), _leaf_copies(self.kwargs))

    def for_model(self, model: nn.Module) -> Step:
        """The same step run by another module: a copy of the model (a twin), same inputs.

        Raises:
            TypeError: the step was given as a callable, which runs the model it closes over.
        """
        if self.call is not None:
            raise TypeError("a step given as a callable runs the model it closes over and cannot run "
                            "on a copy of it; give the model's example_inputs (and loss_fn) instead")
        return Step(model, self.args, self.kwargs, self.loss_fn, None, self.autocast)

    def autocast_devices(self) -> frozenset[str]:
        """Device types the step runs autocast on: its own state and any around the call."""
        return frozenset(a.device_type for a in (*self.autocast, *Autocast.ambient()))

    @property
    def inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return self.args, self.kwargs

    @property
    def name(self) -> str:
        return model_name(self.model)

    def output_and_loss(self, forward: Callable[..., Any] | None = None) -> tuple[Any, torch.Tensor]:
        """Run the forward and the loss; ``forward`` stands for ``model`` (fake mode's
        functional call). What the user's code raises becomes a ``ModelError``."""
        with contextlib.ExitStack() as stack:
            for a in self.autocast:
                stack.enter_context(a.context())
            if self.call is not None:
                out = call_user(self.call, (), {}, model=self.name, what="step")
                loss = out
            else:
                out = call_user(forward or self.model, self.args, self.kwargs, model=self.name,
                                what="forward")
                loss = (default_loss(out) if self.loss_fn is None else
                        call_user(self.loss_fn, (out,), {}, model=self.name, what="loss_fn"))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
            fix = "return the loss from the step function" if self.call else "return e.g. out.sum() from loss_fn"
            raise TypeError(f"the loss must be a scalar tensor, got {type(loss).__name__}{shape}; {fix}")
        check_differentiable(loss, self.model, self.name, self.inputs,
                              self.loss_fn is not None or self.call is not None)
        return out, loss

    def run(self, *, forward: Callable[..., Any] | None = None,
            on_backward: Callable[[], None] | None = None,
            keep: Callable[[Any, torch.Tensor], None] | None = None) -> None:
        """Forward, loss, backward. The output and loss stay referenced through backward, as in
        a usual training loop, and are released when this returns; ``keep(output, loss)`` is
        called after backward."""
        fresh_cache = bool(self.autocast_devices())
        if fresh_cache:  # NOTE [a fresh autocast cache per run]
            torch.clear_autocast_cache()
        out, loss = self.output_and_loss(forward)
        if fresh_cache:  # the loop's autocast block ends with the loss
            torch.clear_autocast_cache()
        if on_backward is not None:
            on_backward()
        call_user(loss.backward, (), {}, model=self.name, what="backward")
        if keep is not None:
            keep(out, loss)
        del out, loss
        if fresh_cache:
            torch.clear_autocast_cache()


class ModelState:
    """What running a step changes, snapshotted: ``.grad`` of the parameters and of the input
    leaves that require grad, buffers (BatchNorm statistics), and the RNG state of the CPU and
    of the model's accelerator.

    ``reset()`` gives a run the snapshot's start with every ``.grad`` None (gradients created
    afresh, as after ``zero_grad(set_to_none=True)``); ``restore()`` (also on leaving the
    ``with`` block) puts everything back, the old ``.grad`` included. ``run(step)`` runs a
    step from that start (NOTE [repeatable runs]).

    Args:
        model: the module.
        inputs: example inputs whose leaves' ``.grad`` are kept too.
        buffers: snapshot buffers (False for a model on the meta device, or one no run touches).
        seed: if given, ``reset()`` starts the RNG from ``torch.manual_seed(seed)`` instead of
            the snapshot (``restore()`` still puts the snapshot back).
    """

    def __init__(self, model: nn.Module, inputs: Any = (), *, buffers: bool = True,
                 seed: int | None = None) -> None:
        leaves = [t for t in iter_tensors(inputs) if t.requires_grad and t.is_leaf]
        self.params = list(model.parameters()) + leaves
        self.grads = [p.grad for p in self.params]
        self.seed = seed
        self.cpu_rng = torch.get_rng_state()
        # NOTE [RNG of every device]: every CUDA device's generator, whenever the step can
        # touch one (a CUDA parameter, buffer or input, or CUDA already initialised: a model
        # split over devices, a step that moves tensors itself), not only the first
        # parameter's device.
        uses_cuda = torch.cuda.is_initialized() or any(
            t.is_cuda for t in (*model.parameters(), *model.buffers(), *iter_tensors(inputs)))
        self.cuda_rng = torch.cuda.get_rng_state_all() if uses_cuda else None
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()
                        if buffers and b.device.type != "meta"]

    def reset(self) -> None:
        self._reset(seeded=True)

    def _reset(self, *, seeded: bool) -> None:
        self.clear_grads()
        if seeded and self.seed is not None:
            torch.manual_seed(self.seed)
        else:
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state_all(self.cuda_rng)
        with torch.no_grad():
            for b, snap in self.buffers:
                if b.shape != snap.shape:  # a forward that resizes it (QAT observers' min/max)
                    b.resize_(snap.shape)
                b.copy_(snap)

    def run(self, step: Step, *, keep: Callable[[Any, torch.Tensor], None] | None = None) -> None:
        """Run ``step`` from the snapshot's start and drop its gradients at the end.

        NOTE [repeatable runs]
            ``measure`` may run a step more than once, so every run starts from the same
            state: buffers copied back in place, the RNG reset (or re-seeded), no gradients.
            Gradients are dropped at the END of each run (after ``keep(output, loss)`` has
            read them), never at the start: a run must not free memory allocated before it,
            which the CPU allocator meter would subtract from its peak. Call
            ``clear_grads()`` once before the first run, outside any meter, and copy the
            inputs (``Step.with_input_copies``) before that too.
        """
        self.reset()
        step.run(keep=keep)
        self.clear_grads()

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def restore(self) -> None:
        self._reset(seeded=False)
        for p, g in zip(self.params, self.grads, strict=True):
            p.grad = g

    def __enter__(self) -> ModelState:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def _require_materialized(model: nn.Module) -> None:
    """Refuse a model whose lazy modules have not run yet: their parameters have no shape, so
    no step of it can be profiled or planned."""
    lazy = [n for n, p in model.named_parameters() if is_lazy(p)]
    lazy += [n for n, b in model.named_buffers() if is_lazy(b)]
    if lazy:
        shown = ", ".join(lazy[:3]) + (f" and {len(lazy) - 3} more" if len(lazy) > 3 else "")
        raise ValueError(
            f"the model has uninitialized lazy parameters ({shown}: nn.LazyLinear, "
            "nn.LazyConv2d... before their first forward): run one forward first, "
            "model(example_inputs), so that they take their shapes, then profile or fit it"
        )


def _leaf_copies(value: Any) -> Any:
    """``value`` with every tensor replaced by a detached copy (same ``requires_grad``)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, (tuple, list)):
        return type(value)(_leaf_copies(v) for v in value)
    if isinstance(value, dict):
        return {k: _leaf_copies(v) for k, v in value.items()}
    return value


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); CPU for a model with neither."""
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")

