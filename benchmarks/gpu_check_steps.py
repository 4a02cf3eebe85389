"""How ``benchmarks.gpu_check`` runs, meters, compares and times one training step.

Every method (the plain step, memfit's plans, the peers) is a ``benchmarks.peers.Method``: a
model and its ``forward_loss``. Its step runs forward and loss under the case's autocast and
backward outside it, and keeps the output referenced until backward has run, as memfit's own
step does (NOTE [the measured step] in ``benchmarks.peers``).
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import memfit
from benchmarks.gpu_check_cases import GpuCase, autocast
from benchmarks.harness import (
    StepResult,
    compare_grads,
    median,
    seeded_step_grads,
    time_interleaved,
)
from benchmarks.peers import Family, Method

__all__ = ["Deadline", "Runner", "deterministic", "time_rounds"]


class Deadline:
    """A point in time a part of the run must end by (``None``: no limit)."""

    def __init__(self, seconds: float | None) -> None:
        self.end = None if seconds is None else time.perf_counter() + seconds

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.perf_counter()

    def expired(self) -> bool:
        return self.left() <= 0


@contextlib.contextmanager
def deterministic() -> Iterator[list[str]]:
    """``torch.use_deterministic_algorithms(True, warn_only=True)`` inside; yields a list that
    gets, on exit, the ops that warned they have no deterministic implementation.

    Warn-only, so that such an op (CUDA's max-pool-3d or adaptive-avg-pool backward) does not
    stop the case: the gradients are compared all the same, and the ops are recorded beside
    the verdict (a difference there is the device's, not the plan's).
    """
    was, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    ops: list[str] = []
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield ops
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
    for w in caught:
        text = str(w.message).splitlines()[0]
        if "deterministic" in text:
            ops.append(text[:200])
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    ops[:] = sorted(set(ops))


@dataclass(frozen=True)
class Outcome:
    """One seeded step: loss, gradients, buffers, and the RNG states after it."""

    result: StepResult
    rng: tuple[torch.Tensor, ...]


def compare(ref: Outcome, got: Outcome) -> dict[str, Any]:
    """``got`` against the plain step ``ref``, bitwise."""
    g = compare_grads(ref.result, got.result)
    rng = len(ref.rng) == len(got.rng) and all(torch.equal(a, b) for a, b in zip(ref.rng, got.rng, strict=True))
    return {"bitwise": g.grads_equal and g.buffers_equal and rng, "grads_equal": g.grads_equal,
            "loss_equal": g.loss_equal, "buffers_equal": g.buffers_equal, "rng_equal": rng,
            "max_abs_grad_diff": g.max_abs_grad_diff, "n_grads": g.n_grads}


class Runner:
    """One case on one device: its base model and inputs, and the steps of its methods."""

    def __init__(self, case: GpuCase, device: torch.device) -> None:
        self.case, self.device = case, device
        self.base = case.build(device)
        self.base.train()
        self.inputs = case.inputs(device, case.batch)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return autocast(self.case, self.device)

    def fresh(self) -> nn.Module:
        return copy.deepcopy(self.base)

    def method(self, name: str, model: nn.Module, family: Family = Family.MEMFIT,
               forward_loss: Callable[..., tuple[torch.Tensor, Any]] | None = None) -> Method:
        """``model``'s method (its own forward and the case's loss unless ``forward_loss``)."""
        loss_fn = self.case.loss_fn

        def own(*inputs: Any) -> tuple[torch.Tensor, Any]:
            out = model(*inputs)
            return loss_fn(out), out

        return Method(name, name, family, model, forward_loss or own, self.inputs)

    def step(self, method: Method) -> Callable[[], torch.Tensor]:
        """One training step of ``method``, synchronised with the device at its end."""
        forward_loss = method.forward_loss
        if forward_loss is None:
            raise ValueError(f"{method.name} cannot run: {method.reason}")

        def run() -> torch.Tensor:
            with self.autocast():
                loss, out = forward_loss(*self.inputs)
            loss.backward()
            del out
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return loss.detach()
        return run

    def seeded(self, method: Method) -> Outcome:
        """A step from seed 0: loss, gradients, buffers (put back after) and RNG states."""
        assert method.model is not None
        result = seeded_step_grads(method.model, self.step(method), seed=0)
        rng = [torch.get_rng_state()]
        if self.device.type == "cuda":
            rng.append(torch.cuda.get_rng_state(self.device))
        return Outcome(result, tuple(rng))

    def peak(self, method: Method) -> int:
        """The step's measured peak above its start (CUDA: ``max_memory_allocated``; CPU:
        memfit's allocator meter with its tensor tracker), after a warm-up step."""

        step = self.step(method)
        step()  # warm-up: cuBLAS/cuDNN workspaces and lazily loaded kernels are not the step's
        method.clear_grads()
        torch.manual_seed(0)
        meter = "allocator" if self.device.type == "cuda" else "both"
        return int(memfit.measure(step, device=self.device, model=method.model, meter=meter).peak_bytes)

    def clear(self, methods: dict[str, Method]) -> Callable[[str], None]:
        def before(name: str) -> None:
            methods[name].clear_grads()
        return before


def time_rounds(runner: Runner, methods: dict[str, Method], *, rounds: int,
                deadline: Deadline) -> dict[str, Any]:
    """Median step time of each method over interleaved rounds after one warm-up round; the
    rounds stop early (after at least one) when ``deadline`` passes."""
    steps = {n: runner.step(m) for n, m in methods.items()}
    names = list(steps)
    before = runner.clear(methods)
    time_interleaved(steps, warmup=1, repeats=0, before=before)
    times: dict[str, list[float]] = {n: [] for n in names}
    done = 0
    for r in range(rounds):
        if r and deadline.expired():
            break
        order = names[r % len(names):] + names[:r % len(names)]  # each round starts one later
        for n, ts in time_interleaved({n: steps[n] for n in order}, warmup=0, repeats=1,
                                      before=before).items():
            times[n].extend(ts)
        done += 1
    for m in methods.values():
        m.clear_grads()
    return {"rounds": done, "rounds_wanted": rounds,
            "median_s": {n: median(ts) for n, ts in times.items()}}
