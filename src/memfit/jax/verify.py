"""verify: a planned JAX step's outputs against the plain ``jax.value_and_grad`` step's, bit for bit.

NOTE [JAX plans verified on the batch]
    A plan changes only where values are recomputed, not what is computed, so on the CPU its
    loss, aux and gradients should be the plain step's bits. XLA does not always keep them:
    it compiles a recomputed chain into other fusions than the forward's, and a reduction
    fused with a different producer may sum in another order. Measured (jax 0.10.2, CPU, the
    tests' tiny GPT of d_model 16): the first block checkpointed whole, nothing saved, gives
    its LayerNorm's scale gradient 1.5e-8 away from plain's, where blocks 1-3 alike are
    bitwise; saving the LayerNorm's reductions does not change it (the reduction that moved
    is the scale gradient's own, in the backward); JAX's own ``nothing_saveable`` on every
    stage of the tiny 3D conv net differs by 7e-9. No rule on the plan predicts which.
    So where ``memfit.jax.fit`` checks plans against XLA (NOTE [budgets checked against XLA]
    in ``memfit.jax.measured``), it also runs them: each compiled candidate once on the
    ``params`` and ``batch`` it was given, against the plain step on the same, and of the
    plans XLA reports within the budget it returns the cheapest whose every output leaf is
    bitwise equal (``Verification.bitwise``). One batch is evidence, not proof: a different
    summation order shows on nearly every random input, the same order on none; check
    others with ``step.verify(params, batch)``. Where no plan within the budget is bitwise,
    ``fit`` returns the cheapest with a warning giving its largest difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

__all__ = ["Verification", "compare", "Reference"]


@dataclass(frozen=True)
class Verification:
    """A planned step's outputs against the plain step's on one batch.

    Attributes:
        bitwise: every leaf (loss, aux, gradients) equal bit for bit (so a NaN only where
            plain's is, and -0.0 only where plain's is).
        max_abs_diff: the largest absolute difference over all leaves (0.0 when bitwise; inf
            where one has a NaN the other has not).
        differing: the paths of the leaves that differ (``jax.tree_util.keystr``).
        leaves: how many leaves were compared.
    """

    bitwise: bool
    max_abs_diff: float
    differing: tuple[str, ...]
    leaves: int

    def __str__(self) -> str:
        if self.bitwise:
            return f"bitwise equal to the plain step ({self.leaves} leaves)"
        shown = ", ".join(self.differing[:3]) + (" ..." if len(self.differing) > 3 else "")
        return (f"{len(self.differing)} of {self.leaves} leaves differ from the plain step, by up to "
                f"{self.max_abs_diff:.3g} ({shown})")


def compare(got: Any, want: Any) -> Verification:
    """Compare two output pytrees leaf by leaf, bitwise.

    Example:
        >>> import jax.numpy as jnp
        >>> compare({"a": jnp.ones(2)}, {"a": jnp.ones(2)}).bitwise
        True
        >>> compare({"a": jnp.ones(2)}, {"a": jnp.array([1.0, 1.5])}).max_abs_diff
        0.5
    """
    g, g_tree = jax.tree_util.tree_flatten_with_path(got)
    w, w_tree = jax.tree_util.tree_flatten_with_path(want)
    if str(g_tree) != str(w_tree):
        raise ValueError(f"the planned step's outputs have another structure than the plain step's: "
                         f"{g_tree} against {w_tree}")
    worst = 0.0
    differing = []
    for (path, a), (_, b) in zip(g, w, strict=True):
        x, y = np.ascontiguousarray(a), np.ascontiguousarray(b)
        if x.shape != y.shape or x.dtype != y.dtype:
            raise ValueError(f"leaf {_path(path)}: {x.dtype}{list(x.shape)} against "
                             f"the plain step's {y.dtype}{list(y.shape)}")
        if np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8)):
            continue  # the same bits (a NaN where plain's is, with its payload)
        differing.append(_path(path))
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        if (np.isnan(x64) != np.isnan(y64)).any():
            worst = float("inf")
        elif x.size:
            d = np.abs(np.where(np.isnan(x64), 0.0, x64 - y64))
            worst = max(worst, float(d.max()))
    return Verification(not differing, worst, tuple(differing), len(w))


def _path(path: Any) -> str:
    return jax.tree_util.keystr(path) or "<the output>"


class Reference:
    """The plain step's outputs on one ``params`` and ``batch``, computed on first use."""

    def __init__(self, loss_fn: Any, params: Any, batch: Any, *, has_aux: bool) -> None:
        self.loss_fn, self.params, self.batch, self.has_aux = loss_fn, params, batch, has_aux
        self._outputs: Any = None

    @property
    def outputs(self) -> Any:
        if self._outputs is None:
            plain = jax.jit(jax.value_and_grad(self.loss_fn, has_aux=self.has_aux))
            self._outputs = jax.block_until_ready(plain(self.params, self.batch))
        return self._outputs

    def check(self, run: Any) -> Verification:
        """``run(params, batch)`` (a compiled planned step) against the plain outputs."""
        return compare(jax.block_until_ready(run(self.params, self.batch)), self.outputs)
