"""Every optimizer in torch.optim counted (NOTE [optimizer memory on fake tensors], NOTE [states
made before the first step]): the states predicted on fake tensors equal, to the byte, the
states one real step leaves; an optimizer memfit cannot count is refused in one line."""

from __future__ import annotations

import inspect

import pytest
import torch

import memfit
from memfit.planning.job import OptimizerMemory
from memfit.profiling.optimizer import UNCOUNTABLE, optimizer_memory

# Every optimizer class torch.optim defines, read from the module: a new one joins the test.
ALL = sorted(n for n, c in vars(torch.optim).items()
             if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer)


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "SparseAdam":  # sparse gradients only
        return torch.nn.Sequential(torch.nn.Embedding(10, 6, sparse=True))
    bias = name != "Muon"  # Muon takes matrices only
    return torch.nn.Sequential(torch.nn.Linear(8, 16, bias=bias), torch.nn.GELU(),
                               torch.nn.Linear(16, 4, bias=bias))


def _inputs(name: str) -> torch.Tensor:
    return torch.tensor([[1, 3, 3, 7]]) if name == "SparseAdam" else torch.randn(3, 8)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages of every tensor in ``opt.state``."""
    seen: dict[int, int] = {}
    for s in opt.state.values():
        for t in s.values():
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def test_the_list_is_torch_optims_own():
    assert {"Adafactor", "Adagrad", "AdamW", "ASGD", "LBFGS", "SGD", "SparseAdam"} <= set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_predicted_states_are_the_states_of_one_real_step(name):
    model = _model(name)
    opt = getattr(torch.optim, name)(model.parameters())
    if name in UNCOUNTABLE:
        with pytest.raises(ValueError, match=f"cannot count the memory of optimizer {name}: ") as e:
            optimizer_memory(opt)
        assert "\n" not in str(e.value) and "OptimizerMemory(" in str(e.value)
        return
    before = _state_bytes(opt)  # Adagrad's states exist from its constructor
    predicted = optimizer_memory(opt)
    assert _state_bytes(opt) == before  # the prediction stepped a twin, not opt
    model(_inputs(name)).sum().backward()
    opt.step()
    real = _state_bytes(opt)
    assert real > 0 or name == "SGD"  # SGD without momentum keeps nothing
    assert predicted.state_bytes == real


def test_adagrad_counts_its_constructors_states_in_a_plan():
    model = _model("Adagrad")
    x = _inputs("Adagrad")
    opt = torch.optim.Adagrad(model.parameters())
    weights = sum(p.numel() * 4 for p in model.parameters())  # 848 B
    prof = memfit.profile(model, x)
    p = memfit.plan(prof, memfit.Job(device="16MiB", optimizer=opt))
    assert p.memory is not None
    # state_sum (one model's size) + one 4-byte step counter per parameter tensor
    assert p.memory.optimizer_bytes == weights + 4 * 4 == 864


def test_a_class_of_yours_that_reads_values_is_refused_in_one_line():
    class ClippedSGD(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    scale = min(1.0, 1.0 / float(p.grad.norm()))  # a value read on the host
                    p.add_(p.grad, alpha=-g["lr"] * scale)

    opt = ClippedSGD(_model("ClippedSGD").parameters())
    with pytest.raises(ValueError, match="cannot count the memory of optimizer ClippedSGD: running it "
                                         "on fake tensors raised") as e:
        optimizer_memory(opt)
    assert "\n" not in str(e.value) and "OptimizerMemory(" in str(e.value)
    own = OptimizerMemory("ClippedSGD", 0, 64)
    assert optimizer_memory(own) is own  # your own count, as given
    with pytest.raises(ValueError, match="count of its own"):
        optimizer_memory(own, master_weights=True)
