"""memfit.jax.flops against XLA's own cost analysis of single ops."""

import jax
import jax.numpy as jnp
import pytest

from memfit.jax.flops import eqn_flops
from memfit.jax.trace import flatten


def _ours(f, *args):
    fj = flatten(jax.make_jaxpr(f)(*args))
    return sum(eqn_flops(e.primitive, e.in_avals, tuple(fj.avals[k] for k in e.outputs), e.params)
               for e in fj.eqns)


def _xla(f, *args):
    ca = jax.jit(f).lower(*args).compile().cost_analysis()
    return int((ca[0] if isinstance(ca, list) else ca)["flops"])


CASES = {
    "matmul": (lambda a, b: a @ b, (jnp.ones((16, 32)), jnp.ones((32, 8)))),
    "batched": (lambda a, b: jnp.einsum("bij,bjk->bik", a, b), (jnp.ones((3, 4, 5)), jnp.ones((3, 5, 6)))),
    "conv3d": (lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1, 1), "SAME",
                                                         dimension_numbers=("NDHWC", "DHWIO", "NDHWC")),
               (jnp.ones((2, 6, 6, 6, 3)), jnp.ones((3, 3, 3, 3, 5)))),
    "add": (lambda a, b: a + b, (jnp.ones((7, 9)), jnp.ones((7, 9)))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_flops_match_xla_cost_analysis(name):
    f, args = CASES[name]
    assert _ours(f, *args) == _xla(f, *args)
