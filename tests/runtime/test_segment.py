"""memfit.runtime.segment: one checkpoint over consecutive blocks called from a Python loop."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from runtime_helpers import (
    CallCounter,
    ConvBNReLU,
    TinyGPT,
    assert_bitwise_twin,
    pair,
    tiny_gpt2,
    tiny_llama,
)
from torch import nn

from memfit.errors import RecomputeMismatch, WrapError
from memfit.runtime import policies as P
from memfit.runtime.segment import checkpoint_segment, segment_of
from memfit.runtime.wrap import wrap

POLICIES = {"none": None, "save_matmuls": P.save_matmuls(),
            # keys count over the whole segment: the 5th addmm is in the second block
            "keys": P.save_keys(["aten.addmm.default#5", "aten.bmm.default#0"])}


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_tiny_gpt_segment_bitwise(policy):
    model, twin = pair(TinyGPT)
    handle = checkpoint_segment(model.blocks, [0, 1], policy)
    counter = CallCounter(model.blocks[0].attn.qkv, model.blocks[1].attn.qkv)
    ids = torch.randint(0, 64, (2, 8))
    assert_bitwise_twin(model, twin, (ids,), steps=2)
    assert counter.count == 2 * 2 * 2  # 2 blocks x (forward + replay) x 2 steps
    handle.remove()
    counter.count = 0
    assert_bitwise_twin(model, twin, (ids,))
    assert counter.count == 2 and segment_of(model.blocks[0]) is None


class _Loop(nn.Module):
    """Blocks called in a loop, each getting the previous output and a shared extra tensor."""

    def __init__(self, blocks: list[nn.Module], between=None):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.between = between

    def forward(self, x, scale):
        for i, block in enumerate(self.blocks):
            x = block(x, scale=scale)
            if self.between is not None and i == 0:
                x = self.between(x)
        return x


class _Scaled(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(0.3)

    def forward(self, x, *, scale):
        return x + self.drop(torch.tanh(self.lin(x) * scale))


def test_kwargs_shared_tensor_and_input_without_grad():
    model, twin = pair(lambda: _Loop([_Scaled(), _Scaled(), _Scaled()]))
    checkpoint_segment(model.blocks, [0, 1, 2])
    scale = torch.rand(16, requires_grad=True)
    assert_bitwise_twin(model, twin, (torch.randn(4, 16), scale), steps=2)


def test_batchnorm_once_in_segment():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = ConvBNReLU(3, 8), ConvBNReLU(8, 8), ConvBNReLU(8, 8)

        def forward(self, x):
            return self.c(self.b(self.a(x))).mean((2, 3))

    model, twin = pair(Net)
    checkpoint_segment(model, ["a", "b"], P.save_ops("aten.native_batch_norm"))
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    assert_bitwise_twin(model, twin, (x,), steps=2)
    assert int(model.a.bn.num_batches_tracked) == 2


def test_parent_ops_between_blocks_cut_the_segment(caplog):
    # `x * 2` between blocks 0 and 1 saves nothing, so even the first step is exact.
    model, twin = pair(lambda: _Loop([_Scaled(), _Scaled()], between=lambda x: x * 2.0))
    handle = checkpoint_segment(model.blocks, [0, 1])
    scale = torch.rand(16)
    with caplog.at_level(logging.WARNING, logger="memfit.runtime.segment"):
        assert_bitwise_twin(model, twin, (torch.randn(4, 16, requires_grad=True), scale), steps=2)
    assert handle.cuts == {1}
    assert sum("the parent ran tensor ops" in r.message for r in caplog.records) == 1


def test_parent_ops_saving_tensors_are_outside_after_first_step():
    model, twin = pair(lambda: _Loop([_Scaled(), _Scaled()], between=torch.sin))  # sin saves x
    handle = checkpoint_segment(model.blocks, [0, 1])
    handle.cuts.add(1)  # as learned from an earlier step
    assert_bitwise_twin(model, twin, (torch.randn(4, 16, requires_grad=True), torch.rand(16)),
                        steps=2)


def test_divergence_check_in_segment():
    class Flip(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.flag = True

        def forward(self, x, *, scale):
            h = self.lin(x) * scale
            return (h.tanh() if self.flag else h.sigmoid()).exp()

    model = _Loop([Flip(), Flip()])
    checkpoint_segment(model.blocks, [0, 1], name="layers.0..1")
    y = model(torch.randn(2, 8, requires_grad=True), 1.0)
    model.blocks[1].flag = False
    with pytest.raises(RecomputeMismatch, match=r"layers\.0\.\.1 .*aten\.tanh\.default.*aten\.sigmoid"):
        y.sum().backward()


def test_eval_checkpoints_and_no_grad_runs_plainly():
    model = TinyGPT().eval()
    checkpoint_segment(model.blocks, [0, 2 - 1])
    counter = CallCounter(model.blocks[0].attn.qkv)
    ids = torch.randint(0, 64, (2, 8))
    model(ids).sum().backward()  # eval() with autograd recording: forward + recompute
    assert counter.count == 2
    model.train()
    with torch.no_grad():
        model(ids)
    assert counter.count == 3


def test_deepcopy_of_segmented_model():
    model, twin = pair(TinyGPT)
    checkpoint_segment(model.blocks, [1, 2], P.save_matmuls())
    copied = copy.deepcopy(model)
    assert segment_of(copied.blocks[1]) is not segment_of(model.blocks[1])
    counter = CallCounter(copied.blocks[1].attn.qkv)
    assert_bitwise_twin(copied, twin, (torch.randint(0, 64, (2, 8)),))
    assert counter.count == 2


def test_misuse_errors():
    model = TinyGPT()
    with pytest.raises(WrapError, match="consecutive"):
        checkpoint_segment(model.blocks, [0, 2])
    with pytest.raises(WrapError, match="no child 'x'"):
        checkpoint_segment(model.blocks, ["x"])
    with pytest.raises(WrapError, match="out of range"):
        checkpoint_segment(model.blocks, [5])
    wrap(model.blocks[0])
    with pytest.raises(WrapError, match="already checkpointed"):
        checkpoint_segment(model.blocks, [0, 1])
    checkpoint_segment(model.blocks, [1, 2])
    with pytest.raises(WrapError, match="make the segment first"):
        checkpoint_segment(model.blocks, [0])
    wrap(model.blocks[2])  # a block checkpointed inside its segment (NOTE [nested segments])
    with pytest.raises(WrapError, match="already wrapped"):
        wrap(model.blocks[2])


def _hf_step(model, inputs, seed):
    torch.manual_seed(seed)
    out = model(input_ids=inputs[0], labels=inputs[0], use_cache=False)
    out.loss.backward()
    return out.logits, out.loss


HF = {"llama": (tiny_llama, "model.layers"), "gpt2": (tiny_gpt2, "transformer.h")}


@pytest.mark.hf
@pytest.mark.parametrize("policy", [None, P.save_matmuls()], ids=["none", "save_matmuls"])
@pytest.mark.parametrize("arch", HF.keys())
def test_hf_two_layer_segment(arch, policy):
    pytest.importorskip("transformers")
    factory, path = HF[arch]
    model, twin = pair(factory)
    layers = model.get_submodule(path)
    handle = checkpoint_segment(layers, [0, 1], policy)
    counter = CallCounter(*layers)
    assert_bitwise_twin(model, twin, (torch.randint(0, 128, (2, 16)),), steps=2, run=_hf_step)
    assert counter.count == 2 * 2 * 2 and not handle.cuts
