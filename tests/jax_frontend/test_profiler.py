"""memfit.jax.profiler: a JAX step as a memfit Profile that planning reads unchanged."""

import jax
import pytest

from memfit.jax.profiler import profile
from memfit.planning.plan import Plan
from memfit.planning.simulate import simulate
from memfit.profiling.profile import Phase, Profile, StorageKind

from .models_tiny import MODELS


@pytest.fixture(scope="module", params=list(MODELS))
def case(request):
    loss_fn, params, batch, aux = MODELS[request.param]()
    return loss_fn, params, batch, aux, profile(loss_fn, params, batch, has_aux=aux, model=request.param)


def test_empty_plan_simulates_to_the_profiled_timeline(case):
    *_, prof = case
    sim = simulate(prof, Plan((), 0, 0.0, None, "none", ""))
    assert sim.peak_bytes == prof.peak_bytes == max(prof.live_bytes)
    assert sim.live_bytes == prof.live_bytes


def test_forward_then_backward_and_gradients_never_freed(case):
    loss_fn, params, *_ , prof = case
    assert all(op.phase is Phase.FORWARD for op in prof.ops[: prof.n_forward])
    assert all(op.phase is Phase.BACKWARD for op in prof.ops[prof.n_forward:])
    kept = [s for s in prof.storages if s.created_by is not None and s.freed_after is None]
    grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    # the step's outputs: the loss (4 bytes), the aux (BatchNorm statistics) and the gradients
    assert sum(s.nbytes for s in kept if s.kind is StorageKind.GRADIENT) >= grad_bytes - 4
    assert sum(p.nbytes for p in prof.parameters) == grad_bytes


def test_scopes_are_module_paths(case):
    *_, prof = case
    paths = {m.path for m in prof.modules}
    assert {"GPT.blocks_0", "GPT.blocks_3.attn.qkv"} <= paths or {"ConvNet3D.stage_0.conv0"} <= paths
    for m in prof.modules:
        if m.path and m.calls == 1:
            assert all(prof.ops[i].module.startswith(m.path)
                       for i in range(m.first_op, m.last_op + 1))


def test_json_round_trip(case):
    *_, prof = case
    again = Profile.from_dict(prof.to_dict())
    assert again == prof
    assert [o.saveable for o in again.ops] == [o.saveable for o in prof.ops]
