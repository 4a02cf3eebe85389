"""A jaxpr as a flat list of equations over values: calls inlined, scopes read, tags found.

NOTE [jaxpr values as storages]
    memfit's memory model counts storages (``memfit.profiling.profile``); a jaxpr has values,
    each an immutable array. The flattening below gives every value one *key* (a storage id):
    1. the jaxpr's inputs (parameters, batch, constants) first, in order;
    2. then each output of each equation, in equation order;
    3. a call (``jit``, ``closed_call``, ``custom_jvp_call``, ``checkpoint``, ...) is inlined:
       its inner inputs are the outer keys, its outer outputs the inner keys (no new value);
    4. ``checkpoint_name`` (the ``name`` primitive) is an identity: its output is its input's
       key, and its ``name`` is recorded as a *tag* of that key;
    5. literals are no values (nothing is allocated for them).
    XLA may alias or fuse what the jaxpr keeps apart (a reshape, an elementwise chain): the
    jaxpr-level memory is an upper bound of what buffer assignment needs for the same
    schedule, not its exact value (docs/jax.md states the measured gap per model).

NOTE [scopes]
    An equation's scope is its name stack (Flax Linen's module path, ``jax.named_scope``)
    with the transformation wrappers removed: ``transpose(jvp(GPT))/blocks_0/mlp`` is
    ``GPT.blocks_0.mlp``, the path memfit's module records use (dots between names). An
    equation of a backward pass has ``transpose(`` in its name stack; the forward of
    ``value_and_grad`` comes first in its jaxpr, then the backward.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FlatEqn", "FlatJaxpr", "flatten", "scope_of", "CALL_JAXPR_PARAMS"]

# Primitives whose inner jaxpr is inlined, and the parameter holding it (NOTE [jaxpr values
# as storages], rule 3).
CALL_JAXPR_PARAMS = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr",
}
_WRAPPER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\(")


def scope_of(name_stack: str) -> str:
    """The dotted scope of a name stack (NOTE [scopes]).

    Example:
        >>> scope_of("transpose(jvp(GPT))/blocks_0/mlp")
        'GPT.blocks_0.mlp'
    """
    plain = _WRAPPER.sub("", name_stack).replace(")", "")
    return ".".join(p for p in plain.split("/") if p)


@dataclass(frozen=True)
class FlatEqn:
    """One equation of the flattened jaxpr: its primitive, the keys it reads and writes."""

    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    scope: str
    backward: bool
    params: dict[str, Any] = field(repr=False, compare=False)
    in_avals: tuple[Any, ...] = field(repr=False, compare=False, default=())


@dataclass
class FlatJaxpr:
    """A jaxpr flattened (NOTE [jaxpr values as storages]).

    ``avals[k]`` is value ``k``'s abstract value; ``n_inputs`` values are the jaxpr's inputs
    (``input_keys``, in order), then its constants; ``output_keys`` are its outputs (None: a
    literal); ``tags[k]`` the ``checkpoint_name`` names of value ``k``.
    """

    eqns: list[FlatEqn]
    avals: list[Any]
    input_keys: list[int]
    const_keys: list[int]
    output_keys: list[int | None]
    tags: dict[int, list[str]]


def flatten(closed: Any) -> FlatJaxpr:
    """Flatten a ``ClosedJaxpr`` (from ``jax.make_jaxpr``) into keyed equations."""
    out = FlatJaxpr([], [], [], [], [], {})
    env: dict[Any, int] = {}
    for v in closed.jaxpr.invars:
        env[v] = _new(out, v.aval)
        out.input_keys.append(env[v])
    for v in closed.jaxpr.constvars:
        env[v] = _new(out, v.aval)
        out.const_keys.append(env[v])
    _walk(closed.jaxpr, env, "", out)
    out.output_keys = [_read(env, v) for v in closed.jaxpr.outvars]
    return out


def _new(out: FlatJaxpr, aval: Any) -> int:
    out.avals.append(aval)
    return len(out.avals) - 1


def _read(env: dict[Any, int], v: Any) -> int | None:
    if _is_literal(v):
        return None
    return env[v]


def _is_literal(v: Any) -> bool:
    return type(v).__name__ == "Literal"


def _walk(jaxpr: Any, env: dict[Any, int], prefix: str, out: FlatJaxpr) -> None:
    for eqn in jaxpr.eqns:
        stack = str(eqn.source_info.name_stack)
        full = f"{prefix}/{stack}" if prefix and stack else (prefix or stack)
        name = eqn.primitive.name
        ins = [_read(env, v) for v in eqn.invars]
        inner_param = CALL_JAXPR_PARAMS.get(name)
        if inner_param is not None and inner_param in eqn.params:
            inner = eqn.params[inner_param]
            ij = inner.jaxpr if hasattr(inner, "jaxpr") else inner
            consts = getattr(inner, "consts", ())
            sub: dict[Any, int] = {}
            for v in ij.constvars[: len(consts)]:
                sub[v] = _new(out, v.aval)
                out.const_keys.append(sub[v])
            for v, k in zip(ij.invars, ins, strict=True):
                if k is None:  # a literal passed in: a value made for the call
                    k = _new(out, v.aval)
                sub[v] = k
            _walk(ij, sub, full, out)
            for v, iv in zip(eqn.outvars, ij.outvars, strict=True):
                k = _read(sub, iv)
                env[v] = k if k is not None else _new(out, v.aval)
            continue
        if name == "name":  # checkpoint_name: an identity that tags its input (rule 4)
            (k,) = ins
            if k is None:
                k = _new(out, eqn.outvars[0].aval)
            out.tags.setdefault(k, []).append(str(eqn.params["name"]))
            env[eqn.outvars[0]] = k
            continue
        keys = []
        for v in eqn.outvars:
            k = _new(out, v.aval)
            env[v] = k
            keys.append(k)
        out.eqns.append(FlatEqn(name, tuple(k for k in ins if k is not None), tuple(keys),
                                scope_of(full), "transpose(" in full, dict(eqn.params),
                                tuple(v.aval for v in eqn.invars)))
