"""memfit.runtime.wrap: in-place checkpointing of submodules, bitwise against a plain twin."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from runtime_helpers import (
    CallCounter,
    ConvBNReLU,
    GPTBlock,
    assert_bitwise_twin,
    conv_net,
    pair,
    residual_stack,
    tiny_gpt2,
    tiny_llama,
)
from torch import nn

from memfit.errors import RecomputeMismatch, WrapError
from memfit.runtime import policies as P
from memfit.runtime.wrap import is_wrapped, unwrap, wrap

POLICIES = {"none": None, "save_matmuls": P.save_matmuls(),
            "keys": P.save_keys(["aten.addmm.default#0", "aten.native_layer_norm.default#0"])}


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_residual_stack(policy):
    model, twin = pair(residual_stack)
    for block in model[:3]:
        wrap(block, policy)
    counter = CallCounter(model[0].fc1)
    assert_bitwise_twin(model, twin, (torch.randn(8, 16, requires_grad=True),), steps=2)
    assert counter.count == 4  # 2 steps x (forward + recomputation)


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_gpt_like_blocks_with_attention_dropout(policy):
    model, twin = pair(lambda: nn.Sequential(GPTBlock(), GPTBlock()))
    wrap(model[0], policy)
    wrap(model[1].attn, policy)  # a nested submodule
    assert_bitwise_twin(model, twin, (torch.randn(2, 8, 32, requires_grad=True),), steps=2)


@pytest.mark.parametrize("policy", [None, P.save_ops("aten.convolution")], ids=["none", "convs"])
def test_conv_bn_relu_statistics_once(policy):
    model, twin = pair(conv_net)
    wrap(model[0], policy)
    wrap(model[1], policy)
    bn = model[0].bn
    for steps in (1, 2):  # compared after step 1 and after step 2
        assert_bitwise_twin(model, twin, (torch.randn(4, 3, 8, 8, requires_grad=True),),
                            steps=1)
        assert int(bn.num_batches_tracked) == steps
        assert torch.equal(bn.running_mean, twin[0].bn.running_mean)
        assert torch.equal(bn.running_var, twin[0].bn.running_var)


def test_torch_checkpoint_updates_batchnorm_twice():
    """The bug memfit fixes: plain torch checkpoint counts the batch twice."""
    torch.manual_seed(0)
    block = ConvBNReLU()
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum().backward()
    assert int(block.bn.num_batches_tracked) == 2
    wrap(block)
    block(x).sum().backward()
    assert int(block.bn.num_batches_tracked) == 3


def test_batchnorm_once_with_policy_saving_batch_norm():
    model, twin = pair(lambda: nn.Sequential(ConvBNReLU(), ConvBNReLU(8, 8)))
    wrap(model[0], P.save_ops("aten.native_batch_norm", "aten.convolution"))
    assert_bitwise_twin(model, twin, (torch.randn(2, 3, 8, 8, requires_grad=True),), steps=2)


def test_eval_checkpoints_no_grad_and_frozen_run_plainly():
    model = wrap(GPTBlock())
    counter = CallCounter(model.attn.qkv)
    x = torch.randn(2, 8, 32)
    model.eval()
    model(x).sum().backward()  # eval() with autograd recording: forward + recompute
    assert counter.count == 2
    model.train()
    with torch.no_grad():
        model(x)
    model.requires_grad_(False)
    model(x)  # nothing requires grad
    assert counter.count == 4
    model.requires_grad_(True)
    model(x).sum().backward()
    assert counter.count == 6


def test_state_dict_parameters_deepcopy_pickle_repr():
    plain = GPTBlock()
    model = copy.deepcopy(plain)
    wrap(model.attn, P.save_matmuls())
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert "memfit.checkpoint(Attention)" in repr(model)
    copied = copy.deepcopy(model)
    assert is_wrapped(copied.attn) and copied.attn.forward.module is copied.attn
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    restored = pickle.loads(pickle.dumps(model))
    x = torch.randn(2, 8, 32, requires_grad=True)
    for other in (copied, loaded, restored):
        assert is_wrapped(other.attn)
        counter = CallCounter(other.attn.qkv)
        torch.manual_seed(0)
        y = other(x)
        y.sum().backward()
        assert counter.count == 2
        torch.manual_seed(0)
        assert torch.equal(y, plain(x))
    unwrap(model.attn)
    assert "memfit" not in repr(model) and "forward" not in model.attn.__dict__


def test_double_wrap_and_unwrap_errors():
    block = wrap(GPTBlock(), P.save_matmuls())
    with pytest.raises(WrapError, match="already wrapped"):
        wrap(block, P.save_matmuls())
    unwrap(block)
    with pytest.raises(WrapError, match="not wrapped"):
        unwrap(block)
    with pytest.raises(TypeError, match="nn.Module"):
        wrap(lambda x: x)
    with pytest.raises(ValueError, match="aten.nope"):
        wrap(block, {"aten.nope"})
    assert not is_wrapped(block)


def test_instance_forward_is_kept():
    lin = nn.Linear(4, 4)
    lin.forward = lambda x: nn.Linear.forward(lin, x) * 2  # set by someone before memfit
    wrap(lin)
    x = torch.randn(2, 4, requires_grad=True)
    assert torch.equal(lin(x), nn.functional.linear(x, lin.weight, lin.bias) * 2)
    unwrap(lin)
    assert torch.equal(lin(x), nn.functional.linear(x, lin.weight, lin.bias) * 2)


def test_divergence_names_module():
    class Flip(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.flag = True

        def forward(self, x):
            h = self.lin(x)
            return (h.tanh() if self.flag else h.sigmoid()).exp()

    model = nn.Sequential(Flip())
    wrap(model[0], name="encoder.0")
    y = model(torch.randn(2, 4, requires_grad=True))
    model[0].flag = False
    with pytest.raises(RecomputeMismatch, match=r"encoder\.0 .*aten\.tanh\.default.*aten\.sigmoid\.default"):
        y.sum().backward()


def _hf_step(model, inputs, seed):
    torch.manual_seed(seed)
    ids = inputs[0]
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.logits, out.loss


HF = {"llama": (tiny_llama, "model.layers"), "gpt2": (tiny_gpt2, "transformer.h")}


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("policy", [None, P.save_matmuls()], ids=["none", "save_matmuls"])
@pytest.mark.parametrize("arch", HF.keys())
def test_hf_each_layer_wrapped(arch, policy):
    pytest.importorskip("transformers")
    factory, layers_path = HF[arch]
    model, twin = pair(factory)
    layers = model.get_submodule(layers_path)
    for layer in layers:
        wrap(layer, policy)
    ids = torch.randint(0, 128, (2, 16))
    assert_bitwise_twin(model, twin, (ids,), steps=2, run=_hf_step)


@pytest.mark.hf
def test_hf_llama_autocast_bf16():
    pytest.importorskip("transformers")
    model, twin = pair(tiny_llama)
    for layer in model.model.layers:
        wrap(layer, P.save_matmuls())

    def run(m, inputs, seed):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _hf_step(m, inputs, seed)

    assert_bitwise_twin(model, twin, (torch.randint(0, 128, (2, 16)),), run=run)
