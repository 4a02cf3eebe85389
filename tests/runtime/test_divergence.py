"""The value check (NOTE [value check]) and check sampling (NOTE [check sampling]) of
memfit.runtime.divergence, through every entry point that checkpoints a region."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from runtime_helpers import TinyGPT, assert_bitwise_twin, conv_net, pair
from torch import nn

from memfit.errors import RecomputeMismatch
from memfit.planning.plan import Plan, Region
from memfit.runtime import policies as P
from memfit.runtime.apply import apply_plan
from memfit.runtime.checkpoint import checkpoint
from memfit.runtime.divergence import DivergenceCheck
from memfit.runtime.marks import applied_plan
from memfit.runtime.segment import checkpoint_segment, segment_of
from memfit.runtime.wrap import wrap


class RandomScale(nn.Module):
    """Scales by Python's RNG, which checkpointing does not replay: same ops, other values."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) * random.uniform(0.5, 1.5))


class HookCounter(nn.Module):
    """A forward hook on a submodule multiplies by its call count: other values each call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = 0
        self.fc.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return out * self.calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def _plan(*regions: Region) -> Plan:
    return Plan(regions=regions, predicted_peak_bytes=0, recompute_s=0.0, budget_bytes=None,
                solver="test", profile_signature="", extra={"module_types": {}})


def _install(entry: str, model: nn.Sequential, check: object = True) -> str:
    """Checkpoint block 1 of ``model`` (two blocks for a segment); return the region's name."""
    if entry == "wrap":
        wrap(model[1], check=check)
        return type(model[1]).__name__
    if entry == "wrap_policy":
        wrap(model[1], P.save_matmuls(), check=check)
        return type(model[1]).__name__
    if entry == "segment":
        checkpoint_segment(model, [1, 2], check=check)
        return "Sequential[1..2]"
    if entry == "apply":
        apply_plan(model, _plan(Region(("1",))), check=check)
        return "1"
    raise ValueError(entry)


def _model(block: type[nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), block(), block())


BLOCKS = {"random_uniform": RandomScale, "hook_counter": HookCounter}
ENTRIES = ["wrap", "wrap_policy", "segment", "apply"]


@pytest.mark.parametrize("block", BLOCKS.values(), ids=BLOCKS.keys())
def test_same_ops_other_values_torch_is_silent(block):
    # The premise: ops, shapes and dtypes agree, so torch (and memfit's op check) pass,
    # while the gradients differ from the plain step's.
    model = _model(block)
    plain = copy.deepcopy(model)
    wrap(model[1], check="always-ops")
    x = torch.randn(4, 8)
    random.seed(0)
    model(x).sum().backward()
    random.seed(0)
    plain(x).sum().backward()
    assert not torch.equal(model[0].weight.grad, plain[0].weight.grad)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("block", BLOCKS.values(), ids=BLOCKS.keys())
def test_value_divergence_raises_naming_module_and_tensor(block, entry):
    model = _model(block)
    name = _install(entry, model)
    random.seed(0)
    loss = model(torch.randn(4, 8)).sum()
    # Linear on a 2-D input is t (op 0), addmm (op 1); the scaling is op 2.
    with pytest.raises(RecomputeMismatch,
                       match=rf"recomputation of {name.replace('[', '.').replace(']', '.')} "
                             r"gave other values than its forward at op 2 "
                             r"\(aten\.mul\.Tensor -> float32\[4, 8\]\): fingerprint -?\d+ vs"):
        loss.backward()


@pytest.mark.parametrize("block", BLOCKS.values(), ids=BLOCKS.keys())
def test_value_divergence_raises_in_the_function_form(block):
    module = block()
    x = torch.randn(4, 8, requires_grad=True)
    name = type(module).__name__
    y = checkpoint(module, x)
    with pytest.raises(RecomputeMismatch, match=rf"{name} gave other values .* at op 2 "
                                                r"\(aten\.mul\.Tensor"):
        y.sum().backward()


DETERMINISTIC = {
    "gpt_dropout_wrap_and_segment": (
        TinyGPT, (torch.randint(0, 64, (2, 8)),),
        (Region(("blocks.0",)), Region.saving(("blocks.1", "blocks.2"), ("aten.bmm.default#1",)))),
    "conv_batchnorm_inplace_relu": (
        conv_net, (torch.randn(4, 3, 12, 12),),
        (Region.saving(("0",), ("aten.convolution.default#0",)), Region(("1", "2")))),
}


@pytest.mark.parametrize("check", [True, "always"], ids=["default", "always"])
@pytest.mark.parametrize("factory,inputs,regions", DETERMINISTIC.values(), ids=DETERMINISTIC.keys())
def test_deterministic_model_passes_bitwise_with_values_checked(factory, inputs, regions, check):
    model, twin = pair(factory)
    apply_plan(model, _plan(*regions), check=check)
    assert_bitwise_twin(model, twin, inputs, steps=2)
    wrapped = model.get_submodule(regions[0].modules[0])._memfit_wrap.check
    segment = segment_of(model.get_submodule(regions[1].modules[0]))
    assert segment is not None
    for sampler in (wrapped, segment.check):
        assert sampler.check.values and (sampler.calls, sampler.checked) == (2, 2)


def _raised_steps(model: nn.Sequential, steps: int) -> list[int]:
    x = torch.randn(4, 8)
    raised = []
    for s in range(steps):
        model.zero_grad(set_to_none=True)
        loss = model(x).sum()
        try:
            loss.backward()
        except RecomputeMismatch:
            raised.append(s)
    return raised


SAMPLING = {
    # check, steps, the steps NOTE [check sampling] says are checked, how many are checked
    # (for "ops" the value divergence passes: only ops are compared)
    "default": (True, 201, [0, 1, 2, 100, 200], 5),
    "first3_every5": (DivergenceCheck(first_calls=3, every=5), 23, [0, 1, 2, 5, 10, 15, 20], 7),
    "first0_every4": (DivergenceCheck(first_calls=0, every=4), 10, [0, 4, 8], 3),
    "only_first2": (DivergenceCheck(first_calls=2, every=0), 10, [0, 1], 2),
    "always": ("always", 6, [0, 1, 2, 3, 4, 5], 6),
    "ops_only": ("ops", 6, [], 3),
    "off": (False, 6, [], 0),
}


@pytest.mark.parametrize("entry", ["wrap", "segment"])
@pytest.mark.parametrize("check,steps,expected,checked", SAMPLING.values(), ids=SAMPLING.keys())
def test_sampling_checks_the_steps_it_says(check, steps, expected, checked, entry):
    # HookCounter diverges on every recomputation: a step raises iff its values were checked.
    model = _model(HookCounter)
    _install(entry, model, check)
    assert _raised_steps(model, steps) == expected
    sampler = model[1]._memfit_wrap.check if entry == "wrap" else segment_of(model[1]).check
    assert (sampler.calls, sampler.checked) == (steps, checked)


BAD_CHECKS = {
    "unknown_string": ("sometimes", ValueError, "'sometimes' is not a known check"),
    "int": (2, TypeError, "got int"),
}


@pytest.mark.parametrize("check,error,message", BAD_CHECKS.values(), ids=BAD_CHECKS.keys())
def test_bad_check_values_are_refused_before_anything_changes(check, error, message):
    model = _model(RandomScale)
    with pytest.raises(error, match=message):
        apply_plan(model, _plan(Region(("1",))), check=check)
    assert "_memfit_wrap" not in model[1].__dict__ and applied_plan(model) is None
    with pytest.raises(error, match=message):
        wrap(model[1], check=check)
    with pytest.raises(ValueError, match="every must be an int >= 0, got -1"):
        DivergenceCheck(every=-1)


@pytest.mark.parametrize("tensor", [
    torch.randn(512, 256),                                 # contiguous, sampled
    torch.randn(4, 8, 64, 64).transpose(1, 2),             # strided, sampled per dimension
    torch.randn(7).to(torch.bfloat16),                     # under the sample size
    torch.tensor(3.0),                                     # 0-dim
], ids=["contiguous", "strided", "small", "0-dim"])
def test_a_cpu_fingerprint_allocates_no_tensor_memory(tensor):
    """A checked step peaks where an unchecked one does (NOTE [value check], rule 4): the old
    int64 sum cast the sample first, 520 B above the op's output."""
    from memfit.profiling.meters import allocator_peak
    from memfit.runtime.divergence import _sample, fingerprint

    assert allocator_peak(lambda: fingerprint(tensor)) == 0
    as_int = {2: torch.int16, 4: torch.int32}[tensor.element_size()]
    assert fingerprint(tensor) == int(_sample(tensor).view(as_int).sum(dtype=torch.int64))


@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "full-replay"])
def test_a_redrawn_value_saved_for_backward_is_caught_under_early_stop(early_stop: bool) -> None:
    """NOTE [value check], rule 6: the scalar ``torch.tensor(random.uniform(...))`` is made
    without grad and saved by the ``mul``; torch's early stop ends the replay right after
    making it, before the ``mul``. Its fingerprint is compared all the same."""
    x = torch.randn(4, requires_grad=True)

    def scaled(h: torch.Tensor) -> torch.Tensor:
        return h * torch.tensor(random.uniform(0.5, 1.5))

    random.seed(0)
    y = checkpoint(scaled, x, early_stop=early_stop)
    with pytest.raises(RecomputeMismatch, match=r"other values .*aten\.lift_fresh"):
        y.sum().backward()


def test_values_made_without_grad_that_replay_alike_pass() -> None:
    """Masks, counters and constants made off the differentiable path compare equal."""
    net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())
    ref = copy.deepcopy(net)

    def body(h: torch.Tensor) -> torch.Tensor:
        keep = (h.detach().abs() > 0.1).float()  # a mask made without grad
        return net(h) * keep * torch.tensor(2.0)

    x = torch.randn(16, 8, requires_grad=True)
    checkpoint(body, x, check="always").sum().backward()
    keep = (x.detach().abs() > 0.1).float()
    (ref(x) * keep * torch.tensor(2.0)).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_an_lstms_workspace_output_is_not_compared() -> None:
    """NOTE [value check], rule 5: ``mkldnn_rnn_layer``'s uint8 workspace holds bytes the
    kernel leaves unwritten; it is scratch for backward, not a value: no false mismatch, and
    the step is the plain one."""
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
    ref = copy.deepcopy(lstm)
    wrap(lstm, check="always")
    x = torch.randn(2, 5, 8)
    for _ in range(3):
        lstm.zero_grad()
        ref.zero_grad()
        lstm(x)[0].sum().backward()
        ref(x)[0].sum().backward()
        for p, q in zip(lstm.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)


_NOISE = [0]


@torch.library.custom_op("memfit_test::empty_noise", mutates_args=())
def _empty_noise(n: int) -> torch.Tensor:
    """Stands for ``aten.empty``: its name says it writes nothing, and what it holds differs
    from call to call, as freshly allocated memory does."""
    _NOISE[0] += 1
    return torch.full((n,), float(_NOISE[0]))


class GatherLike(nn.Module):
    """ZeRO-3's parameter gather in small: slices of a new buffer are taken before a copy
    fills each (NOTE [value check], rule 5); the result reads only filled values."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.fc.weight
        with torch.no_grad():  # as the gather: outside autograd
            buf = torch.ops.memfit_test.empty_noise(2 * w.numel())
            mine, theirs = buf[: w.numel()], buf[w.numel():]  # views of memory not yet written
            mine.copy_(w.reshape(-1))
            theirs.copy_(w.t().reshape(-1))
        gathered = buf.view(2, *w.shape)
        return torch.tanh(self.fc(x) + x @ gathered[0] + x @ gathered[1])


@pytest.mark.parametrize("entry", ENTRIES)
def test_views_of_memory_not_yet_written_are_not_compared(entry: str) -> None:
    model = nn.Sequential(nn.Linear(8, 8), GatherLike(), GatherLike())
    ref = copy.deepcopy(model)
    _install(entry, model, check="always")
    assert_bitwise_twin(model, ref, (torch.randn(4, 8, requires_grad=True),), steps=2)


def test_a_view_of_a_written_buffer_is_still_compared() -> None:
    """Once an op wrote into the buffer its views are values again: a re-drawn fill shows."""
    def body(h: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(2 * h.numel())
        buf.fill_(random.uniform(0.5, 1.5))  # written: views of buf are fingerprinted
        return h * buf[: h.numel()].view_as(h)

    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RecomputeMismatch, match=r"at op 1 \(aten\.fill_\.Scalar"):
        checkpoint(body, x, check="always").sum().backward()
