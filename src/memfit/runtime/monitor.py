"""The training monitor: every N training calls of a planned model, the step's measured peak
against its plan's prediction and budget (``fit(monitor_every=N)``).

NOTE [monitoring a training run]
    1. A monitored call starts a meter in the model's forward pre-hook (after the input guard
       switched or re-planned, so its plan is the one in effect) and marks the step's end at
       each trainable parameter's gradient accumulation (``register_post_accumulate_grad_hook``;
       the last mark counts): the forward, the loss and backward, as ``memfit.measure`` meters
       a step. Not ``register_multi_grad_hook``: it holds the gradients it passes to its hook,
       so autograd cannot move a gradient into ``.grad`` and copies it, which the meter would
       count. The hooks are removed at the model's next call.
    2. On CUDA the meter is ``reset_peak_memory_stats`` at the start and
       ``max_memory_allocated`` minus the start's ``memory_allocated``, read at each mark
       (the allocator's counters are host-side, kept at allocation: no synchronisation);
       ``step_s`` is the elapsed time between CUDA events recorded at the start and the last
       mark.
    3. On CPU it is the allocator's events (``torch.profiler``, ``profile_memory=True``, the
       meter ``memfit.measure`` uses: NOTE [two CPU meters]). A profiler cannot be stopped
       from inside backward: autograd restores the thread-local state it captured when
       backward began, profiler included, when backward ends (measured: the next start
       failed, "Profiler is already enabled on this thread"). So each mark is a span in the
       profile (``profiler_marker``), and the profiler is stopped at the model's next call
       (any call), when the records are read (``model.memfit_monitor``), or at interpreter
       exit (NOTE [deferred meter ends] in ``memfit.profiling.meters``); events after the
       last mark do not count. What runs before then (the optimizer step) is recorded by the
       profiler and dropped. ``step_s`` is wall time from the start to the last mark. A CPU
       profiler memfit starts meanwhile (``memfit.measure``, the profile of a re-plan, which
       runs from the input guard before this hook) ends it first (NOTE [deferred meter ends]
       in ``memfit.profiling.meters``).
    4. A monitored call starts nothing while another torch profiler records (starting one
       would end its session: ``memfit.measure``, the user's own profiling), nor on calls
       without autograd, under a suspended plan, or while ``torch.compile`` traces; a call
       whose backward never ran records nothing.
    5. The peak is bytes above the start of the call: activation memory plus gradients
       created in backward (``.grad`` None at the start: ``zero_grad(set_to_none=True)``,
       the default), which is what a plan predicts (``Plan.predicted_peak_bytes``), for the
       step ``memfit.measure`` runs: the output and loss referenced through backward.
    6. A record over the budget, or more than ``tolerance`` (default 10%: measured peaks of
       zoo models on CPU were within 0.01% of the prediction; CUDA kernels' workspaces are
       not modelled) away from the prediction, warns (``warnings.warn``) once per input
       signature and kind; the drift only on the plan's own input signature (a plan covering a
       range of shapes, NOTE [shape ranges] in ``memfit.job.shape_plans``, predicts its largest
       shape's peak, a bound for the others).
    Cost: a monitored step on CPU runs under the profiler (slower; ``step_s`` includes it)
    and its events are read when it stops; other calls cost one counter increment. Measured
    (``benchmarks/monitor_cost.py``, a 4x128 zoo GPT, one thread): +30 ms a monitored step,
    +24% at ``monitor_every=1``, +1.6% at 10; within 1% of a step from N = 25.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit._torch import profiler_active, profiler_marker
from memfit.profiling.meters import AllocatorMeter, defer_end
from memfit.runtime.marks import suspended
from memfit.runtime.shapes import describe
from memfit.step.inputs import call_signature, first_floating_parameter

__all__ = ["MonitorRecord", "MonitorRecords", "Monitor", "install_monitor", "remove_monitor",
           "log_values", "DRIFT_TOLERANCE"]

log = logging.getLogger(__name__)

DRIFT_TOLERANCE = 0.10  # NOTE [monitoring a training run], rule 6
_END = "memfit.monitor.step_end"
_ATTR = "memfit_monitor"
_HOOK_ATTR = "_memfit_monitor_hook"


@dataclass(frozen=True)
class MonitorRecord:
    """One monitored training call.

    Attributes:
        step: the call's index among the model's training calls (0 is the first).
        shape: its inputs' signature, ``((name, shape, dtype), ...)``.
        peak_bytes: its measured peak above the start, bytes.
        predicted_peak_bytes: the plan in effect's prediction, for its own input signature
            (a bound on the other shapes of its range); None: no plan applied.
        budget_bytes: that plan's budget (None: none).
        step_s: wall seconds from the forward's start to the last parameter gradient.
    """

    step: int
    shape: tuple[tuple[str, tuple[int, ...], str], ...]
    peak_bytes: int
    predicted_peak_bytes: int | None
    budget_bytes: int | None
    step_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "shape": [[n, list(s), d] for n, s, d in self.shape],
                "peak_bytes": self.peak_bytes, "predicted_peak_bytes": self.predicted_peak_bytes,
                "budget_bytes": self.budget_bytes, "step_s": self.step_s}


class MonitorRecords(list[MonitorRecord]):
    """``model.memfit_monitor``: the records, a list; reading it first ends a CPU meter still
    waiting for the next call (NOTE [monitoring a training run], rule 3)."""

    monitor: Monitor | None = None

    def _flush(self) -> None:
        if self.monitor is not None:
            self.monitor.flush()

    def __len__(self) -> int:
        self._flush()
        return super().__len__()

    def __iter__(self) -> Any:
        self._flush()
        return super().__iter__()

    def __getitem__(self, i: Any) -> Any:
        self._flush()
        return super().__getitem__(i)

    def __repr__(self) -> str:
        self._flush()
        return super().__repr__()


class Monitor:
    """The forward pre-hook of ``fit(monitor_every=N)`` (NOTE [monitoring a training run]).

    Args:
        model: the planned model.
        every: monitor one training call in ``every`` (the first, then every ``every``-th).
        tolerance: the drift from the prediction that warns, a fraction (default 0.10).
        planned: the inputs the plan's prediction is for, as ``(args, kwargs)`` of a call
            (default: the plan's ``input_signature``); other calls are not checked for drift.
    """

    def __init__(self, model: nn.Module, every: int, *, tolerance: float = DRIFT_TOLERANCE,
                 planned: tuple[tuple[Any, ...], dict[str, Any]] | None = None) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"monitor_every must be an int >= 1 (monitor one training call in "
                             f"N), got {every!r}")
        self.model = model
        self.every = every
        self.tolerance = tolerance
        self.calls = 0
        self.records = MonitorRecords()
        self.records.monitor = self
        self.parameter = first_floating_parameter(model)
        self.warned: set[tuple[str, Any]] = set()
        self._open: dict[str, Any] | None = None
        self.planned = None if planned is None else self.signature(*planned)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (pickle, deepcopy) of a model mid-step starts with no meter open: the open
        one is ended and recorded first, as reading the records does (NOTE [a fitted model
        pickles] in ``memfit.job.shape_plans``)."""
        self.flush()
        return dict(self.__dict__)

    def signature(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                  ) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        """A call's signature, as plain data (``MonitorRecord.shape``)."""
        return tuple((n, tuple(int(d) for d in s), str(dt).removeprefix("torch."))
                     for n, s, dt in call_signature(args, kwargs, self.parameter))

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():
            return
        self.flush()
        if not torch.is_grad_enabled() or suspended():
            return
        step = self.calls
        self.calls += 1
        if step % self.every:
            return
        params = [p for p in module.parameters() if p.requires_grad]
        if not params or profiler_active():
            log.debug("memfit monitor: step %d not monitored (%s)", step,
                      "no trainable parameters" if not params else "another profiler records")
            return
        plan = module.__dict__.get("memfit_plan")
        sig = self.signature(args, kwargs)
        planned = self.planned or tuple(getattr(plan, "input_signature", ()) or sig)
        device = self.parameter.device if self.parameter is not None else torch.device("cpu")
        state: dict[str, Any] = {
            "step": step, "shape": sig, "device": device,
            "predicted": getattr(plan, "predicted_peak_bytes", None),
            "budget": getattr(plan, "budget_bytes", None),
            # a plan covering a range of shapes predicts its own shape's peak: an upper bound
            # for the others, not a value to drift from (rule 6)
            "exact": planned == sig}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            state["start_bytes"] = torch.cuda.memory_allocated(device)
            state["t0"] = torch.cuda.Event(enable_timing=True)
            state["t0"].record()
        else:
            meter = AllocatorMeter(until=_END)
            meter.__enter__()
            state["meter"] = meter
            defer_end(self.flush)  # NOTE [deferred meter ends] in memfit.profiling.meters
            state["t0"] = time.perf_counter()
        state["hooks"] = [p.register_post_accumulate_grad_hook(lambda _p: self._mark(state))
                          for p in params]
        self._open = state

    def _mark(self, state: dict[str, Any]) -> None:
        """A parameter's gradient is accumulated; the last mark ends the step (rule 1)."""
        state["marks"] = state.get("marks", 0) + 1
        if state["device"].type == "cuda":
            state["peak"] = torch.cuda.max_memory_allocated(state["device"]) - state["start_bytes"]
            state["t1"] = torch.cuda.Event(enable_timing=True)
            state["t1"].record()
        else:
            state["step_s"] = time.perf_counter() - state["t0"]
            with profiler_marker(_END):
                pass

    def flush(self) -> None:
        """End the meter of the last monitored call and record it (rules 1-3)."""
        state = self._open
        if state is None:
            return
        self._open = None
        for h in state["hooks"]:
            h.remove()
        meter = state.get("meter")
        if meter is not None:
            meter.__exit__(None, None, None)
        if not state.get("marks"):  # its backward never ran
            log.debug("memfit monitor: step %d had no backward", state["step"])
            return
        if meter is not None:
            state["peak"] = meter.peak_bytes
        else:
            state["t1"].synchronize()
            state["step_s"] = state["t0"].elapsed_time(state["t1"]) / 1e3
        self._record(state)

    def _record(self, state: dict[str, Any]) -> None:
        rec = MonitorRecord(step=state["step"], shape=state["shape"], peak_bytes=int(state["peak"]),
                            predicted_peak_bytes=state["predicted"], budget_bytes=state["budget"],
                            step_s=state["step_s"])
        list.append(self.records, rec)
        self._check(rec, exact=state.get("exact", True))

    def _check(self, rec: MonitorRecord, *, exact: bool = True) -> None:
        name = type(self.model).__name__
        shape = describe(tuple((n, torch.Size(s), d) for n, s, d in rec.shape))
        over = rec.budget_bytes is not None and rec.peak_bytes > rec.budget_bytes
        if over and ("budget", rec.shape) not in self.warned:
            self.warned.add(("budget", rec.shape))
            warnings.warn(
                f"memfit monitor: {name}'s step {rec.step} on inputs {shape} peaked at "
                f"{rec.peak_bytes} bytes, over its plan's budget of {rec.budget_bytes} "
                f"(predicted {rec.predicted_peak_bytes}): plan it again for these inputs "
                "(memfit.fit) and report the difference", UserWarning, stacklevel=2)
        predicted = rec.predicted_peak_bytes
        if exact and predicted and abs(rec.peak_bytes - predicted) > self.tolerance * predicted and ("drift", rec.shape) not in self.warned:
            self.warned.add(("drift", rec.shape))
            warnings.warn(
                f"memfit monitor: {name}'s step {rec.step} on inputs {shape} peaked at "
                f"{rec.peak_bytes} bytes, {100 * (rec.peak_bytes / predicted - 1):+.1f}% "
                f"from its plan's prediction of {predicted} (tolerance "
                f"{100 * self.tolerance:.0f}%): gradients kept from the last step "
                "(zero_grad(set_to_none=False)), another allocator or unmodelled kernels "
                "move the peak; check with memfit.verify", UserWarning, stacklevel=2)


def install_monitor(model: nn.Module, every: int, *, tolerance: float = DRIFT_TOLERANCE) -> Monitor:
    """Monitor ``model``'s training calls (replacing a monitor installed before): the records
    are ``model.memfit_monitor``."""
    remove_monitor(model)
    monitor = Monitor(model, every, tolerance=tolerance)
    model.__dict__[_HOOK_ATTR] = model.register_forward_pre_hook(monitor, with_kwargs=True)
    model.__dict__[_ATTR] = monitor.records
    return monitor


def remove_monitor(model: nn.Module) -> None:
    """Remove the monitor ``install_monitor`` put on ``model`` (its records stay, ended)."""
    handle = model.__dict__.pop(_HOOK_ATTR, None)
    if handle is None:
        return
    records = model.__dict__.get(_ATTR)
    if isinstance(records, MonitorRecords) and records.monitor is not None:
        records.monitor.flush()
        records.monitor = None
    handle.remove()


def log_values(model: nn.Module) -> dict[str, int | float]:
    """The values the integrations add to a training run's logs: the last monitored step's
    ``memfit/peak_bytes`` (int bytes) and ``memfit/step_s``, and the plan in effect's
    ``memfit/recompute_overhead`` (predicted recompute seconds, a fraction of the plain step:
    ``Plan.overhead``). Empty while ``model`` has no monitor record.

    Example:
        >>> log_values(torch.nn.Linear(2, 2))
        {}
    """
    records = model.__dict__.get(_ATTR)
    if not isinstance(records, MonitorRecords) or not records:
        return {}
    rec = records[-1]
    plan = model.__dict__.get("memfit_plan")
    return {"memfit/peak_bytes": rec.peak_bytes, "memfit/step_s": rec.step_s,
            "memfit/recompute_overhead": float(getattr(plan, "overhead", 0.0))}
