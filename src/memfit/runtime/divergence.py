"""Divergence detection: the recomputation of a region must replay its forward op for op,
value for value.

NOTE [divergence check]
    torch's own determinism check compares the shapes, dtypes and devices of the *saved*
    tensors once recomputation is over. A region whose second call takes another branch with
    the same shapes (a flag flipped, a global read) passes that check and silently gets
    wrong gradients. With a check on, memfit records, during the forward, every op the
    region dispatches (overload, output shapes and dtypes) and compares the recomputation
    against that record as it runs, raising ``RecomputeMismatch`` at the first difference,
    before a wrong value can reach a gradient. ``aten.detach.default`` is skipped: the
    checkpoint machinery itself adds a different number of detaches on each pass.

    The recorder also counts ops when recording is off; chain segments use the count to see
    whether the parent ran ops between two blocks (see ``memfit.runtime.segment``).

NOTE [value check]
    Same ops are not same values: a block scaled by ``random.uniform`` (Python's RNG, which
    checkpointing does not replay) or a forward hook reading a call counter runs the same op
    sequence with other numbers, and its gradients are silently wrong. So the check also
    fingerprints every op output, in the forward and in the recomputation, and compares them
    when the recomputation ends (early stop included: what was not recomputed reaches no
    gradient). The rules:

    1. A fingerprint is exact: the bit patterns of a strided sample of the output (at most
       ``SAMPLE`` elements spread over every dimension, with an odd stride so that a sample
       of a power-of-two row does not sit in one column), viewed as integers and summed in
       int64. Same ops on the same inputs give the same bits on CPU (memfit's bitwise
       invariant), so any difference is a divergence, NaNs included.
    2. It catches a change that reaches a sampled element of some op output: a scaling, a
       shifted or re-drawn tensor, another constant. It misses a change confined to elements
       it does not sample (a single element written differently) and, rarely, two different
       samples whose sums collide.
    3. On a GPU, kernels that use atomics (``index_add``, ``scatter_add``, some convolution
       algorithms) can give other bits on the second call. The comparison stays exact; pass
       ``check="ops"`` (ops, shapes, dtypes only) for a region that runs such kernels, or
       ``torch.use_deterministic_algorithms(True)``.
    4. Fingerprints are computed below every dispatch mode (memfit's own, torch's
       selective-checkpoint cache, a user's), so they change no op count and no cache index,
       and on CPU they are Python ints summed from the sample's ``tolist()``: no tensor
       memory is allocated, not even for a moment (a tensor sum cast the 64-element sample
       to int64 first: 520 B on top of the op's output, which made a checked step peak
       above an unchecked one and above the plan's prediction). On other devices they stay
       0-dim device tensors, compared with one synchronisation per recomputation.
    5. Only plain tensors with a strided layout and 1, 2, 4 or 8-byte elements are
       fingerprinted; other outputs (subclasses, sparse, meta, complex128) are compared by
       op, shape and dtype only. So are the outputs of ops that allocate without writing
       (``empty``, ``empty_like``, ``new_empty``...): their bits are whatever the allocator
       held; the ops that fill them are fingerprinted. Views of such a storage are not
       fingerprinted until an op writes into it (a slice of an ``empty`` buffer that a
       ``cat(out=)`` fills next: ZeRO-3's parameter gathers). Nor are the outputs of
       collectives (``c10d.*``, ``_c10d_functional.*`` but ``wait_tensor``) or views of them: an async collective writes after it
       returns; the ops that read its result compute from the gathered values and are
       fingerprinted.
    6. Every op output is fingerprinted, on the differentiable path or not: a value the
       region makes without grad can still reach backward as a saved tensor
       (``x * torch.tensor(random.uniform(...))`` saves the re-drawn scalar, and torch's early
       stop ends the replay right after making it, before the ``mul`` whose output would
       differ), so every tensor the replay hands to backward is an output it compared.
       One exception: an update the replay skips (NOTE [buffers written in forward], rule
       2, in ``memfit.runtime.buffers``: a buffer no op of the region reads) computes nothing
       there; it returns the buffer as the whole forward left it, which after two updates
       (``m.mul_(0.9).add_(y)``) is not the first update's output, and nothing the region
       computes depends on it (``OpChecker(skipped=...)``; a false ``RecomputeMismatch``
       before). An update the replay runs again starts from the restored pre-forward value
       and is compared.

NOTE [check sampling]
    A divergence is nearly always there from the first step (a hook counter, Python's RNG,
    a flag set once): checking every call costs a region its op-by-op Python work on every
    step, for nothing after the first few. ``check=True`` therefore checks the first
    ``DivergenceCheck.first_calls`` forward calls of each wrapped module or segment, then one
    call in ``every`` (calls 0, every, 2*every... counted from 0 per region), and the other
    calls run exactly as with ``check=False``. A divergence that appears only later in
    training (a flag flipped at step 1000) is caught at the next sampled call, or never if it
    comes and goes between samples; ``check="always"`` checks every call.
    ``memfit.checkpoint(fn, ...)`` (the function form) has no identity across calls to count
    with, so it checks every call its ``check`` allows; wrap the module to sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from memfit._torch import TorchDispatchMode
from memfit.errors import RecomputeMismatch
from memfit.ops import IGNORED_OPS, is_view  # IGNORED_OPS re-exported: NOTE [ignored ops]
from memfit.runtime.fingerprints import (  # noqa: F401  (_sample, SAMPLE: re-exported)
    SAMPLE,
    _as_ints,
    _sample,
    _take_prints,
    fingerprint,
)

__all__ = ["DivergenceCheck", "CheckSampler", "CheckArg", "CheckName", "resolve_check", "fingerprint",
           "OpRecorder", "OpChecker"]

@dataclass(frozen=True)
class DivergenceCheck:
    """When and what the divergence check compares (NOTE [divergence check]).

    Attributes:
        first_calls: check every one of the region's first ``first_calls`` forward calls.
        every: after those, check one call in ``every`` (calls 0, every, 2*every...; 0: none).
        values: compare op output values (NOTE [value check]) besides ops, shapes and dtypes.

    Example:
        >>> wrap(block, check=DivergenceCheck(first_calls=10, every=50))   # doctest: +SKIP
    """

    first_calls: int = 3
    every: int = 100
    values: bool = True

    def __post_init__(self) -> None:
        for name in ("first_calls", "every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"DivergenceCheck.{name} must be an int >= 0, got {value!r}")

    def checks(self, call: int) -> bool:
        """True if the region's forward call number ``call`` (from 0) is checked."""
        return call < self.first_calls or (self.every > 0 and call % self.every == 0)


ALWAYS = DivergenceCheck(first_calls=0, every=1)

#: The checks ``check=`` takes by name (``resolve_check``).
CheckName = Literal["always", "ops", "always-ops"]
#: What ``check=`` accepts at the API edge: True (sampled), False (off), a name, or a
#: ``DivergenceCheck``.
CheckArg = bool | CheckName | DivergenceCheck

_NAMED = {"always": ALWAYS, "ops": DivergenceCheck(values=False),
          "always-ops": DivergenceCheck(first_calls=0, every=1, values=False)}


def resolve_check(check: CheckArg | None) -> DivergenceCheck | None:
    """Turn what users pass as ``check=`` into a :class:`DivergenceCheck` (None: off).

    ``True`` (the default): ops and values, the first 3 calls then one in 100;
    ``"always"``: ops and values on every call; ``"ops"``: ops, shapes and dtypes only,
    sampled like ``True``; ``"always-ops"``: ops only, every call; ``False``: no check; or a
    ``DivergenceCheck``.

    Raises:
        ValueError: an unknown string.
        TypeError: another type.
    """
    if check is True:
        return DivergenceCheck()
    if check is False or check is None:
        return None
    if isinstance(check, DivergenceCheck):
        return check
    if isinstance(check, str):
        found = _NAMED.get(check)
        if found is None:
            raise ValueError(f"check={check!r} is not a known check; use True, False, "
                             f"{', '.join(repr(n) for n in _NAMED)} or a DivergenceCheck")
        return found
    raise TypeError(f"check must be a bool, one of {sorted(_NAMED)} or a DivergenceCheck, "
                    f"got {type(check).__name__}")


class CheckSampler:
    """One region's call counter: decides which of its forward calls are checked
    (NOTE [check sampling]).

    Attributes:
        check: the resolved check (None: off).
        calls: forward calls seen so far.
        checked: how many of them were checked.
    """

    def __init__(self, check: CheckArg | CheckSampler | None) -> None:
        self.check: DivergenceCheck | None = (
            check.check if isinstance(check, CheckSampler) else resolve_check(check))
        self.calls = 0
        self.checked = 0
        # Whether a call drew from an explicit generator (NOTE [explicit generators] in
        # memfit.runtime.generators): then every later call is watched.
        self.generators = False

    def __repr__(self) -> str:
        return f"CheckSampler({self.check!r}, calls={self.calls}, checked={self.checked})"

    def next_call(self) -> DivergenceCheck | None:
        """Count one forward call; return the check to run on it (None: unchecked)."""
        call = self.calls
        self.calls += 1
        if self.check is None or not self.check.checks(call):
            return None
        self.checked += 1
        return self.check

    def watches_generators(self, check: DivergenceCheck | None) -> bool:
        """Whether the call just counted watches explicit generators (NOTE [explicit
        generators], rule 2): a checked call, the first call, or any call once one drew."""
        return check is not None or self.calls == 1 or self.generators

    def saw_generator(self) -> None:
        """A call drew from an explicit generator: watch every later call."""
        self.generators = True


_PROFILER: dict[Any, bool] = {}


def _unchecked(func: Any) -> bool:
    """True for ops that compute nothing the gradients read: the profiler's range markers
    (``record_function``, so also ``nn.DataParallel``), which a replay runs in other places
    than the forward when the range encloses the region's end."""
    found = _PROFILER.get(func)
    if found is None:
        found = _PROFILER[func] = str(func).startswith("profiler.")
    return found


# ---- recording and checking --------------------------------------------------------------
def _meta(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return (out.shape, out.dtype)
    if isinstance(out, (tuple, list)):
        return tuple(_meta(o) for o in out)
    return type(out).__name__


def _format_meta(meta: Any) -> str:
    if isinstance(meta, tuple) and len(meta) == 2 and isinstance(meta[1], torch.dtype):
        dtype = str(meta[1]).replace("torch.", "")
        return f"{dtype}{list(meta[0])}"
    if isinstance(meta, tuple):
        return "(" + ", ".join(_format_meta(m) for m in meta) + ")"
    return str(meta)


class OpRecorder(TorchDispatchMode):
    """Forward side: counts (and, if ``record``, records) the ops a region dispatches, and
    if ``values`` the fingerprints of their outputs."""

    def __init__(self, *, record: bool, values: bool = False) -> None:
        super().__init__()
        self.record = record
        self.values = values and record
        self.count = 0
        self.ops: list[tuple[Any, Any]] = []
        # Fingerprints of op outputs, and where each comes from: (op index, output index).
        self.prints: list[int | torch.Tensor] = []
        self.where: list[tuple[int, int]] = []
        # Storages allocated without a write or owned by a collective (NOTE [value check], 5).
        self.blank: set[int] = set()
        # Number of leading recorded ops the recomputation must reproduce (None: all).
        self.replayed_prefix: int | None = None
        # > 0 while a recomputation of this region runs inside its own forward: a backward
        # the forward runs (``torch.autograd.grad`` of an energy, a gradient penalty) unpacks
        # the region's saved tensors, which recomputes them; those ops are not the forward's.
        self.paused = 0

    def pause(self) -> None:
        self.paused += 1

    def resume(self) -> None:
        self.paused -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in IGNORED_OPS and not _unchecked(func):
            self.note(func, out, args, kwargs)
        return out

    def note(self, func: Any, out: Any, args: tuple = (), kwargs: dict | None = None) -> None:
        """Count (and record) one op without dispatching it (called by the region policy)."""
        if self.paused or _unchecked(func):
            return
        self.count += 1
        if self.record:
            self.ops.append((func, _meta(out)))
            if self.values:
                _take_prints(func, out, len(self.ops) - 1, self.prints, self.where,
                             self.blank)


class OpChecker(TorchDispatchMode):
    """Recompute side: compares each op against the forward's record, raising at the first
    difference (NOTE [divergence check]); compares output fingerprints when the
    recomputation ends (NOTE [value check])."""

    def __init__(self, recorder: OpRecorder, region: str, *,
                 skipped: Callable[[Any, tuple, dict], bool] | None = None) -> None:
        super().__init__()
        self.recorder = recorder
        self.region = region
        # ``(func, args, kwargs) -> bool``: an op the replay skips, not compared by value
        # (NOTE [value check], rule 6)
        self.skipped = skipped
        self.position = 0
        self.prints: list[int | torch.Tensor] = []
        self._where: list[tuple[int, int]] = []
        self.blank: set[int] = set()

    def __enter__(self):
        self.position = 0
        self.prints, self._where, self.blank = [], [], set()
        return super().__enter__()

    def _expected_len(self) -> int:
        prefix = self.recorder.replayed_prefix
        return len(self.recorder.ops) if prefix is None else prefix

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in IGNORED_OPS or _unchecked(func):
            return func(*args, **(kwargs or {}))
        i, n, ops = self.position, self._expected_len(), self.recorder.ops
        # A view computes nothing: one the replay runs where the forward did not (a user's
        # mode or hook that reshapes in backward) passes; one the forward ran where the
        # replay does not is skipped. A view taken differently shows in the ops after it.
        if is_view(func) and not (i < n and ops[i][0] is func):
            return func(*args, **(kwargs or {}))
        while i < n and ops[i][0] is not func and is_view(ops[i][0]):
            i += 1
        self.position = i + 1
        if i >= n:
            self._fail(i, None, (func, None))
        expected = self.recorder.ops[i]
        if expected[0] is not func:
            self._fail(i, expected, (func, None))
        out = func(*args, **(kwargs or {}))
        got = _meta(out)
        if got != expected[1]:
            self._fail(i, expected, (func, got))
        if self.recorder.values and not (self.skipped is not None
                                         and self.skipped(func, args, kwargs or {})):
            _take_prints(func, out, i, self.prints, self._where, self.blank)
        return out

    def __exit__(self, exc_type, exc, tb):
        result = super().__exit__(exc_type, exc, tb)
        # An exception (torch's early stop included) ends the replay before its end on
        # purpose; the values replayed so far are still compared.
        if exc_type is None or not issubclass(exc_type, RecomputeMismatch):
            self._check_values(self.position)
        n, ops = self._expected_len(), self.recorder.ops
        while exc_type is None and self.position < n and is_view(ops[self.position][0]):
            self.position += 1
        if exc_type is None and self.position < n:
            self._fail(self.position, self.recorder.ops[self.position], None)
        return result

    def _check_values(self, before_op: int) -> None:
        """Raise at the first output, among ops ``< before_op``, whose fingerprint differs."""
        forward = {where: n for n, where in enumerate(self.recorder.where)}
        pairs = [(where, fp, forward[where]) for where, fp in zip(self._where, self.prints,
                                                                  strict=True)
                 if where[0] < before_op and where in forward]
        if not pairs:
            return
        got = _as_ints([fp for _, fp, _ in pairs])
        expected = _as_ints([self.recorder.prints[n] for _, _, n in pairs])
        if got == expected:
            return
        j = next(j for j in range(len(pairs)) if got[j] != expected[j])
        i, k = pairs[j][0]
        op, meta = self.recorder.ops[i]
        if isinstance(meta, tuple) and meta and not isinstance(meta[1], torch.dtype):
            meta, which = meta[k], f"output {k} of "
        else:
            which = ""
        raise RecomputeMismatch(
            f"recomputation of {self.region} gave other values than its forward at op {i} "
            f"({which}{op} -> {_format_meta(meta)}): fingerprint {got[j]} vs {expected[j]} in "
            "the forward, although the ops, shapes and dtypes up to there agree. Its gradients "
            "would be wrong. The region computes something else when called again (Python's "
            "random module, a counter in a hook, a global changed between forward and "
            "backward): make it deterministic (torch's RNG is replayed), pass check=\"ops\" "
            "if it runs nondeterministic GPU kernels, or check=False to skip the check."
        )

    def _fail(self, i: int, expected: tuple[Any, Any] | None, got: tuple[Any, Any] | None) -> None:
        # A value that diverged earlier is the first difference (and likely the cause).
        self._check_values(i)

        def describe(entry: tuple[Any, Any] | None, what: str) -> str:
            if entry is None:
                return f"the {what} had no op there (it ran {i} ops)"
            op, meta = entry
            return f"the {what} ran {op}" + (f" -> {_format_meta(meta)}" if meta is not None else "")

        if expected is None:
            exp_text = f"the forward ran only {self._expected_len()} ops"
        else:
            exp_text = describe(expected, "forward")
        raise RecomputeMismatch(
            f"recomputation of {self.region} diverged from its forward at op {i}: {exp_text}, "
            f"but {describe(got, 'recomputation')}. Its gradients would be wrong. The region "
            "must do the same thing when called again (a flag, a global or a data-dependent "
            "branch changed between forward and backward): make it deterministic, or pass "
            "check=False to skip this check."
        )
