"""memfit for JAX: profile a ``jax.value_and_grad`` step, plan it, run it as remat regions.

An optional front end (``pip install memfit[jax]``); the torch side never imports it.

    >>> import memfit.jax                                               # doctest: +SKIP
    >>> step = memfit.jax.fit(loss_fn, params, batch, budget=0.5)       # doctest: +SKIP
    >>> loss, grads = step(params, batch); print(step.plan)             # doctest: +SKIP
    >>> step.verify(params, other_batch).bitwise                        # doctest: +SKIP

See docs/jax.md for what is supported and the measured numbers.
"""

from __future__ import annotations

from memfit.jax.fit import PlannedStep, fit, plain_step
from memfit.jax.profiler import profile
from memfit.jax.verify import Verification

__all__ = ["profile", "fit", "PlannedStep", "plain_step", "Verification"]
