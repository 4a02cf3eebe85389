"""memfit.runtime.offload: OFFLOAD op outputs kept on the host (a second CPU buffer here)."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
import torch.nn.functional as F
from runtime_helpers import assert_bitwise_twin, clone_inputs, pair, step
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from memfit import zoo
from memfit.planning.plan import OpPolicy, Plan, Region
from memfit.profiling.storages import LiveStorages, StorageKind
from memfit.runtime.apply import apply_plan, host_pool
from memfit.runtime.checkpoint import checkpoint
from memfit.runtime.offload import HostCopy, HostPool
from memfit.runtime.policies import by_key
from memfit.runtime.region_policy import RegionPolicy

# Offload runs on the CPU here, which it cannot help (NOTE [offload on a CPU model]); the
# warning that says so has a test of its own.
# Offload needs torch 2.13's indexed selective-checkpoint cache: on an older torch each test
# must raise UnsupportedTorch (NOTE [features by torch release] in memfit.torch_support.capabilities).
pytestmark = [pytest.mark.filterwarnings("ignore:.*offloading frees nothing:UserWarning"),
              pytest.mark.torch_feature("offload")]

B, T, C, HEADS, VOCAB = 2, 16, 32, 4, 64
OFF, S = OpPolicy.OFFLOAD, OpPolicy.SAVE
# A zoo GPT block's ops (NOTE [op keys]): ln1, qkv, q@k, softmax, fc, gelu offloaded; proj
# saved; the weight transpose asked to be offloaded is a view op, so it is saved instead.
BLOCK_OPS = (
    ("aten.native_layer_norm.default#0", OFF), ("aten.t.default#0", OFF),
    ("aten.addmm.default#0", OFF), ("aten.bmm.default#0", OFF), ("aten._softmax.default#0", OFF),
    ("aten.addmm.default#1", S), ("aten.addmm.default#2", OFF), ("aten.gelu.default#0", OFF),
)
# Every op of the block asked to be offloaded: views are saved, dropout recomputed.
ALL_KEYS = (
    "aten.native_layer_norm.default#0 aten.addmm.default#0 aten.clone.default#0 "
    "aten.clone.default#1 aten._unsafe_view.default#0 aten._unsafe_view.default#1 "
    "aten.bmm.default#0 aten._unsafe_view.default#2 aten.mul.Tensor#0 aten.bitwise_not.default#0 "
    "aten.masked_fill.Scalar#0 aten._softmax.default#0 aten.empty_like.default#0 "
    "aten.mul.Tensor#1 aten.clone.default#2 aten._unsafe_view.default#3 aten.bmm.default#1 "
    "aten._unsafe_view.default#4 aten.clone.default#3 aten.view.default#6 aten.t.default#1 "
    "aten.addmm.default#1 aten.empty_like.default#1 aten.mul.Tensor#2 aten.add.Tensor#0 "
    "aten.native_layer_norm.default#1 aten.addmm.default#2 aten.gelu.default#0 "
    "aten.addmm.default#3 aten.empty_like.default#2 aten.mul.Tensor#3 aten.add.Tensor#1")
ALL_OPS = tuple((k, OFF) for k in ALL_KEYS.split())
F32 = 4
# Bytes one call of that block offloads: layer norm (out, mean, rstd), qkv, q@k, softmax, fc, gelu.
BLOCK_OFFLOAD_BYTES = F32 * (B * T * C + 2 * B * T + B * T * 3 * C + 2 * B * HEADS * T * T
                             + 2 * B * T * 4 * C)


def _gpt() -> torch.nn.Module:
    return zoo.gpt(n_layer=3, d_model=C, n_head=HEADS, seq_len=T, vocab_size=VOCAB, dropout=0.1)


def _plan(*regions: Region) -> Plan:
    return Plan(regions=regions, predicted_peak_bytes=0, recompute_s=0.0, budget_bytes=None,
                solver="test", profile_signature="", extra={})


PLANS = {
    "one_block": (_plan(Region(("blocks.0",), BLOCK_OPS)), 1),
    "two_wrapped_blocks": (_plan(Region(("blocks.0",), BLOCK_OPS), Region(("blocks.2",), BLOCK_OPS)), 2),
    "segment_first_block_offloaded": (_plan(Region(("blocks.1", "blocks.2"), BLOCK_OPS)), 1),
    "everything_asked_offloaded": (_plan(Region(("blocks.1",), ALL_OPS)), None),
}


def _ids() -> torch.Tensor:
    torch.manual_seed(123)
    return torch.randint(0, VOCAB, (B, T))


@pytest.mark.parametrize("plan,calls", PLANS.values(), ids=PLANS.keys())
def test_offload_trains_bitwise_and_moves_the_planned_bytes(plan, calls):
    model, twin = pair(_gpt)
    apply_plan(model, plan)
    pool = host_pool(model)
    assert isinstance(pool, HostPool) and pool.cap_bytes is None
    assert_bitwise_twin(model, twin, (_ids(),), steps=3)  # dropout on: RNG replayed
    if calls is None:
        assert pool.offloaded_bytes > 3 * BLOCK_OFFLOAD_BYTES
    else:
        assert pool.offloaded_bytes == 3 * calls * BLOCK_OFFLOAD_BYTES
    assert pool.in_use_bytes == 0


def test_every_region_of_a_plan_shares_one_pool():
    model = _gpt()
    apply_plan(model, _plan(Region(("blocks.0",), BLOCK_OPS), Region(("blocks.2",), BLOCK_OPS)))
    pools = {id(model.blocks[i]._memfit_wrap.policy.host) for i in (0, 2)}
    assert pools == {id(host_pool(model))}


def test_host_cap_is_never_exceeded_and_the_rest_stays_on_device(caplog):
    model, twin = pair(_gpt)
    cap = 20_000  # bytes: room for the small tensors of one block, not for its big ones
    apply_plan(model, _plan(Region(("blocks.0",), BLOCK_OPS), Region(("blocks.1",), BLOCK_OPS)),
          host_budget=cap)
    pool = host_pool(model)
    with caplog.at_level(logging.WARNING, logger="memfit.runtime.offload"):
        assert_bitwise_twin(model, twin, (_ids(),), steps=2)
    assert pool.peak_bytes <= cap and pool.allocated_bytes <= cap
    assert pool.refused > 0 and 0 < pool.offloaded_bytes < 2 * 2 * BLOCK_OFFLOAD_BYTES
    assert len([r for r in caplog.records if "host cap" in r.getMessage()]) == 1


def test_host_budget_string_is_parsed():
    model = _gpt()
    apply_plan(model, _plan(Region(("blocks.0",), BLOCK_OPS)), host_budget="1MiB")
    assert host_pool(model).cap_bytes == 1 << 20
    with pytest.raises(ValueError, match="host_budget"):
        apply_plan(model, _plan(Region(("blocks.0",), BLOCK_OPS)), host_budget=-1)


def _leftover_activations(model: torch.nn.Module, ids: torch.Tensor) -> list[int]:
    """Bytes of the storages made in a step's forward that are still live after it."""
    meter = LiveStorages()
    with meter:
        torch.manual_seed(0)
        loss = model(ids).float().square().mean()
        meter.begin_backward()
        loss.backward()
    meter.close()
    return sorted(s.nbytes for s in meter.storages
                  if s.kind is StorageKind.ACTIVATION and s.freed_after is None)


def test_after_a_step_live_storages_return_to_the_start_and_the_pool_is_reused():
    model, twin = pair(_gpt)
    apply_plan(model, _plan(Region(("blocks.0",), BLOCK_OPS), Region(("blocks.1", "blocks.2"), BLOCK_OPS)))
    pool = host_pool(model)
    ids = _ids()
    step(model, (ids,), 0)  # warms the pool
    allocations, held = pool.allocations, pool.allocated_bytes
    for _ in range(2):
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
        # only the loss (a float32 scalar, still referenced) outlives the step, as in plain
        assert _leftover_activations(model, ids) == _leftover_activations(twin, ids) == [F32]
    gc.collect()
    assert [o for o in gc.get_objects() if type(o) is HostCopy] == []
    assert pool.in_use_bytes == 0
    assert (pool.allocations, pool.allocated_bytes) == (allocations, held)  # no new buffer


def test_an_unread_host_copy_returns_its_buffer():
    """A forward without backward: the region's entries die with the graph."""
    model = _gpt()
    apply_plan(model, _plan(Region(("blocks.0",), BLOCK_OPS)))
    pool = host_pool(model)
    out = model(_ids())
    assert pool.in_use_bytes > 0
    del out
    gc.collect()
    assert pool.in_use_bytes == 0


FORCED = {
    "inplace_random_bernoulli_": (torch.ops.aten.bernoulli_.float,
                                  (torch.empty(4), 0.5), CheckpointPolicy.MUST_RECOMPUTE),
    "random_native_dropout": (torch.ops.aten.native_dropout.default, (torch.ones(4), 0.5, True),
                              CheckpointPolicy.MUST_RECOMPUTE),
    "inplace_add_": (torch.ops.aten.add_.Tensor, (torch.ones(4), torch.ones(4)),
                     CheckpointPolicy.MUST_RECOMPUTE),
    "view_t_saved_on_device": (torch.ops.aten.t.default, (torch.ones(2, 3),),
                               CheckpointPolicy.MUST_SAVE),
}


@pytest.mark.parametrize("op,args,expected", FORCED.values(), ids=FORCED.keys())
def test_offload_of_random_inplace_or_view_ops_is_refused_as_for_save(op, args, expected):
    region = RegionPolicy(by_key({f"{op}#0": OFF}))
    ctx = SelectiveCheckpointContext(is_recompute=False)
    assert region(ctx, op, *args) is expected
    assert region.offloads == set()


def test_offloaded_op_is_marked():
    region = RegionPolicy(by_key({"aten.mm.default#1": OFF}))
    ctx = SelectiveCheckpointContext(is_recompute=False)
    a = torch.ones(2, 2)
    mm = torch.ops.aten.mm.default
    assert region(ctx, mm, a, a) is CheckpointPolicy.PREFER_RECOMPUTE
    assert region(ctx, mm, a, a) is CheckpointPolicy.MUST_SAVE
    assert region.offloads == {(mm, 1)}


class _WrittenAfter(torch.nn.Module):
    """An offloaded output written in place later in the forward (NOTE [forced recompute])."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h.mul_(2)
        return torch.tanh(h) * x


def test_offloaded_output_written_in_place_later_is_recomputed_bitwise():
    model, twin = pair(_WrittenAfter)
    pool = HostPool()
    x = torch.randn(4, 8, requires_grad=True)
    xa, xb = clone_inputs((x,))[0], clone_inputs((x,))[0]
    checkpoint(model, xa, policy=by_key({"aten.addmm.default#0": OFF}, host=pool)).sum().backward()
    twin(xb).sum().backward()
    assert torch.equal(xa.grad, xb.grad) and torch.equal(model.lin.weight.grad, twin.lin.weight.grad)
    gc.collect()
    assert pool.offloaded_bytes == 4 * 8 * F32 and pool.in_use_bytes == 0


def test_functional_checkpoint_with_its_own_pool_is_bitwise():
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16)

    def f(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x @ w).sin() @ w

    policy = by_key({"aten.mm.default#0": OFF, "aten.gelu.default#0": OFF, "aten.sin.default#0": OFF})
    checkpoint(f, x, policy=policy).square().sum().backward()
    got, w.grad = w.grad, None
    f(x).square().sum().backward()
    assert torch.equal(got, w.grad)
    assert policy.host.offloaded_bytes == 3 * 8 * 16 * F32  # type: ignore[attr-defined]


def test_an_offload_plan_for_a_gpu_applied_to_a_cpu_model_says_so_once():
    import dataclasses
    import warnings

    plan = dataclasses.replace(PLANS["two_wrapped_blocks"][0], extra={"target": "h100"})
    model = _gpt()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        apply_plan(model, plan)
    assert [w.category for w in said] == [UserWarning]  # one for the plan, not one per region
    assert str(said[0].message).startswith(
        "memfit: the plan offloads 14 activation(s) to host memory over the host link of h100 "
        "(planned with target='h100'), but GPT is on cpu: the activations are in host memory "
        "already, so offloading frees nothing")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        apply_plan(model, dataclasses.replace(plan, regions=tuple(
            dataclasses.replace(r, ops=tuple((k, S) for k, _ in r.ops)) for r in plan.regions)))
    assert said == []  # a plan that saves instead: nothing to say
