"""The shared benchmark harness: pinned malloc, fixed threads, interleaved timing, records.

NOTE [pinned malloc]
    glibc's default malloc hands big freed blocks (activations) back to the OS and page-faults
    them in again on the next step. That costs more than the arithmetic on an activation-heavy
    model and hides the price of recomputation: on the activation-heavy GPT the plain step took
    1.2-1.46 s and every-block checkpointing looked +1% slower; with the thresholds below (freed
    memory stays in the heap, as a GPU caching allocator keeps it) the plain step is a stable
    0.91 s and every-block checkpointing +47.5%. glibc reads these variables once, at start,
    so a process that lacks them re-executes itself with them set.

NOTE [interleaving]
    Methods are timed round-robin, A B C B C A C A B ..., never A A A B B B: drift of the machine
    (other processes, thermal state, a neighbour's compile) then hits every method alike, and
    ratios between methods stay meaningful even when absolute times move.
"""

from __future__ import annotations

import datetime as _dt
import gc
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "PINNED_MALLOC",
    "Environment",
    "GradCheck",
    "collect_environment",
    "compare_grads",
    "ensure_pinned_malloc",
    "interleaved_order",
    "load_average",
    "median",
    "pinned_env",
    "seeded_step_grads",
    "time_interleaved",
]

log = logging.getLogger(__name__)

PINNED_MALLOC: dict[str, str] = {
    "MALLOC_MMAP_THRESHOLD_": "33554432",      # 32 MiB: smaller blocks come from the heap
    "MALLOC_TRIM_THRESHOLD_": "17179869184",   # 16 GiB: never give the heap top back
    "MALLOC_TOP_PAD_": "268435456",            # 256 MiB: grow the heap in big steps
}
_REEXEC_MARK = "MEMFIT_BENCH_REEXEC"


# ---- malloc ------------------------------------------------------------------------------
def pinned_env(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment to re-execute with, or ``None`` when ``environ`` is already pinned."""
    if all(environ.get(k) == v for k, v in PINNED_MALLOC.items()):
        return None
    return {**environ, **PINNED_MALLOC, _REEXEC_MARK: "1"}


def ensure_pinned_malloc(module: str, argv: Sequence[str]) -> None:
    """Re-execute ``python -m module argv...`` with the pinned malloc if this process lacks it.

    Returns only when the malloc is pinned (see NOTE [pinned malloc]).
    """
    env = pinned_env(os.environ)
    if env is None:
        return
    if os.environ.get(_REEXEC_MARK):
        raise RuntimeError(
            "re-executed with the pinned malloc variables but they are still missing: "
            f"{ {k: os.environ.get(k) for k in PINNED_MALLOC} }; set them by hand: "
            + " ".join(f"{k}={v}" for k, v in PINNED_MALLOC.items())
        )
    log.info("re-executing with the pinned glibc malloc")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)


# ---- environment -------------------------------------------------------------------------
@dataclass(frozen=True)
class Environment:
    """Where and with what a benchmark ran; stored in every result file."""

    date: str
    torch_version: str
    python_version: str
    cpu_model: str
    threads: int
    interop_threads: int
    git_commit: str
    git_dirty: bool
    malloc: dict[str, str]
    platform: str
    transformers_version: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def load_average() -> float | None:
    """The 1-minute load average: above the core count, other processes share the timed cores."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def collect_environment(threads: int) -> Environment:
    """Fix torch's thread count to ``threads`` and describe the machine and code."""
    torch.set_num_threads(threads)
    try:
        import transformers

        tv = transformers.__version__
    except ImportError:
        tv = ""
    return Environment(
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        torch_version=torch.__version__,
        python_version=platform.python_version(),
        cpu_model=_cpu_model(),
        threads=torch.get_num_threads(),
        interop_threads=torch.get_num_interop_threads(),
        git_commit=_git("rev-parse", "HEAD") or "none (no commit yet)",
        git_dirty=bool(_git("status", "--porcelain")),
        malloc={k: os.environ.get(k, "") for k in PINNED_MALLOC},
        extra={"TORCHINDUCTOR_COMPILE_THREADS": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", ""),
               "cpu_count": os.cpu_count() or 0, "load_average_1m": load_average()},
        platform=platform.platform(),
        transformers_version=tv,
    )


# ---- timing ------------------------------------------------------------------------------
def interleaved_order(names: Sequence[str], rounds: int) -> list[str]:
    """``names`` round-robin ``rounds`` times, each round starting one method later:
    ``[A, B, C, B, C, A, C, A, B, ...]``.

    On this project's machine the method run first in a round (after the last one of the
    previous round) measured 4-14% slower than an identical twin run later in the round; the
    rotation gives every method every position and predecessor alike.
    """
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    n = len(names)
    return [names[(r + i) % n] for r in range(rounds) for i in range(n)]


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def time_interleaved(
    steps: Mapping[str, Callable[[], object]],
    *,
    warmup: int,
    repeats: int,
    before: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    cpu_clock: Callable[[], float] = time.process_time,
    cpu_times: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Time each step ``repeats`` times after ``warmup`` untimed rounds, methods interleaved.

    Args:
        steps: method name -> a callable running one training step.
        warmup: rounds run first and discarded.
        repeats: timed rounds.
        before: called with the method's name before each step, outside the timed window
            (clears gradients).
        clock: the wall-clock timer (seconds).
        cpu_clock: the process CPU-time timer (seconds, all threads).
        cpu_times: if given, filled like the result with each step's CPU time. Other processes
            on the same cores inflate wall time much more than this process's CPU time.

    Returns:
        method name -> the ``repeats`` step times, seconds, in the order they ran.
    """
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a cycle collection inside one method's window would be charged to it
    try:
        for i, name in enumerate(interleaved_order(names, warmup + repeats)):
            if before is not None:
                before(name)
            gc.collect()
            c0 = cpu_clock()
            t0 = clock()
            steps[name]()
            dt = clock() - t0
            dc = cpu_clock() - c0
            if i >= warmup * len(names):
                times[name].append(dt)
                if cpu_times is not None:
                    cpu_times.setdefault(name, []).append(dc)
    finally:
        if gc_was_enabled:
            gc.enable()
    return times


# ---- gradients ---------------------------------------------------------------------------
@dataclass(frozen=True)
class GradCheck:
    """One method's step compared with the plain step, same seed.

    ``grads_equal``: every parameter gradient ``torch.equal`` to the plain step's (and the loss
    too). ``buffers_equal``: buffers after the step equal (BatchNorm running statistics).
    """

    grads_equal: bool
    loss_equal: bool
    buffers_equal: bool
    max_abs_grad_diff: float
    n_grads: int
    missing: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def seeded_step_grads(model: torch.nn.Module, step: Callable[[], torch.Tensor], *, seed: int) -> StepResult:
    """Run ``step`` once from ``seed`` with gradients cleared; return loss, grads and buffers.

    The model's buffers (BatchNorm statistics) are put back afterwards, so that every method's
    check starts from the same state whatever ran before on the same model.
    """
    before = {n: b.detach().clone() for n, b in model.named_buffers()}
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = step()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    for p in model.parameters():
        p.grad = None
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(before[n])
    return StepResult(loss.detach().clone(), grads, buffers)


def compare_grads(ref: StepResult, got: StepResult) -> GradCheck:
    """Bitwise comparison of ``got`` against the plain step ``ref``."""
    missing = tuple(sorted(set(ref.grads) ^ set(got.grads)))
    equal = not missing
    worst = 0.0
    for name, g in ref.grads.items():
        h = got.grads.get(name)
        if h is None:
            continue
        if h.shape != g.shape or not torch.equal(g, h):
            equal = False
            if h.shape == g.shape:
                worst = max(worst, float((g.double() - h.double()).abs().max()))
            else:
                worst = float("inf")
    buffers_equal = set(ref.buffers) == set(got.buffers) and all(
        torch.equal(b, got.buffers[n]) for n, b in ref.buffers.items()
    )
    loss_equal = bool(torch.equal(ref.loss, got.loss))
    return GradCheck(
        grads_equal=equal and loss_equal,
        loss_equal=loss_equal,
        buffers_equal=buffers_equal,
        max_abs_grad_diff=worst,
        n_grads=len(ref.grads),
        missing=missing,
    )
