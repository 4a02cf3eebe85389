"""Divergence detection: the recomputation of a region must replay its forward op for op.

NOTE [divergence check]
    torch's own determinism check compares the shapes, dtypes and devices of the *saved*
    tensors once recomputation is over. A region whose second call takes another branch with
    the same shapes (a flag flipped, a global read) passes that check and silently gets
    wrong gradients. With ``check=True`` memfit records, during the forward, every op the
    region dispatches (overload, output shapes and dtypes) and compares the recomputation
    against that record as it runs, raising ``RecomputeMismatch`` at the first difference,
    before a wrong value can reach a gradient. ``aten.detach.default`` is skipped: the
    checkpoint machinery itself adds a different number of detaches on each pass.

    The recorder also counts ops when recording is off; chain segments use the count to see
    whether the parent ran ops between two blocks (see ``memfit.runtime.segment``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.errors import RecomputeMismatch
from memfit.ops import IGNORED_OPS  # re-exported: NOTE [ignored ops] in memfit.ops

__all__ = ["OpRecorder", "OpChecker"]


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
    """Forward side: counts (and, if ``record``, records) the ops a region dispatches."""

    def __init__(self, *, record: bool) -> None:
        super().__init__()
        self.record = record
        self.count = 0
        self.ops: list[tuple[Any, Any]] = []
        # Number of leading recorded ops the recomputation must reproduce (None: all).
        self.replayed_prefix: int | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in IGNORED_OPS:
            self.count += 1
            if self.record:
                self.ops.append((func, _meta(out)))
        return out

    def note(self, func: Any, out: Any) -> None:
        """Count (and record) one op without dispatching it (called by the region policy)."""
        self.count += 1
        if self.record:
            self.ops.append((func, _meta(out)))


class OpChecker(TorchDispatchMode):
    """Recompute side: compares each op against the forward's record, raising at the first
    difference (NOTE [divergence check])."""

    def __init__(self, recorder: OpRecorder, region: str) -> None:
        super().__init__()
        self.recorder = recorder
        self.region = region
        self.position = 0

    def __enter__(self):
        self.position = 0
        return super().__enter__()

    def _expected_len(self) -> int:
        prefix = self.recorder.replayed_prefix
        return len(self.recorder.ops) if prefix is None else prefix

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in IGNORED_OPS:
            return func(*args, **(kwargs or {}))
        i = self.position
        self.position += 1
        if i >= self._expected_len():
            self._fail(i, None, (func, None))
        expected = self.recorder.ops[i]
        if expected[0] is not func:
            self._fail(i, expected, (func, None))
        out = func(*args, **(kwargs or {}))
        got = _meta(out)
        if got != expected[1]:
            self._fail(i, expected, (func, got))
        return out

    def __exit__(self, exc_type, exc, tb):
        result = super().__exit__(exc_type, exc, tb)
        # An exception (torch's early stop included) ends the replay before its end on purpose.
        if exc_type is None and self.position < self._expected_len():
            self._fail(self.position, self.recorder.ops[self.position], None)
        return result

    def _fail(self, i: int, expected: tuple[Any, Any] | None, got: tuple[Any, Any] | None) -> None:
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
