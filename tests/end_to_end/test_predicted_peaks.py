"""Profile -> plan -> apply -> measure: the planned step's peak is the one predicted.

The prediction (``simulate`` on the profile) and the measurement (the live-storage meter on
the planned model's real step) are independent: one replays recorded storage lifetimes, the
other watches the checkpointed step run. They agree to within a few hundred bytes.

The planner's own plan (``planned_midway``) must not depend on the machine's speed: it is made
from the profile with fixed op times (``_fixed_times``; with the measured ones it changed from
run to run with the machine's load, and so did what the test checked) by the chain DP, which
has no time limit (``auto`` also runs the MILP under a time limit of seconds, and on a busy
machine kept another solver's plan). Every assertion is on the plan that was made: its
predicted peak against its measured one.

Kernel workspaces (NOTE [kernel workspaces] in ``memfit.profiling.profile``) are invisible to
the live-storage meter, so the tight comparison is between that meter and the prediction of
the same profile with its workspaces zeroed: it checks storage lifetimes exactly. The full
prediction, workspaces included, is compared with the CPU allocator meter of the same run (the
ground truth budgets are judged by), within ``ALLOC_REL_TOL``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memfit import InfeasibleBudget, OpPolicy, Plan, Region, zoo
from memfit.api import fit
from memfit.measuring.verification import verify
from memfit.ops import KEPT_DRAW_OPS
from memfit.planning.planner import plan_for_budget
from memfit.planning.simulate import simulate
from memfit.profiling.measure import measure
from memfit.profiling.tracer import trace
from memfit.runtime.apply import apply_plan, unapply
from memfit.step.harness import Step
from memfit.step.inputs import normalize_inputs

# The checkpoint machinery keeps a few small tensors of its own (RNG state, bookkeeping)
# and the profile sees a few the planned step does not; measured differences were 0-512 B
# on models whose peaks are MiBs. 0.1% bounds that with room and still catches any storage
# that is predicted to be dropped but kept (each is KiBs here).
REL_TOL = 1e-3
# Allocator vs full prediction, measured here: exact on the plain steps, 0.4-0.7% low on the
# checkpointed ones (a few KiB to tens of KiB the allocator sees around the replays; cause not
# pinned down). 2% bounds that with room, and still fails without the workspaces: the
# prediction without them reads 1-82% below the allocator on these small conv nets.
ALLOC_REL_TOL = 2e-2

CASES = {
    "gpt": (lambda: zoo.gpt(n_layer=3, d_model=64, n_head=2, seq_len=64, vocab_size=128), 2, None),
    "resnet": (lambda: zoo.resnet(blocks_per_stage=(1, 1), width=16), 2, 32),
    "unet3d": (lambda: zoo.unet3d(base=4, depth=2), 1, 16),
}


def _measured_peaks(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(live-storage meter, CPU allocator meter) peaks of one run of the step."""
    args, kwargs = normalize_inputs(x)
    step = Step(model, args, kwargs).run
    m = measure(step, model=model, meter="both")
    assert m.allocator_peak_bytes is not None
    return m.tracked_peak_bytes, m.allocator_peak_bytes


def _without_workspaces(p):
    """The profile as the live-storage meter sees it: no kernel workspaces, and no RNG state
    stashed by a checkpoint (torch reads it into a tensor outside the dispatcher: NOTE
    [region state bytes])."""
    ops = tuple(dataclasses.replace(op, workspace_bytes=0) for op in p.ops)
    live = tuple(v - op.workspace_bytes for v, op in zip(p.live_bytes, p.ops, strict=True))
    return dataclasses.replace(p, ops=ops, live_bytes=live, peak_bytes=max(live), region_state_bytes=0)


def _fixed_times(p):
    """The profile with op times that depend on its ops only: 1 us per op plus its flops at
    10 GFLOP/s (the plan the planner makes from it is the same in every run)."""
    ops = tuple(dataclasses.replace(op, time_s=1e-6 + op.flops * 1e-10) for op in p.ops)
    return dataclasses.replace(p, ops=ops, step_time_s=sum(op.time_s for op in ops))


def _seen_by_dispatch(plan: Plan) -> Plan:
    """The plan as the live-storage meter sees it run: its kept draws recomputed instead. The
    copy a kept draw keeps is made with Python dispatch off (NOTE [kept draws] in
    memfit.runtime.draws, rule 4), so no dispatch mode sees it; the other tensors live as
    with the draw recomputed (the tensor drawn into is made again by the replay either way)."""
    def drawn(key: str, policy: OpPolicy) -> bool:
        return policy is OpPolicy.SAVE and key.rsplit("#", 1)[0] in KEPT_DRAW_OPS

    regions = tuple(dataclasses.replace(r, ops=tuple((k, v) for k, v in r.ops if not drawn(k, v)))
                    for r in plan.regions)
    return dataclasses.replace(plan, regions=regions)


def _smallest_peak(p) -> int:
    """The chain DP's smallest peak (no time limit: the same on a busy machine)."""
    with pytest.raises(InfeasibleBudget) as err:
        plan_for_budget(p, budget=1, solver="chain")
    return err.value.min_feasible_bytes


BLOCKS = {
    "gpt": [f"blocks.{i}" for i in range(3)],
    "resnet": ["layers.0", "layers.1"],
    "unet3d": ["down.0", "down.1", "bottleneck", "up.0", "up.1"],
}


# Modules checkpointed inside their checkpointed blocks (NOTE [nested regions] in
# memfit.planning.nesting), on top of every block; SEGMENT_NESTED: a segment with inner ones.
NESTED = {
    "gpt": ["blocks.0.attn", "blocks.1.attn.attn_drop", "blocks.1.mlp", "blocks.2.mlp.fc"],
    "resnet": ["layers.0.bn1", "layers.1.conv2"],
    "unet3d": ["down.0.bn1", "up.1.conv2", "bottleneck.act"],
}
SEGMENT_NESTED = {
    "gpt": ((("blocks.0", "blocks.1")), ("blocks.0.attn", "blocks.1.mlp")),
    "resnet": ((("layers.0", "layers.1")), ("layers.1.bn2",)),
}
# Regions that keep dropout masks (NOTE [kept draws]): the attention's in a region of its own,
# the MLP's in a whole block.
KEPT_DRAWS = {
    "gpt": [Region.saving(("blocks.1.attn.attn_drop",), ["aten.bernoulli_.float#0"]),
            Region.saving(("blocks.2",), ["aten.bernoulli_.float#2"])],
}


def _nested(blocks: list[str], name: str) -> list[Region]:
    return [Region((b,)) for b in blocks] + [Region((i,)) for i in NESTED[name]]


def _plans(p, blocks: list[str], name: str = "") -> dict[str, Plan]:

    def hand(regions: list[Region]) -> Plan:
        return Plan(regions=tuple(regions), predicted_peak_bytes=0, recompute_s=0.0,
                    budget_bytes=None, solver="hand", profile_signature=p.signature)

    fixed = _fixed_times(p)
    plans = {
        "none": hand([]),
        "every_block": hand([Region((b,)) for b in blocks]),
        "planned_midway": plan_for_budget(fixed, budget=(_smallest_peak(fixed) + p.peak_bytes) // 2,
                                    solver="chain"),
    }
    if name in KEPT_DRAWS:
        plans["kept_draws"] = hand(KEPT_DRAWS[name])
    if name in NESTED:
        plans["nested"] = hand(_nested(blocks, name))
    if name in SEGMENT_NESTED:
        seg, inner = SEGMENT_NESTED[name]
        plans["segment_nested"] = hand([Region(seg), *(Region((i,)) for i in inner)])
        # NOTE [nested segments]: the segment's blocks checkpointed inside it
        plans["segment_blocks_nested"] = hand([Region(seg), *(Region((b,)) for b in seg)])
        plans["segment_last_block_nested"] = hand([Region(seg), Region((seg[-1],))])
    return plans


@pytest.mark.parametrize("name", sorted(CASES))
def test_measured_peak_is_the_predicted_peak(name):
    factory, batch, size = CASES[name]
    model = factory()
    x = zoo.example_inputs(model, batch=batch, size=size)
    p = trace(model, x, repeats=1)
    tensors_only = _without_workspaces(p)
    tracked, _ = _measured_peaks(model, x)
    assert tracked == tensors_only.peak_bytes  # the plain step: exact
    for label, plan in _plans(p, BLOCKS[name], name).items():
        predicted = simulate(p, plan).peak_bytes
        predicted_tensors = simulate(tensors_only, _seen_by_dispatch(plan)).peak_bytes
        if plan.regions:
            apply_plan(model, plan)
        try:
            tracked, allocated = _measured_peaks(model, x)
        finally:
            if plan.regions:
                unapply(model)
        assert abs(tracked - predicted_tensors) <= REL_TOL * predicted_tensors, \
            (label, tracked, predicted_tensors)
        assert abs(allocated - predicted) <= ALLOC_REL_TOL * predicted, (label, allocated, predicted)
        if label in ("every_block", "planned_midway"):  # hand-made nestings may not pay
            assert tracked < tensors_only.peak_bytes, label


def test_an_inner_call_replayed_by_its_outer_region_holds_a_generator_state():
    """Each block checkpointed with its attention dropout nested: the plan peaks in block 0's
    replay, where the inner call runs again as a checkpoint call that stashes the generator
    state until the replay ends (NOTE [nested regions]); predicted 5,072 B under the CPU
    allocator's peak without it, 16 B with it."""
    torch.manual_seed(0)
    model = zoo.gpt(n_layer=2, d_model=32, n_head=4, seq_len=128, vocab_size=64, dropout=0.1)
    x = zoo.example_inputs(model, batch=2)
    p = trace(model, x, repeats=1)
    regions = ("blocks.0", "blocks.0.attn.attn_drop", "blocks.1", "blocks.1.attn.attn_drop")
    plan = Plan(regions=tuple(Region((r,)) for r in regions), predicted_peak_bytes=0, recompute_s=0.0,
                budget_bytes=None, solver="hand", profile_signature=p.signature)
    sim = simulate(p, plan)
    assert sim.peak_at >= p.n_forward and sim.positions.count(sim.peak_at) > 1  # in a replay
    apply_plan(model, plan, check=False)
    try:
        allocated = measure(Step.of(model, x).run, model=model, meter="allocator").peak_bytes
    finally:
        unapply(model)
    assert abs(allocated - sim.peak_bytes) <= 256, (allocated, sim.peak_bytes)


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.tanh(self.inner(x)))  # ``positions`` is passed and never read


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(8192, dtype=torch.int64) + x.shape[0]  # 64 KiB, made in forward
        for layer in self.layers:
            x = layer(x, positions=positions)
        return x


def test_a_tensor_passed_to_a_region_and_never_read_is_held_with_its_frame():
    """A checkpoint's frame holds every tensor its call was given (a Hugging Face Llama layer's
    ``cache_position``): the plain step frees ``positions`` when the forward returns, every
    layer checkpointed holds it until layer 0's backward. Predicted 65,536 B under the CPU
    allocator's peak without it."""
    torch.manual_seed(0)
    model, x = _Stack(), torch.randn(256, 64)
    p = trace(model, x, repeats=1)
    plan = Plan(regions=tuple(Region((f"layers.{i}",)) for i in range(3)), predicted_peak_bytes=0,
                recompute_s=0.0, budget_bytes=None, solver="hand", profile_signature=p.signature)
    predicted = simulate(p, plan).peak_bytes
    apply_plan(model, plan, check=False)
    try:
        allocated = measure(Step.of(model, x).run, model=model, meter="allocator").peak_bytes
    finally:
        unapply(model)
    assert abs(allocated - predicted) <= 256, (allocated, predicted)


class _UpBlock(torch.nn.Module):
    """MONAI's ``UnetUpBlock`` (DynUNet's decoder block) in plain torch: upsample, concatenate
    the skip, two convolutions each followed by ``InstanceNorm3d`` and an in-place LeakyReLU."""

    def __init__(self, c_in: int = 8, c_out: int = 4) -> None:
        super().__init__()
        self.transp_conv = torch.nn.ConvTranspose3d(c_in, c_out, 2, stride=2, bias=False)
        self.conv1 = torch.nn.Conv3d(2 * c_out, c_out, 3, padding=1, bias=False)
        self.norm1 = torch.nn.InstanceNorm3d(c_out, affine=True)
        self.conv2 = torch.nn.Conv3d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = torch.nn.InstanceNorm3d(c_out, affine=True)
        self.lrelu = torch.nn.LeakyReLU(0.01, inplace=True)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        h = torch.cat((self.transp_conv(x), skip), dim=1)  # (batch, 2 c_out, 2 D, 2 H, 2 W)
        h = self.lrelu(self.norm1(self.conv1(h)))
        return self.lrelu(self.norm2(self.conv2(h)))


class _Decoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = _UpBlock()
        self.head = torch.nn.Conv3d(4, 1, 1)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.head(self.up(x, skip))


def _decoder_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 8, 8, 8, 8, generator=g), torch.randn(1, 4, 16, 16, 16, generator=g)


def test_a_region_whose_output_its_own_activation_saved_replays_at_that_activation():
    """The in-place LeakyReLU on InstanceNorm's output (a view: instance norm is a batch norm
    over a reshaped input) saves the block's output, and its backward first clones the whole
    gradient (``CopySlices``). The checkpointed block replays there, the clone live, and its
    output is held by the head's node only (NOTE [region memory model]). Predicted 65,408 B
    under the CPU allocator's peak before, in the replay of the first convolution (issue #24,
    DynUNet: 17% over)."""
    torch.manual_seed(0)
    model, x = _Decoder(), _decoder_inputs()
    p = trace(model, x, repeats=1)
    plan = Plan(regions=(Region(("up",)),), predicted_peak_bytes=0, recompute_s=0.0,
                budget_bytes=None, solver="hand", profile_signature=p.signature)
    predicted = simulate(p, plan).peak_bytes
    predicted_tensors = simulate(_without_workspaces(p), plan).peak_bytes
    apply_plan(model, plan, check=False)
    try:
        tracked, allocated = _measured_peaks(model, x)
    finally:
        unapply(model)
    assert (tracked, allocated) == (predicted_tensors, predicted)


def test_a_fitted_monai_dynunet_peaks_where_predicted():
    """Issue #24, case 4, on MONAI's DynUNet (instance norm, no deep supervision): its
    smallest plan checkpointed a decoder block's ``conv_block`` and measured 3,030,160 B
    against 2,802,320 B predicted (8% over its budget) before; now the byte."""
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    model = nets.DynUNet(3, 1, 2, kernel_size=[3, 3, 3], strides=[1, 2, 2], upsample_kernel_size=[2, 2],
                         norm_name="instance", filters=[8, 16, 32])
    x = torch.randn(2, 1, 16, 16, 16, generator=torch.Generator().manual_seed(0))
    fit(model, x, budget="min")
    plan = model.memfit_plan
    allocated = measure(Step.of(model, x).run, model=model, meter="allocator").peak_bytes
    assert allocated == plan.predicted_peak_bytes <= plan.budget_bytes


def _dynunet_deep_supervision() -> torch.nn.Module:
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    return nets.DynUNet(spatial_dims=3, in_channels=1, out_channels=3, kernel_size=[3, 3, 3, 3],
                        strides=[1, 2, 2, 2], upsample_kernel_size=[2, 2, 2], norm_name="instance",
                        res_block=True, deep_supervision=True, deep_supr_num=2).train()


@pytest.mark.slow
def test_a_monai_dynunet_with_deep_supervision_fits_its_budget():
    """Issue #39, item 7: residual blocks, instance norm, a weighted cross-entropy over the
    three supervision heads, 2 x 1 x 32^3. At the least feasible budget + 1% the plan replays
    the skip layer that stores the inner head in the list its skip layers share, and the
    replay's head kept the replay's graph (15.9 MB of activations) to the end of backward:
    125,754,924 B measured against 109,808,916 B predicted, 14.4% over the budget, before;
    now the step peaks where predicted (NOTE [the forward's tensors] rule 6 in
    ``memfit.runtime.bindings``)."""
    x = torch.randn(2, 1, 32, 32, 32, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 3, (2, 32, 32, 32), generator=torch.Generator().manual_seed(1))
    weights = (1.0, 0.5, 0.25)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:  # out: (batch, 1 + heads, classes, D, H, W)
        heads = torch.unbind(out, dim=1)
        return sum(w * torch.nn.functional.cross_entropy(h, y)
                   for w, h in zip(weights, heads, strict=True)) / sum(weights)

    smallest = _dynunet_deep_supervision()
    fit(smallest, x, budget="min", loss_fn=loss_fn)
    budget = int(smallest.memfit_plan.predicted_peak_bytes * 1.01)
    model = _dynunet_deep_supervision()
    fit(model, x, budget=budget, loss_fn=loss_fn)
    plan = model.memfit_plan
    # the replayed skip layer stores the inner head: what the test is about
    assert any("skip_layers.next_layer.next_layer".startswith(r.modules[0]) for r in plan.regions)
    allocated = measure(Step.of(model, x, loss_fn=loss_fn).run, model=model,
                        meter="allocator").peak_bytes
    assert allocated <= plan.predicted_peak_bytes <= budget
    report = verify(model, x, loss_fn=loss_fn)
    assert report.ok and report.bitwise and report.max_abs_diff == 0.0, str(report)
