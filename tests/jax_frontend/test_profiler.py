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


def test_xla_costs_fused_reruns_and_unfused_saves(case):
    """NOTE [XLA's costs]: no fixed charges; a fused equation reruns at its FLOPs alone; only
    unfused outputs may be saved; the unbatched dots listed are dot_generals."""
    from memfit.jax.xla_costs import UNFUSED
    from memfit.timemodel.devices import PRESETS, op_time_s

    *_, prof = case
    cal = prof.calibration
    assert (cal.region_s, cal.op_s, cal.selective_op_s) == (0.0, 0.0, 0.0)
    cpu = PRESETS["cpu"]
    heavy = [op for op in prof.ops if op.name in UNFUSED]
    fused = [op for op in prof.ops if op.name not in UNFUSED and op.flops > 0]
    assert heavy and fused
    for op in fused:
        assert op.time_s == op.flops / cpu.fp32_flops_per_s and not op.saveable
    for op in heavy:  # the roofline: at least its FLOPs at the peak, and an op's overhead
        assert op.time_s >= (op_time_s(op.flops, 0, "float32", cpu) if op.flops else 0.0)
    assert all(op.time_s > cpu.op_overhead_s for op in heavy if op.name == "dot_general")
    assert any(op.saveable for op in heavy)
    assert all(prof.ops[i].name == "dot_general" for i in prof.extra["unbatched_dots"])


def test_no_region_has_an_input_read_after_it(case):
    """NOTE [inputs read after a region]: a LayerNorm alone (its input read by the residual
    add after it) is no candidate; the whole block is."""
    from memfit.planning.candidates import PlanningContext
    from memfit.planning.rules import inputs_read_after

    *_, prof = case
    ctx = PlanningContext(prof)
    mods = {m.path: m for m in prof.modules}
    if "GPT.blocks_1.ln1" in mods:
        assert ctx.candidate(("GPT.blocks_1.ln1",)) is None
        assert ctx.candidate(("GPT.blocks_1.ln2",)) is None
        assert ctx.candidate(("GPT.blocks_1",)) is not None
    for c in ctx.region_candidates():
        assert not inputs_read_after(prof, c.a, c.b), c.modules
    closed = mods.get("GPT.blocks_1.ln1")
    if closed is not None:  # the rule is the profile's: a torch profile never sets it
        from dataclasses import replace

        from memfit.planning.rules import CLOSED_REGIONS
        opened = replace(prof, extra={**prof.extra, CLOSED_REGIONS: False})
        assert not inputs_read_after(opened, closed.first_op, closed.last_op)
        assert inputs_read_after(prof, closed.first_op, closed.last_op)


def test_a_refused_span_is_no_region_nor_inside_one(case):
    """NOTE [refused spans]: refusing a block's span removes it and every region around it
    (a segment over it); regions inside it stay candidates."""
    from memfit.planning.candidates import PlanningContext
    from memfit.planning.effects import resolve_span
    from memfit.planning.rules import REFUSED_SPANS, contains_refused_span, refusing

    *_, prof = case
    block = "GPT.blocks_1" if any(m.path == "GPT.blocks_1" for m in prof.modules) else "ConvNet3D.stage_1"
    span = resolve_span(prof, (block,))
    before = PlanningContext(prof)
    assert before.candidate((block,)) is not None
    refused = refusing(prof, [(span.first_op, span.last_op)])
    assert refused.extra[REFUSED_SPANS] == ((span.first_op, span.last_op),)
    assert REFUSED_SPANS not in prof.extra  # the profile given is not changed
    after = PlanningContext(refused)
    assert after.candidate((block,)) is None
    assert all(not contains_refused_span(refused, c.a, c.b) for c in after.region_candidates())
    for c in before.region_candidates():  # refused exactly where it contains the block's ops
        s = resolve_span(prof, c.modules)
        around = s.first_op <= span.first_op and span.last_op <= s.last_op
        assert (after.candidate(c.modules) is None) == around, c.modules
