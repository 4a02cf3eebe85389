"""memfit.step: a step is data (inputs or a callable, loss, autocast); ModelState leaves the
model as found."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit.profiling.tracer import trace
from memfit.step.harness import Autocast, ModelState, Step


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 1))


def test_step_of_inputs_and_of_a_callable_compute_the_same_gradients():
    model, x = _net(), torch.randn(4, 8)
    torch.manual_seed(1)
    Step.of(model, x).run()
    by_inputs = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model.load_state_dict(_net().state_dict())
    torch.manual_seed(1)
    Step.of(model, call=lambda: model(x).sum()).run()
    for a, p in zip(by_inputs, model.parameters(), strict=True):
        assert torch.equal(a, p.grad)


def test_step_made_in_autocast_runs_under_it_later():
    model, x = nn.Linear(8, 8), torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step = Step.of(model, x)
    assert step.autocast == (Autocast("cpu", torch.bfloat16),)
    out, _ = step.output_and_loss()          # outside autocast now
    assert out.dtype == torch.bfloat16
    assert Step.of(model, x).output_and_loss()[0].dtype == torch.float32


def test_profile_of_a_callable_step_is_the_profile_of_the_model():
    model, x = _net(), torch.randn(4, 8)
    by_inputs = trace(model, x, repeats=1)
    by_call = trace(Step.of(model, call=lambda: model(x).sum()), repeats=1)
    assert by_call.signature == by_inputs.signature and by_call.saved_bytes == by_inputs.saved_bytes
    # model(x) + loss_fn keeps the output (4 x 1 float32) referenced through backward, as a
    # training loop does; the callable drops it once it has the loss
    assert by_inputs.peak_bytes - by_call.peak_bytes == 4 * 1 * 4


@pytest.mark.parametrize("bad,match", [
    (dict(example_inputs=None), "needs example_inputs"),
    (dict(example_inputs=torch.ones(1), call=lambda: 0), "not both"),
    (dict(call=3), "call must be a function"),
], ids=["nothing", "both", "not-callable"])
def test_step_of_refuses_what_is_not_a_step(bad, match):
    with pytest.raises(TypeError, match=match):
        Step.of(nn.Linear(1, 1), **bad)


def test_a_callable_must_return_a_scalar_loss():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="return the loss from the step function"):
        Step.of(model, call=lambda: model(torch.ones(1, 2))).run()


def test_model_state_resets_and_restores_grads_buffers_and_rng():
    model, x = _net(), torch.randn(4, 8)
    model(x).sum().backward()
    old_grads = [p.grad.clone() for p in model.parameters()]
    stats = model[1].running_mean.clone()
    rng = torch.get_rng_state()
    with ModelState(model, x) as state:
        state.reset()
        assert all(p.grad is None for p in model.parameters())
        Step.of(model, x).run()
        assert not torch.equal(model[1].running_mean, stats)
        assert not torch.equal(torch.get_rng_state(), rng)
    for g, p in zip(old_grads, model.parameters(), strict=True):
        assert torch.equal(g, p.grad)
    assert torch.equal(model[1].running_mean, stats) and torch.equal(torch.get_rng_state(), rng)


def test_model_state_runs_a_step_repeatably_from_a_seed():
    model = _net()
    step = Step.of(model, torch.randn(4, 8, requires_grad=True)).with_input_copies()
    rng = torch.get_rng_state()
    kept: list[tuple[torch.Tensor, list[torch.Tensor]]] = []

    def keep(out, loss):
        kept.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))

    with ModelState(model, step.inputs, seed=3) as state:
        state.run(step, keep=keep)
        # NOTE [repeatable runs]: gradients dropped at the end, buffers kept until the next run
        assert all(p.grad is None for p in model.parameters()) and step.args[0].grad is None
        stats = model[1].running_mean.clone()
        state.run(step, keep=keep)
        assert torch.equal(model[1].running_mean, stats)  # started again from the snapshot
    (loss_a, grads_a), (loss_b, grads_b) = kept
    assert torch.equal(loss_a, loss_b)  # same dropout mask: the RNG re-seeded
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)  # restore() puts back the snapshot, not the seed
    torch.manual_seed(3)
    assert torch.equal(loss_a, model(step.args[0]).sum().detach())  # the dropout mask of seed 3


def test_model_state_restores_the_rng_it_found_even_with_a_seed():
    model = _net()
    rng = torch.get_rng_state()
    with ModelState(model, seed=5) as state:
        state.reset()
        assert torch.equal(torch.get_rng_state(), torch.manual_seed(5).get_state())
    assert torch.equal(torch.get_rng_state(), rng)


def test_with_input_copies_keeps_gradients_off_the_callers_tensors():
    model, x = _net(), torch.randn(4, 8, requires_grad=True)
    step = Step.of(model, {"input": x}).with_input_copies()
    copy = step.kwargs["input"]
    assert copy is not x and copy.requires_grad and torch.equal(copy, x)
    step.run()
    assert x.grad is None and copy.grad is not None


def test_for_model_runs_the_step_on_a_twin_but_not_a_callable():
    model, x = _net(), torch.randn(4, 8)
    twin = _net()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step = Step.of(model, x)
    moved = step.for_model(twin)
    assert moved.model is twin and moved.args is step.args and moved.autocast == step.autocast
    with pytest.raises(TypeError, match="cannot run on a copy"):
        Step.of(model, call=lambda: model(x).sum()).for_model(twin)


def test_model_state_restores_the_cuda_rng_whenever_cuda_is_in_use(monkeypatch):
    """NOTE [RNG of every device]: a CPU-first model in a process that uses CUDA still gets
    its CUDA generators snapshotted and put back (no GPU here: torch.cuda's RNG calls are
    replaced by a recorder)."""
    states = [torch.tensor([1, 2, 3], dtype=torch.uint8)]
    restored: list[list[torch.Tensor]] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(states))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: restored.append(list(s)))
    with ModelState(nn.Linear(2, 2)):
        pass
    assert len(restored) == 1 and torch.equal(restored[0][0], states[0])
