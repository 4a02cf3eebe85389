"""FLOPs and bytes of one jaxpr equation, counted as XLA's cost analysis counts them.

NOTE [FLOPs of an equation]
    ``dot_general``: 2 x output elements x contracted size; ``conv_general_dilated``: 2 x
    batch x output features x input features per group x the (output, kernel) position
    pairs of each spatial dimension that fall inside the input (taps on padding are not
    counted, as XLA does not count them). Elementwise arithmetic and
    comparisons count one FLOP per output element, a reduction one per input element,
    ``integer_pow`` ``|y| - 1`` multiplies per element; transcendental functions (``exp``,
    ``tanh``, ``rsqrt``, ``erf``, ...) count 0 here, since XLA reports them apart
    (``transcendentals``). Data movement (reshape, broadcast, transpose, slicing, select,
    convert) counts 0.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["eqn_flops", "aval_bytes", "ELEMENTWISE_FLOP", "REDUCTIONS"]

ELEMENTWISE_FLOP = frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "neg", "max", "min", "abs", "sign",
    "eq", "ne", "lt", "le", "gt", "ge", "square", "floor", "ceil", "round", "clamp", "nextafter",
    "and", "or", "not", "xor",
})
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin",
                        "reduce_and", "reduce_or"})


def aval_bytes(aval: Any) -> int:
    """Bytes of an abstract array value (0 for a token or other non-array)."""
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    return int(math.prod(shape)) * int(dtype.itemsize)


def _elements(aval: Any) -> int:
    return int(math.prod(getattr(aval, "shape", ())))


def eqn_flops(primitive: str, in_avals: tuple[Any, ...], out_avals: tuple[Any, ...],
              params: dict[str, Any]) -> int:
    """FLOPs of one equation (NOTE [FLOPs of an equation]).

    Example:
        >>> import jax.numpy as jnp, jax
        >>> a = jax.core.ShapedArray((4, 8), jnp.float32)
        >>> b = jax.core.ShapedArray((8, 2), jnp.float32)
        >>> o = jax.core.ShapedArray((4, 2), jnp.float32)
        >>> eqn_flops("dot_general", (a, b), (o,), {"dimension_numbers": (((1,), (0,)), ((), ()))})
        128
    """
    if not out_avals:
        return 0
    out = out_avals[0]
    if primitive == "dot_general":
        (lc, _), _ = params["dimension_numbers"]
        contracted = math.prod(in_avals[0].shape[d] for d in lc)
        return 2 * _elements(out) * int(contracted)
    if primitive == "conv_general_dilated":
        return _conv_flops(in_avals[0], in_avals[1], out, params)
    if primitive in ELEMENTWISE_FLOP:
        return _elements(out)
    if primitive == "integer_pow":
        return _elements(out) * max(abs(int(params["y"])) - 1, 0)
    if primitive in REDUCTIONS:
        return _elements(in_avals[0]) if in_avals else 0
    return 0


def _conv_flops(lhs: Any, rhs: Any, out: Any, params: dict[str, Any]) -> int:
    """NOTE [FLOPs of an equation] for a convolution."""
    dn = params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    n_spatial = len(lhs_spec) - 2
    lhs_dil = params.get("lhs_dilation") or (1,) * n_spatial
    rhs_dil = params.get("rhs_dilation") or (1,) * n_spatial
    strides = params.get("window_strides") or (1,) * n_spatial
    taps = 1
    for d in range(n_spatial):
        size = (lhs.shape[lhs_spec[2 + d]] - 1) * lhs_dil[d] + 1
        k = rhs.shape[rhs_spec[2 + d]]
        n_out = out.shape[out_spec[2 + d]]
        lo = params["padding"][d][0]
        valid = 0
        for o in range(n_out):
            for j in range(k):
                pos = o * strides[d] - lo + j * rhs_dil[d]
                if 0 <= pos < size and pos % lhs_dil[d] == 0:
                    valid += 1
        taps *= valid
    batch = out.shape[out_spec[0]]
    out_features = out.shape[out_spec[1]]
    in_per_group = rhs.shape[rhs_spec[1]]
    groups = max(int(params.get("batch_group_count", 1)), 1)
    return 2 * int(batch) * int(out_features) * int(in_per_group) * taps // groups
