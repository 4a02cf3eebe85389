"""memfit.jax.trace: scopes and the flattened jaxpr (calls inlined, tags read)."""

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

from memfit.jax.trace import flatten, scope_of


@pytest.mark.parametrize("stack,scope", [
    ("transpose(jvp(GPT))/blocks_0/mlp", "GPT.blocks_0.mlp"),
    ("jvp(M)/blocks_1/LayerNorm_0", "M.blocks_1.LayerNorm_0"),
    ("", ""),
    ("transpose(jvp())", ""),
], ids=["backward", "forward", "empty", "root-backward"])
def test_scope_of_strips_transformations(stack, scope):
    assert scope_of(stack) == scope


def test_flatten_inlines_calls_and_aliases_names():
    @jax.jit
    def inner(x):
        return jnp.sin(x) * 2.0

    def f(x):
        with jax.named_scope("blk"):
            y = checkpoint_name(inner(x), "y")
        return jnp.sum(y * y)

    fj = flatten(jax.make_jaxpr(f)(jnp.ones((3, 4))))
    assert [e.primitive for e in fj.eqns] == ["sin", "mul", "mul", "reduce_sum"]
    assert [e.scope for e in fj.eqns] == ["blk", "blk", "", ""]
    # the tag names the value the jitted call returned: the inner mul's output
    (key,) = fj.eqns[1].outputs
    assert fj.tags == {key: ["y"]}
    assert fj.eqns[2].inputs == (key, key)
    assert fj.avals[key].shape == (3, 4)
