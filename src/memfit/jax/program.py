"""The user's loss function as a jaxpr, and an interpreter that reruns it with regions.

NOTE [the primal program]
    ``loss_fn(params, batch)`` is traced once to a jaxpr (``jax.make_jaxpr``), the *primal
    program*: its top-level equations, each with a scope (NOTE [scopes] in
    ``memfit.jax.trace``). Both the profile and the planned step evaluate this program, not
    ``loss_fn`` again:
    1. the profile evaluates it with every array output of equation ``k`` tagged
       ``checkpoint_name(..., "memfit:k:j")`` and traces ``value_and_grad`` of that, so that
       each forward value of the step that a plan may save has a name (a value with no tag
       is made by JAX's differentiation rules, ``1 - tanh(x)**2``, and is never saved);
    2. the planned step evaluates it with each region's equations inside one
       ``jax.checkpoint`` whose policy is ``save_only_these_names`` of the tags of the ops
       the plan saves there (``nothing_saveable`` if none), and no tags elsewhere.
    Equations run by ``primitive.bind`` with their own parameters, in their order, under
    their own scope (``jax.named_scope`` per name), so the program computes what ``loss_fn``
    computes, op for op; the plain step of the comparison is ``jax.value_and_grad(loss_fn)``
    itself.

NOTE [barriers kept on XLA CPU]
    ``jax.checkpoint`` keeps its recompute apart from the forward with optimization barriers
    (``prevent_cse``). XLA's CPU pipeline removes them (its ``cse_barrier_expander`` pass)
    before a later common-subexpression elimination, which then merges the recompute into the
    forward: the backward reads forward values held from forward to backward, on top of the
    residuals, and the checkpoint saves nothing. Measured (jax 0.10.2, CPU): 16 blocks
    ``tanh(tanh(x @ w) @ w.T)``, x 512x256 fp32: plain 17,301,504 B of XLA temp bytes,
    ``nothing_saveable`` on every block 25,165,824 B (more). Compiled with that pass disabled
    (``KEEP_BARRIERS``, a per-compile XLA option: ``jax.jit(..., compiler_options=...)``) the
    barriers stay, the recompute runs in backward: 9,438,208 B, gradients bitwise plain's.
    memfit's planned step compiles so on the CPU backend (``memfit.jax.fit(keep_barriers=)``);
    JAX's own policies measured the same way in benchmarks/jax_policies.py. Other backends
    (GPU, TPU) keep the barriers until late in their own pipelines and are compiled as JAX
    compiles them (not measured here: no GPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from memfit.jax.trace import scope_of

__all__ = ["Program", "RegionSpec", "trace_program", "tag", "KEEP_BARRIERS"]


def tag(k: int, j: int) -> str:
    """The name of output ``j`` of primal equation ``k`` (NOTE [the primal program])."""
    return f"memfit:{k}:{j}"


@dataclass
class RegionSpec:
    """Primal equations ``start..end`` run under one ``jax.checkpoint`` saving ``saved``."""

    start: int
    end: int
    saved: frozenset[str] = frozenset()
    inner: list[RegionSpec] = field(default_factory=list)
    policy: Any = None  # a JAX policy used instead of the saved names (benchmarks of JAX's own)


@dataclass
class Program:
    """The primal program of ``loss_fn`` (NOTE [the primal program])."""

    closed: Any                      # jax ClosedJaxpr
    in_tree: Any                     # treedef of (params, batch)
    n_params: int                    # leading flat inputs that are parameters
    out_tree: Any                    # treedef of loss_fn's output
    scopes: list[str]                # per top-level equation
    last_use: dict[Any, int]         # var -> last equation reading it (outputs: len(eqns))

    @property
    def eqns(self) -> list[Any]:
        return list(self.closed.jaxpr.eqns)

    def run(self, flat: Sequence[Any], regions: Sequence[RegionSpec] = (), *,
            tag_all: bool = False) -> list[Any]:
        """Evaluate the program on flat inputs; ``regions`` (top level, sorted, disjoint)
        run under ``jax.checkpoint``; ``tag_all`` tags every array output."""
        jaxpr = self.closed.jaxpr
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, self.closed.consts, strict=True))
        env.update(zip(jaxpr.invars, flat, strict=True))
        self._run(0, len(jaxpr.eqns) - 1, env, list(regions), frozenset(), tag_all)
        return [_read(env, v) for v in jaxpr.outvars]

    def _run(self, lo: int, hi: int, env: dict[Any, Any], regions: list[RegionSpec],
             saved: frozenset[str], tag_all: bool) -> None:
        eqns = self.closed.jaxpr.eqns
        by_start = {r.start: r for r in regions}
        k = lo
        while k <= hi:
            r = by_start.get(k)
            if r is not None:
                self._region(r, env, tag_all)
                k = r.end + 1
                continue
            eqn = eqns[k]
            params = eqn.primitive.get_bind_params(eqn.params)
            with _scope(self.scopes[k]), eqn.ctx.manager:
                outs = eqn.primitive.bind(*(_read(env, v) for v in eqn.invars), **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for j, (v, val) in enumerate(zip(eqn.outvars, outs, strict=True)):
                name = tag(k, j)
                if (tag_all or name in saved) and hasattr(val, "shape"):
                    val = checkpoint_name(val, name)
                env[v] = val
            k += 1

    def _region(self, r: RegionSpec, env: dict[Any, Any], tag_all: bool) -> None:
        ins, outs = self.region_io(r.start, r.end)

        def body(*vals: Any) -> list[Any]:
            local = dict(zip(ins, vals, strict=True))
            local.update({v: env[v] for v in self.closed.jaxpr.constvars})
            self._run(r.start, r.end, local, r.inner, r.saved, tag_all)
            return [local[v] for v in outs]

        policy = r.policy or (jax.checkpoint_policies.save_only_these_names(*sorted(r.saved))
                              if r.saved else jax.checkpoint_policies.nothing_saveable)
        results = jax.checkpoint(body, policy=policy, prevent_cse=True)(*(env[v] for v in ins))
        env.update(zip(outs, results, strict=True))

    def region_io(self, start: int, end: int) -> tuple[list[Any], list[Any]]:
        """The variables equations ``start..end`` read from before them, and those they
        define that are read after them (or are outputs of the program)."""
        eqns = self.closed.jaxpr.eqns
        defined: set[Any] = set()
        consts = set(self.closed.jaxpr.constvars)
        ins: list[Any] = []
        outs: list[Any] = []
        for eqn in eqns[start: end + 1]:
            for v in eqn.invars:
                if not _is_literal(v) and v not in defined and v not in consts and v not in ins:
                    ins.append(v)
            defined.update(eqn.outvars)
        for eqn in eqns[start: end + 1]:
            for v in eqn.outvars:
                if self.last_use.get(v, -1) > end and v not in outs:
                    outs.append(v)
        return ins, outs


def trace_program(loss_fn: Callable[..., Any], params: Any, batch: Any) -> Program:
    """Trace ``loss_fn(params, batch)`` to its primal program."""
    flat, in_tree = jax.tree_util.tree_flatten((params, batch))
    n_params = len(jax.tree_util.tree_leaves(params))
    out_tree_box: list[Any] = []

    def flat_fn(*xs: Any) -> list[Any]:
        p, b = jax.tree_util.tree_unflatten(in_tree, xs)
        out = loss_fn(p, b)
        leaves, tree = jax.tree_util.tree_flatten(out)
        out_tree_box.append(tree)
        return leaves

    closed = jax.make_jaxpr(flat_fn)(*flat)
    jaxpr = closed.jaxpr
    last_use: dict[Any, int] = {}
    for k, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not _is_literal(v):
                last_use[v] = k
    for v in jaxpr.outvars:
        if not _is_literal(v):
            last_use[v] = len(jaxpr.eqns)
    scopes = [scope_of(str(e.source_info.name_stack)) for e in jaxpr.eqns]
    return Program(closed, in_tree, n_params, out_tree_box[-1], scopes, last_use)


# the XLA option that keeps jax.checkpoint's barriers on the CPU backend (NOTE [barriers kept
# on XLA CPU])
KEEP_BARRIERS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def _is_literal(v: Any) -> bool:
    return type(v).__name__ == "Literal"


def _read(env: dict[Any, Any], v: Any) -> Any:
    return v.val if _is_literal(v) else env[v]


@contextlib.contextmanager
def _scope(scope: str) -> Any:
    with contextlib.ExitStack() as stack:
        for part in scope.split(".") if scope else ():
            stack.enter_context(jax.named_scope(part))
        yield
