"""How ``verify`` compares a planned step with the plain step: bitwise, or within the plain
step's own run-to-run spread.

``comparison_for`` picks the mode from the device and torch's determinism flag;
``compare_steps`` turns two (or, in the spread mode, three) ``StepResult`` into ``Check``s.

NOTE [comparison modes]
    1. On CPU, and on any device while ``torch.use_deterministic_algorithms(True)`` is on
       (not ``warn_only``), the same ops on the same inputs give the same bits: the planned
       step must be **bitwise** equal to the plain step (``torch.equal``; NaNs by their bits).
    2. Elsewhere (CUDA without deterministic algorithms) some kernels are not run-to-run
       deterministic (atomic adds in embedding, index and scatter backward, split-K matmuls,
       cuDNN's algorithm choice): two plain steps already differ in the last bits, and a
       bitwise comparison would fail a correct plan. ``verify`` then runs the plain step
       twice and takes, for each floating tensor t (the loss, each output, each gradient,
       each buffer), its spread ``s_t = max |plain_1 - plain_2|``. The planned tensor passes
       **within plain spread** when
       ``max |planned - plain_1| <= tol_t = max(SPREAD_FACTOR x s_t, floor_t)``,
       ``floor_t = SPREAD_FLOOR_ULPS x eps(dtype) x max |plain_1|`` (finite values).
    3. ``SPREAD_FACTOR = 4``: ``s_t`` is one sample of the largest run-to-run difference and
       the planned step is a third run; ``|planned - plain_1| <= |planned - plain_2| + s_t``,
       so twice ``s_t`` is what a correct plan reaches in expectation, and 4 leaves room for
       one sample's maximum to fall short of another's. A wrong recompute (another branch,
       another random mask) differs by the order of the values themselves, far beyond it.
    4. The floor is for tensors whose two plain runs agree exactly: with few colliding
       atomics the order can come out the same twice and differ the third time, and a
       tolerance of 0 would fail a correct plan. 4 ulps of the tensor's largest magnitude is
       a few rounding steps of one reordered sum (float32: 4.8e-7 of it; bfloat16: 3.1%),
       far below any real bug.
    5. Non-floating tensors (``num_batches_tracked``, integer outputs) and the RNG state
       after the step are compared exactly in either mode: no kernel makes them vary.
    ``VerifyReport.bitwise`` is true only when every tensor compared equal, in either mode.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from memfit.measuring.twins import StepResult

__all__ = ["Check", "Comparison", "comparison_for", "compare_steps", "SPREAD_FACTOR", "SPREAD_FLOOR_ULPS"]

#: A tensor may differ from the plain step by this many times the plain run-to-run spread...
SPREAD_FACTOR = 4.0
#: ...or by this many ulps of its largest magnitude, if more (NOTE [comparison modes]).
SPREAD_FLOOR_ULPS = 4


@dataclass(frozen=True)
class Check:
    """One comparison ``verify`` made: its name, whether it passed, and what it saw."""

    name: str
    passed: bool
    detail: str


class Comparison(enum.Enum):
    """How the planned step's tensors are compared with the plain step's."""

    BITWISE = "bitwise"
    WITHIN_PLAIN_SPREAD = "within plain spread"


def comparison_for(device: torch.device | str, deterministic: bool | None = None) -> Comparison:
    """The comparison a step on ``device`` allows (NOTE [comparison modes]).

    Args:
        device: where the steps run.
        deterministic: whether torch runs deterministic algorithms only; default
            ``torch.are_deterministic_algorithms_enabled()`` and not ``warn_only`` (which
            still runs the nondeterministic kernels, with a warning).

    Example:
        >>> comparison_for("cpu").value, comparison_for("cuda", deterministic=False).value
        ('bitwise', 'within plain spread')
    """
    if deterministic is None:
        deterministic = (torch.are_deterministic_algorithms_enabled()
                         and not torch.is_deterministic_algorithms_warn_only_enabled())
    if torch.device(device).type == "cpu" or deterministic:
        return Comparison.BITWISE
    return Comparison.WITHIN_PLAIN_SPREAD


# ---- per tensor -----------------------------------------------------------------------------
@dataclass
class Diff:
    """What the comparisons of a group of tensors found (mutable: built tensor by tensor)."""

    bitwise: bool = True
    max_abs: float = 0.0
    max_rel: float = 0.0
    close: bool = True
    first_bad: str = ""
    first_bad_detail: str = ""  # by how much the first failing tensor missed its tolerance (spread mode)
    equal: int = 0
    tightest: str = ""  # the tensor nearest to its tolerance, and the tolerance (spread mode)
    tightest_ratio: float = -1.0

    def add(self, other: Diff) -> None:
        self.bitwise &= other.bitwise
        self.close &= other.close
        self.max_abs = max(self.max_abs, other.max_abs)
        self.max_rel = max(self.max_rel, other.max_rel)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if a.is_floating_point():  # NaNs compare unequal; compare the bits
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
        if bits is not None:
            return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
    return False


def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """A sparse gradient (``nn.Embedding(sparse=True)``) as the dense tensor it stands for:
    two steps may list the same rows in another order, and torch compares no sparse tensors."""
    if t is not None and t.layout != torch.strided:
        return t.coalesce().to_dense() if t.is_sparse else t.to_dense()
    return t


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.complex128 if t.is_complex() else torch.float64)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|``; NaN beside NaN and equal infinities count as equal, NaN beside a
    number as infinitely far."""
    if not a.numel():
        return 0.0
    x, y = _wide(a), _wide(b)
    d = (x - y).abs()
    d = torch.where((x == y) | (torch.isnan(x) & torch.isnan(y)), torch.zeros_like(d), d)
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    return float(d.max())


def _floor(b: torch.Tensor) -> float:
    mags = _wide(b).abs()
    mags = mags[torch.isfinite(mags)]
    mag = float(mags.max()) if mags.numel() else 0.0
    return SPREAD_FLOOR_ULPS * torch.finfo(b.dtype).eps * mag


def _compare(diff: Diff, what: str, a: torch.Tensor | None, b: torch.Tensor | None,
             b2: torch.Tensor | None, spread: bool) -> None:
    """Compare planned ``a`` with plain ``b``; ``b2`` is the second plain run (spread mode)."""
    a, b, b2 = _dense(a), _dense(b), _dense(b2)
    if a is None or b is None:
        if (a is None) != (b is None):
            diff.bitwise = diff.close = False
            diff.max_abs = diff.max_rel = math.inf
            diff.first_bad = diff.first_bad or f"{what} (gradient missing in one step)"
        else:
            diff.equal += 1
        return
    if a.shape != b.shape or a.dtype != b.dtype:
        diff.bitwise = diff.close = False
        diff.max_abs = diff.max_rel = math.inf
        diff.first_bad = diff.first_bad or f"{what} ({tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype})"
        return
    if _bitwise_equal(a, b):
        diff.equal += 1
        return
    diff.bitwise = False
    floating = a.is_floating_point() or a.is_complex()
    if not floating:
        diff.max_abs = diff.max_rel = math.inf
        diff.close = False
        diff.first_bad = diff.first_bad or f"{what} (not floating: must be equal)"
        return
    max_abs = _max_abs_diff(a, b)
    d = (_wide(a) - _wide(b)).abs()
    rel = d / _wide(b).abs().clamp_min(1e-30)
    max_rel = math.inf if math.isinf(max_abs) else float(torch.nan_to_num(rel, nan=0.0).max())
    diff.max_abs = max(diff.max_abs, max_abs)
    diff.max_rel = max(diff.max_rel, max_rel)
    close = False
    if spread:
        if b2 is None or b2.shape != b.shape or b2.dtype != b.dtype:
            diff.close = False
            diff.first_bad = diff.first_bad or f"{what} (missing or reshaped in the second plain step)"
            return
        s = _max_abs_diff(b, b2)
        floor = _floor(b)
        tol = max(SPREAD_FACTOR * s, floor)
        close = max_abs <= tol
        tol_text = (f"{tol:.3g} = max({SPREAD_FACTOR:g} x its plain run-to-run spread {s:.3g}, "
                    f"floor {SPREAD_FLOOR_ULPS} ulps {floor:.3g})")
        ratio = max_abs / tol if tol else (0.0 if max_abs == 0 else math.inf)
        if ratio > diff.tightest_ratio:
            diff.tightest, diff.tightest_ratio = f"{what}: {max_abs:.3g} <= {tol_text}", ratio
        if not close and not diff.first_bad:
            diff.first_bad_detail = f"{what} differs from the plain step by {max_abs:.3g}, more than {tol_text}"
    if not close:
        diff.close = False
        diff.first_bad = diff.first_bad or what


def _tensor_check(name: str, pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]],
                  mode: Comparison, total: Diff) -> Check:
    spread = mode is Comparison.WITHIN_PLAIN_SPREAD
    diff = Diff()
    for what, a, b, b2 in pairs:
        _compare(diff, what, a, b, b2, spread)
    total.add(diff)
    n = len(pairs)
    if diff.bitwise:
        return Check(name, True, f"{n} tensor{'s' if n != 1 else ''} bitwise equal")
    how = f"max abs diff {diff.max_abs:.3g}, max rel diff {diff.max_rel:.3g}"
    if diff.close:  # and not bitwise: only in spread mode
        return Check(name, True, f"{n} tensor{'s' if n != 1 else ''} within the plain step's spread, "
                                 f"{diff.equal} bitwise equal ({how}; tightest {diff.tightest})")
    if diff.first_bad_detail:
        return Check(name, False, f"{diff.first_bad_detail} ({how})")
    if spread:
        need = "the same shape, dtype and presence, and equality if not floating"
    else:
        need = "bitwise equality (on CPU, or with deterministic algorithms)"
    return Check(name, False, f"{diff.first_bad} differs from the plain step ({how}; need {need})")


def compare_steps(got: StepResult, ref: StepResult, mode: Comparison,
                  ref2: StepResult | None = None) -> tuple[list[Check], Diff, bool]:
    """The checks of the planned step ``got`` against the plain step ``ref``.

    Args:
        got: what the planned step left.
        ref: what the plain step left.
        mode: the comparison (``comparison_for``).
        ref2: a second run of the plain step, from the same start; needed by
            ``Comparison.WITHIN_PLAIN_SPREAD`` (NOTE [comparison modes]).

    Returns:
        The checks (loss, outputs, parameter gradients, input gradients if any, buffers, RNG
        state), the totals over every tensor, and whether the buffers passed.
    """
    if mode is Comparison.WITHIN_PLAIN_SPREAD and ref2 is None:
        raise ValueError("comparing within the plain step's spread needs a second plain run (ref2=)")
    r2 = ref2 if ref2 is not None else StepResult()
    total = Diff()

    def nth(xs: list[torch.Tensor | None], i: int) -> torch.Tensor | None:
        return xs[i] if i < len(xs) else None

    checks = [
        _tensor_check("loss", [("loss", got.loss, ref.loss, r2.loss)], mode, total),
        _tensor_check("outputs", [(f"output {i}", a, b, nth(list(r2.outputs), i))
                                  for i, (a, b) in enumerate(zip(got.outputs, ref.outputs, strict=False))],
                      mode, total),
        _tensor_check("parameter gradients",
                      [(f"{n}.grad", got.param_grads.get(n), ref.param_grads.get(n), r2.param_grads.get(n))
                       for n in ref.param_grads], mode, total),
    ]
    if len(got.outputs) != len(ref.outputs):
        total.bitwise = total.close = False
        checks[1] = Check("outputs", False, f"the planned step returned {len(got.outputs)} tensors, "
                                            f"the plain step {len(ref.outputs)}")
    if ref.input_grads:
        checks.append(_tensor_check(
            "input gradients",
            [(f"input {i}.grad", a, b, nth(r2.input_grads, i))
             for i, (a, b) in enumerate(zip(got.input_grads, ref.input_grads, strict=False))],
            mode, total))
    buf = _tensor_check("buffers (BatchNorm statistics, masks)",
                        [(n, got.buffers.get(n), ref.buffers.get(n), r2.buffers.get(n)) for n in ref.buffers],
                        mode, total)
    if not ref.buffers:
        buf = Check("buffers (BatchNorm statistics, masks)", True, "the model has no buffers")
    checks.append(buf)
    rng_same = torch.equal(got.rng_after, ref.rng_after)
    checks.append(Check("RNG state after the step", rng_same,
                        "same as the plain step" if rng_same else
                        "differs from the plain step: recompute consumed random numbers again"))
    return checks, total, buf.passed
