"""PlannedStep: a memfit plan run as a jitted JAX step, its regions under jax.checkpoint.

NOTE [a plan as a JAX policy]
    A plan's region (one scope, or consecutive sibling scopes: a segment) is the run of
    primal equations from the first one in its first scope to the last one in its last scope
    (NOTE [the primal program] in ``memfit.jax.program``); the planned step runs that run
    inside one ``jax.checkpoint``. Its policy is ``save_only_these_names`` of the tags of the
    ops the plan saves there (``OpPolicy.SAVE``), ``nothing_saveable`` when it saves none:
    everything else the region's backward needs is recomputed from its inputs. A region
    nested in another (NOTE [nested regions] in ``memfit.planning.nesting``) is a
    ``jax.checkpoint`` inside the outer one's. ``OpPolicy.OFFLOAD`` is refused: on the JAX CPU
    backend host memory is device memory (jax 0.10.2 lists ``pinned_host``, but a
    ``save_and_offload_only_these_names`` policy compiles to the peak of saving, 0 host bytes
    in ``memory_analysis()``), so nothing measures an offload (``fit(offload=True)`` raises). On the CPU
    backend the step compiles with jax.checkpoint's barriers kept (NOTE [barriers kept on XLA
    CPU] in ``memfit.jax.program``): without them XLA merges the recompute into the forward
    and the plan saves no memory there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from memfit.jax.program import KEEP_BARRIERS, Program, RegionSpec
from memfit.jax.verify import Reference, Verification
from memfit.planning.effects import resolve_span
from memfit.planning.plan import OpPolicy, Plan
from memfit.planning.rules import op_keys
from memfit.profiling.profile import Profile

__all__ = ["PlannedStep", "plain_step", "region_specs"]


class PlannedStep:
    """A jitted training step that runs a memfit plan: ``loss, grads = step(params, batch)``.

    Attributes:
        plan: the memfit ``Plan`` (``predicted_peak_bytes``, ``budget_bytes``, regions).
        profile: the ``Profile`` it was planned from.
        has_aux: ``loss_fn`` returns ``(loss, aux)``; the step then returns
            ``((loss, aux), grads)`` as ``jax.value_and_grad(..., has_aux=True)`` does.
        keep_barriers: compiled with jax.checkpoint's barriers kept (NOTE [barriers kept on
            XLA CPU]).
        xla_peak_bytes: XLA's reported peak of the compiled step where ``fit`` measured it
            (NOTE [budgets checked against XLA]), else None.
        xla_flops: XLA's FLOPs of the compiled step (``cost_analysis()``), where measured.
        verification: its outputs against the plain step's on the batch ``fit`` was given
            (NOTE [JAX plans verified on the batch] in ``memfit.jax.verify``), where run.
    """

    def __init__(self, program: Program, plan: Plan, profile: Profile, *, has_aux: bool,
                 keep_barriers: bool = False, loss_fn: Callable[..., Any] | None = None) -> None:
        self.program = program
        self.plan = plan
        self.profile = profile
        self.has_aux = has_aux
        self.keep_barriers = keep_barriers
        self.xla_peak_bytes: int | None = None
        self.xla_flops: int | None = None
        self.verification: Verification | None = None
        self.loss_fn = loss_fn
        self.regions = region_specs(program, plan, profile)
        self._jitted = jax.jit(self._step, compiler_options=KEEP_BARRIERS if keep_barriers else None)

    def _step(self, params: Any, batch: Any) -> Any:
        p_leaves, p_tree = jax.tree_util.tree_flatten(params)
        b_leaves = jax.tree_util.tree_leaves(batch)

        def loss(pl: list[Any]) -> Any:
            outs = self.program.run([*pl, *b_leaves], self.regions)
            if not self.has_aux:
                return outs[0]
            tree = self.program.out_tree
            loss_val, aux = jax.tree_util.tree_unflatten(tree, outs)
            return loss_val, aux

        value, grads = jax.value_and_grad(loss, has_aux=self.has_aux)(p_leaves)
        return value, jax.tree_util.tree_unflatten(p_tree, grads)

    def __call__(self, params: Any, batch: Any) -> Any:
        return self._jitted(params, batch)

    def verify(self, params: Any, batch: Any) -> Verification:
        """Run this step and the plain ``jax.value_and_grad(loss_fn)`` step on ``params`` and
        ``batch``; compare every output leaf bit for bit.

        Example:
            >>> step.verify(params, next_batch).bitwise                 # doctest: +SKIP
            True
        """
        if self.loss_fn is None:
            raise ValueError("this step was built without its loss_fn, so there is no plain step to "
                             "compare with; build it with memfit.jax.fit")
        return Reference(self.loss_fn, params, batch, has_aux=self.has_aux).check(self)

    def lower(self, params: Any, batch: Any) -> Any:
        """``jax.jit(...).lower``: for ``compile().memory_analysis()`` and ``cost_analysis()``."""
        return self._jitted.lower(params, batch)


def plain_step(loss_fn: Callable[..., Any], *, has_aux: bool = False) -> Any:
    """The step without a plan: ``jax.jit(jax.value_and_grad(loss_fn))`` (the reference)."""
    return jax.jit(jax.value_and_grad(loss_fn, has_aux=has_aux))


def region_specs(program: Program, plan: Plan, profile: Profile) -> list[RegionSpec]:
    """The plan's regions as primal equation runs with the tags they save (NOTE [a plan as a
    JAX policy]), nested as the plan nests them."""
    tags = profile.extra.get("tags", {})
    flat: list[RegionSpec] = []
    for r in plan.regions:
        if r.keys_with(OpPolicy.OFFLOAD):
            raise ValueError(f"region {r.name} offloads, which memfit.jax cannot do yet (on the JAX "
                             "CPU backend host memory is device memory); plan without offload")
        start, end = _primal_range(program, r.modules)
        span = resolve_span(profile, r.modules)
        by_key = {k: i for i, k in op_keys(profile, span.first_op, span.last_op).items()}
        saved: set[str] = set()
        for key in r.save:
            op = profile.ops[by_key[key]]
            for t in op.outputs:
                saved.update(n for n in tags.get(str(t.storage), ())
                             if start <= int(n.split(":")[1]) <= end)
        flat.append(RegionSpec(start, end, frozenset(saved)))
    flat.sort(key=lambda s: (s.start, -s.end))
    top: list[RegionSpec] = []
    for s in flat:  # into the innermost region that contains it (NOTE [regions nested deeper])
        level = top
        while (outer := next((t for t in reversed(level) if t.start <= s.start and s.end <= t.end), None)):
            level = outer.inner
        level.append(s)
    return top


def _primal_range(program: Program, modules: tuple[str, ...]) -> tuple[int, int]:
    def under(scope: str, m: str) -> bool:
        return m == "" or scope == m or scope.startswith(m + ".")

    first = [k for k, s in enumerate(program.scopes) if under(s, modules[0])]
    last = [k for k, s in enumerate(program.scopes) if under(s, modules[-1])]
    if not first or not last:
        raise ValueError(f"region {modules} names scopes the traced loss_fn does not have; was the "
                         "plan made for another model?")
    return min(first), max(last)
