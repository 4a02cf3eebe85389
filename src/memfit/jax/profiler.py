"""profile: one JAX training step (``value_and_grad`` of a loss) as a memfit Profile.

NOTE [a jaxpr as a Profile]
    The step is the jaxpr of ``jax.value_and_grad`` of the primal program with every value
    tagged (NOTE [the primal program] in ``memfit.jax.program``), flattened (NOTE [jaxpr
    values as storages] in ``memfit.jax.trace``). Then, in memfit's terms:
    1. an op is an equation, in jaxpr order: the forward first (``n_forward`` equations),
       then the backward (``transpose(`` in the name stack); its module is its scope;
    2. a storage is a value: created by its equation, freed after its last reader, never
       freed if it is an output of the step (the loss, the gradients); parameters, batch and
       constants are live before the step and not counted;
    3. a forward value read by the backward is *saved* (a residual: what
       ``jax.ad_checkpoint.saved_residuals`` lists). Its saves are attributed per scope of
       the backward equations that read it: to the last forward reader in that scope (a
       block's output, read by the next block's norm, is that norm's residual, so
       checkpointing the block that made it keeps it), else to its creator;
    4. a module is a scope; its op range is that of its forward equations, ``calls`` the
       number of separate runs of them; a scope with two or more children is typed
       ``"Sequential"``, so the chain solver tries its children as blocks (a jaxpr has no
       module types; the solver checks that each block feeds the next);
    5. only an op whose outputs carry a tag may be saved (``OpRecord.saveable``): the
       runtime names what it saves with those tags; and of those, only one XLA does not
       fuse (rule 6);
    6. times are those of a compiled XLA step (NOTE [XLA's costs] in
       ``memfit.jax.xla_costs``): the CPU roofline of ``memfit.timemodel.devices`` over the
       FLOPs of NOTE [FLOPs of an equation] (in ``memfit.jax.flops``) and the bytes read and
       written for an equation XLA does not fuse, its FLOPs alone for one it fuses; the
       profile's calibration has no fixed charges. A region may save only unfused outputs,
       and no region has an input read after it (NOTE [inputs read after a region]);
       ``extra["unbatched_dots"]`` lists the dots ``dots_with_no_batch_dims_saveable`` saves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from memfit.jax.flops import aval_bytes, eqn_flops
from memfit.jax.program import Program, trace_program
from memfit.jax.trace import FlatJaxpr, flatten
from memfit.jax.xla_costs import CALIBRATION, rerun_time_s, saveable, unbatched_dot
from memfit.planning.arrays import ProfileArrays
from memfit.planning.nesting import OP_RUNS
from memfit.planning.rules import CLOSED_REGIONS
from memfit.profiling.profile import (
    ModuleRecord,
    OpRecord,
    ParameterRecord,
    Phase,
    Profile,
    StorageKind,
    StorageRecord,
    TensorMeta,
    op_signature,
)
from memfit.timemodel.devices import PRESETS

__all__ = ["profile", "profile_program", "grad_jaxpr"]


def profile(loss_fn: Callable[..., Any], params: Any, batch: Any, *, has_aux: bool = False,
            model: str = "") -> Profile:
    """Profile one JAX training step: ``jax.value_and_grad(loss_fn)(params, batch)``.

    Nothing runs: the step is traced to a jaxpr (NOTE [a jaxpr as a Profile]).

    Args:
        loss_fn: ``loss_fn(params, batch) -> loss`` (a scalar), or ``(loss, aux)`` with
            ``has_aux=True``.
        params: the pytree of arrays to differentiate (float leaves).
        batch: the pytree of inputs.
        has_aux: ``loss_fn`` returns ``(loss, aux)`` (default False).
        model: a name for reports (default ``""``).

    Returns:
        A :class:`memfit.Profile`: ``memfit.plan``, ``memfit.simulate`` and the solvers read
        it as they read a torch step's.

    Example:
        >>> prof = memfit.jax.profile(loss_fn, params, batch)     # doctest: +SKIP
        >>> prof.peak_bytes, prof.saved_bytes                    # doctest: +SKIP
    """
    return profile_program(trace_program(loss_fn, params, batch), has_aux=has_aux, model=model)


def grad_jaxpr(program: Program, *, has_aux: bool = False) -> Any:
    """The jaxpr of ``value_and_grad`` of the program with every value tagged."""
    n = program.n_params

    def loss(p_leaves: list[Any], b_leaves: list[Any]) -> Any:
        outs = program.run([*p_leaves, *b_leaves], tag_all=True)
        if has_aux:
            return outs[0], outs[1:]
        return outs[0]

    flat = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in program.closed.jaxpr.invars]
    return jax.make_jaxpr(jax.value_and_grad(loss, has_aux=has_aux))(flat[:n], flat[n:])


def profile_program(program: Program, *, has_aux: bool = False, model: str = "") -> Profile:
    """The Profile of a traced program (NOTE [a jaxpr as a Profile])."""
    flat = flatten(grad_jaxpr(program, has_aux=has_aux))
    out = _build(flat, program, model)
    if out.n_forward == 0 or out.n_forward == len(out.ops):
        raise ValueError("the traced step has no backward equations; does loss_fn depend on params?")
    return out


def _build(fj: FlatJaxpr, program: Program, model: str) -> Profile:
    eqns = fj.eqns
    n = len(eqns)
    n_forward = next((i for i, e in enumerate(eqns) if e.backward), n)
    n_keys = len(fj.avals)
    creator: list[int | None] = [None] * n_keys
    readers: list[list[int]] = [[] for _ in range(n_keys)]
    for i, e in enumerate(eqns):
        for k in e.outputs:
            creator[k] = i
        for k in set(e.inputs):
            readers[k].append(i)
    final = {k for k in fj.output_keys if k is not None}
    nbytes = [aval_bytes(a) for a in fj.avals]
    input_kinds = {k: (StorageKind.PARAMETER if pos < program.n_params else StorageKind.INPUT)
                   for pos, k in enumerate(fj.input_keys)}
    storages = []
    for k in range(n_keys):
        c = creator[k]
        rs = readers[k]
        if c is None:
            storages.append(StorageRecord(k, nbytes[k], input_kinds.get(k, StorageKind.OTHER)))
            continue
        fwd_reads = [i for i in rs if i < n_forward]
        bwd_reads = [i for i in rs if i >= n_forward]
        saved = c < n_forward and bool(bwd_reads)
        storages.append(StorageRecord(
            id=k, nbytes=nbytes[k],
            kind=StorageKind.ACTIVATION if c < n_forward else StorageKind.GRADIENT,
            created_by=c,
            freed_after=None if k in final else max([c, *rs]),
            saved=saved,
            first_unpack=min(bwd_reads) if saved else None,
            last_forward_use=max([c, *fwd_reads]) if c < n_forward else None,
            saves=_saves(eqns, c, fwd_reads, bwd_reads) if saved else (),
        ))
    tagged = {k for k in fj.tags}
    preset = PRESETS["cpu"]
    ops = []
    for i, e in enumerate(eqns):
        out_avals = tuple(fj.avals[k] for k in e.outputs)
        flops = eqn_flops(e.primitive, e.in_avals, out_avals, e.params)
        moved = sum(nbytes[k] for k in e.inputs) + sum(nbytes[k] for k in e.outputs)
        dtype = str(getattr(out_avals[0], "dtype", "float32")) if out_avals else "float32"
        ops.append(OpRecord(
            index=i, name=e.primitive, module=e.scope,
            phase=Phase.BACKWARD if i >= n_forward else Phase.FORWARD,
            inputs=tuple(sorted(set(e.inputs))),
            outputs=tuple(TensorMeta(k, tuple(int(d) for d in getattr(fj.avals[k], "shape", ())),
                                     str(getattr(fj.avals[k], "dtype", ""))) for k in e.outputs),
            time_s=rerun_time_s(e.primitive, flops, moved, dtype, preset),
            flops=flops,
            saveable=(i < n_forward and bool(e.outputs) and all(k in tagged for k in e.outputs)
                      and saveable(e.primitive)),
        ))
    modules = _modules(ops[:n_forward], storages)
    params = [v.aval for v in program.closed.jaxpr.invars[: program.n_params]]
    names = _leaf_names(program)
    prof = Profile(
        ops=tuple(ops), storages=tuple(storages), modules=tuple(modules), n_forward=n_forward,
        live_bytes=(0,) * n, peak_bytes=0,
        baseline_bytes=sum(nbytes[k] for k in fj.input_keys + fj.const_keys),
        step_time_s=sum(o.time_s for o in ops), model=model, device="cpu", mode="jaxpr",
        cost_model="roofline cpu, fused elementwise", calibration=CALIBRATION, signature=op_signature(ops, n_forward),
        input_signature=tuple((names[program.n_params + j], tuple(v.aval.shape), str(v.aval.dtype))
                              for j, v in enumerate(program.closed.jaxpr.invars[program.n_params:])),
        parameters=tuple(ParameterRecord(names[j], tuple(a.shape), str(a.dtype), aval_bytes(a))
                         for j, a in enumerate(params)),
        extra={"frontend": "jax", OP_RUNS: True, "tags": {str(k): v for k, v in sorted(fj.tags.items())},
               CLOSED_REGIONS: True,  # NOTE [XLA's costs], rule 4
               "unbatched_dots": [i for i, e in enumerate(eqns[:n_forward]) if unbatched_dot(e.primitive, e.params)]},
    )
    live = ProfileArrays(prof).base_live
    live_bytes = tuple(int(x) for x in live)
    return dataclasses.replace(prof, live_bytes=live_bytes, peak_bytes=max(live_bytes, default=0))


def _saves(eqns: list[Any], creator: int, fwd_reads: list[int], bwd_reads: list[int]
           ) -> tuple[tuple[int, int | None, int | None], ...]:
    """NOTE [a jaxpr as a Profile], rule 3: one save per scope of the backward readers."""
    by_scope: dict[str, list[int]] = {}
    for i in bwd_reads:
        by_scope.setdefault(eqns[i].scope, []).append(i)
    out = []
    for scope, reads in by_scope.items():
        mine = [i for i in fwd_reads if eqns[i].scope == scope]
        op = max(mine) if mine else creator
        out.append((op, min(reads), max(reads)))
    # one entry per saving op: the first read and last release over its scopes
    merged: dict[int, tuple[int, int]] = {}
    for op, first, last in out:
        f0, l0 = merged.get(op, (first, last))
        merged[op] = (min(f0, first), max(l0, last))
    return tuple((op, f, r) for op, (f, r) in sorted(merged.items()))


def _modules(fwd: list[OpRecord], storages: list[StorageRecord]) -> list[ModuleRecord]:
    """NOTE [a jaxpr as a Profile], rule 4."""
    ops_of: dict[str, list[int]] = {"": [op.index for op in fwd]}
    for op in fwd:
        parts = op.module.split(".") if op.module else []
        for d in range(1, len(parts) + 1):
            ops_of.setdefault(".".join(parts[:d]), []).append(op.index)
    children: dict[str, list[str]] = {p: [] for p in ops_of}
    for p in ops_of:
        if p:
            children[p.rpartition(".")[0]].append(p)
    out = []
    for path, idx in ops_of.items():
        first, last = min(idx), max(idx)
        runs = 1 + sum(1 for a, b in zip(idx, idx[1:], strict=False) if b != a + 1)
        inside = set(range(first, last + 1))
        ins = sorted({s for i in idx for s in fwd[i].inputs
                      if storages[s].created_by is None or storages[s].created_by not in inside})
        outs = sorted({t.storage for i in idx for t in fwd[i].outputs
                       if (storages[t.storage].last_forward_use or 0) > last
                       or storages[t.storage].freed_after is None})
        kids = sorted(children[path], key=lambda c: min(ops_of[c]))
        out.append(ModuleRecord(
            path=path, type="Sequential" if len(kids) >= 2 else "Module",
            parent=None if path == "" else path.rpartition(".")[0], children=tuple(kids),
            first_op=first, last_op=last, calls=runs if path else 1,
            inputs=tuple(ins), outputs=tuple(outs)))
    return out


def _leaf_names(program: Program) -> list[str]:
    """``params['Dense_0']['kernel']``-style names of the flat inputs."""
    p, b = jax.tree_util.tree_unflatten(program.in_tree, list(range(len(program.closed.jaxpr.invars))))
    names = ["params" + jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(p)[0]]
    names += ["batch" + jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(b)[0]]
    return names


