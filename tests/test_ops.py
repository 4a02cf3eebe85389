"""Op facts (memfit.ops): profiling, planning and runtime agree on every aten overload."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from memfit import ops, zoo
from memfit.measuring.verification import PEAK_RTOL, verify
from memfit.planning import rules
from memfit.planning.plan import OpPolicy, Plan, Region
from memfit.planning.simulate import simulate
from memfit.profiling.profile import OpRecord, Phase
from memfit.profiling.tracer import trace
from memfit.profiling.tracker import op_flags
from memfit.runtime import divergence, policies
from memfit.runtime.apply import apply_plan
from memfit.zoo.gpt import CausalSelfAttention

SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
ALL_OVERLOADS = list(ops.aten_overloads())


def test_there_are_many_overloads():
    assert len(ALL_OVERLOADS) > 2000  # the iteration really covers aten


def test_stages_agree_on_every_aten_overload():
    """For every overload: what the profiler records (inplace, random) is exactly what the
    runtime's policy forces to recompute, the planner's matmul set is the runtime's
    save_matmuls, and the planner keys no op the runtime ignores and vice versa."""
    save_matmuls = policies.save_matmuls()
    mismatches = []
    for op in ALL_OVERLOADS:
        name = str(op)
        inplace, random = op_flags(op)  # asked without arguments: for any call
        if ops.must_recompute(op) != (inplace or random):
            mismatches.append(("forced recompute", name))
        record = OpRecord(index=0, name=name, module="", phase=Phase.FORWARD)
        if (save_matmuls.decide(op, name, 0, (), {}) is OpPolicy.SAVE) != rules.is_matmul(record):
            mismatches.append(("matmul", name))
        if (op in divergence.IGNORED_OPS) != (name in rules.unkeyed_ops()):
            mismatches.append(("ignored", name))
    assert mismatches == []


def test_random_is_the_tag_and_nothing_else_without_arguments():
    # NOTE [random ops] rules 1 and 3: asked for any call, random == tagged, and every op
    # that takes a Generator is tagged (so no name list is needed).
    tagged = {str(op) for op in ALL_OVERLOADS if torch.Tag.nondeterministic_seeded in op.tags}
    assert {str(op) for op in ALL_OVERLOADS if ops.is_random(op)} == tagged
    takes_generator = {str(op) for op in ALL_OVERLOADS
                       if any("Generator" in str(a.type) for a in op._schema.arguments)}
    assert takes_generator <= tagged
    assert {"aten.rand_like.default", "aten.randn_like.default", "aten.bernoulli.p",
            "aten.native_dropout.default", str(SDPA_CPU)} <= tagged


def test_dropout_exception_covers_attention_and_rnns_only():
    with_dropout = {str(op) for op in ALL_OVERLOADS
                    if ops.random_kind(op) is ops.RandomKind.WITH_DROPOUT}
    assert str(SDPA_CPU) in with_dropout
    assert "aten.lstm.input" in with_dropout
    assert all("attention" in n or "rnn" in n or n.split(".")[1] in ("lstm", "gru")
               for n in with_dropout), sorted(with_dropout)


Q = torch.randn(1, 2, 8, 4)  # (batch, heads, time, head size)


@pytest.mark.parametrize(("args", "kwargs", "random"), [
    ((Q, Q, Q), {}, False),                         # dropout_p defaults to 0
    ((Q, Q, Q, 0.0, True), {}, False),
    ((Q, Q, Q), {"dropout_p": 0.0}, False),
    ((Q, Q, Q, 0.1), {}, True),
    ((Q, Q, Q), {"dropout_p": 0.1}, True),
], ids=["default", "zero-positional", "zero-keyword", "positive-positional", "positive-keyword"])
def test_attention_is_random_only_with_dropout(args, kwargs, random):
    assert ops.is_random(SDPA_CPU, args, kwargs) is random
    assert ops.must_recompute(SDPA_CPU, args, kwargs) is random
    assert op_flags(SDPA_CPU, args, kwargs) == (False, random)


def test_attention_without_dropout_really_draws_nothing():
    state = torch.get_rng_state()
    SDPA_CPU(Q, Q, Q, 0.0, True)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize(("dropout", "train", "random"), [
    (0.0, True, False), (0.5, False, False), (0.5, True, True),
], ids=["no-dropout", "eval", "train-with-dropout"])
def test_rnn_is_random_only_when_training_with_dropout(dropout, train, random):
    lstm = torch.ops.aten.lstm.input
    x, h = torch.randn(3, 1, 4), torch.zeros(2, 1, 4)
    weights = [torch.randn(16, 4), torch.randn(16, 4), torch.randn(16), torch.randn(16)] * 2
    args = (x, [h, h], weights, True, 2, dropout, train, False, False)
    assert ops.is_random(lstm, args, {}) is random
    state = torch.get_rng_state()
    lstm(*args)
    assert torch.equal(torch.get_rng_state(), state) is not random


@pytest.mark.parametrize(("op", "writes", "view"), [
    (torch.ops.aten.add.Tensor, False, False),
    (torch.ops.aten.add_.Tensor, True, False),
    (torch.ops.aten.add.out, True, False),
    (torch.ops.aten.bernoulli_.float, True, False),
    (torch.ops.aten.view.default, False, True),
    (torch.ops.aten.transpose.int, False, True),
    (torch.ops.aten.split.Tensor, False, True),
    (torch.ops.aten.detach.default, False, True),
    (torch.ops.aten.mm.default, False, False),
], ids=lambda v: str(v) if not isinstance(v, bool) else None)
def test_schema_facts(op, writes, view):
    assert ops.writes_input(op) is writes
    assert ops.is_view(op) is view


def test_no_overload_is_both_a_view_and_a_write():
    assert [str(op) for op in ALL_OVERLOADS if ops.is_view(op) and ops.writes_input(op)] == []


def test_rand_like_is_profiled_random():
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return h + torch.rand_like(h)

    torch.manual_seed(0)
    prof = trace(Noisy(), torch.randn(4, 8), loss_fn=lambda out: out.sum(), repeats=1)
    (op,) = [o for o in prof.ops if o.name == "aten.rand_like.default"]
    assert op.random
    assert not rules.is_saveable(prof, op)


class _SdpaAttention(CausalSelfAttention):
    """The zoo GPT's attention through ``scaled_dot_product_attention`` (no attention dropout:
    on CPU that runs the flash kernel, tagged random for its dropout argument)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)  # each (B, nh, T, hs)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_plan_saving_attention_is_predicted_by_verify():
    # Every block a region that saves its SDPA output. The profiler once called SDPA
    # deterministic while the runtime recomputed it (tag nondeterministic_seeded): the peak
    # then came out 9% under the prediction. Residual dropouts stay on (p=0.1), so the RNG
    # replay around the saved, skipped SDPA call is exercised too.
    n_layer = 4
    model = zoo.gpt(n_layer=n_layer, d_model=32, n_head=2, seq_len=128, vocab_size=32)
    for block in model.blocks:
        block.attn.__class__ = _SdpaAttention
    x = zoo.example_inputs(model, batch=4)
    prof = trace(model, x, repeats=1)
    key = f"{SDPA_CPU}#0"
    plans = {}
    for save in ((key,), ()):
        plan = Plan(regions=tuple(Region.saving((f"blocks.{i}",), save) for i in range(n_layer)),
                    predicted_peak_bytes=0, recompute_s=0.0, budget_bytes=None, solver="hand",
                    profile_signature=prof.signature, plain_peak_bytes=prof.peak_bytes,
                    plain_step_s=prof.step_time_s, model=type(model).__name__)
        sim = simulate(prof, plan)
        plans[save] = dataclasses.replace(plan, predicted_peak_bytes=sim.peak_bytes,
                                          recompute_s=sim.recompute_s)
    saving = plans[(key,)]
    # saving SDPA costs memory, so a runtime that recomputed it would be visibly off
    assert saving.predicted_peak_bytes > plans[()].predicted_peak_bytes * (1 + 2 * PEAK_RTOL)
    apply_plan(model, saving)
    report = verify(model, x)
    assert report.bitwise, str(report)
    assert report.predicted_peak_bytes == saving.predicted_peak_bytes
    # the usual tolerance of verify's "peak matches prediction" check
    assert abs(report.peak_bytes - saving.predicted_peak_bytes) <= PEAK_RTOL * saving.predicted_peak_bytes
    assert report.ok, str(report)
