"""Small models and a bitwise twin comparison shared by the runtime tests."""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Bottleneck(nn.Module):
    """torchvision's ResNet-50 block: the residual (a 1x1 conv and norm with ``downsample``)
    added in place into bn3's output, then one in-place relu module (also after bn1 and bn2)."""

    def __init__(self, c: int, mid: int, downsample: bool = False) -> None:
        super().__init__()
        out = c * 2 if downsample else c
        self.conv1 = nn.Conv2d(c, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (nn.Sequential(nn.Conv2d(c, out, 1, bias=False), nn.BatchNorm2d(out))
                           if downsample else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        out += identity
        return self.relu(out)


class Residual(nn.Module):
    """x + Linear(GELU(Linear(LayerNorm(x)))) with dropout: an MLP block of a transformer."""

    def __init__(self, d: int = 16, p: float = 0.2) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln(x)))))


class Attention(nn.Module):
    """Causal self-attention with attention dropout, written out (bmm, softmax, masked_fill)."""

    def __init__(self, d: int = 32, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)                        # (b, t, d) each
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)    # (b, h, t, t)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)                # (b, t, d)
        return self.proj(y)


class GPTBlock(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, p)
        self.mlp = Residual(d, p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return self.mlp(x)


class TinyGPT(nn.Module):
    """Embedding, blocks called from a Python loop (as Hugging Face does), head."""

    def __init__(self, vocab: int = 64, d: int = 32, n_layer: int = 3, p: float = 0.1) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(GPTBlock(d, 4, p) for _ in range(n_layer))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


class ConvBNReLU(nn.Module):
    def __init__(self, c_in: int = 3, c: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


def conv_net() -> nn.Sequential:
    return nn.Sequential(ConvBNReLU(3, 8), ConvBNReLU(8, 8), ConvBNReLU(8, 8),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def residual_stack(n: int = 4, d: int = 16) -> nn.Sequential:
    return nn.Sequential(*(Residual(d) for _ in range(n)))


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="eager", attention_dropout=0.1)
    return LlamaForCausalLM(cfg)


def tiny_gpt2() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  attn_implementation="eager", bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def seeded(factory: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return factory().train()


def _to_tensor_out(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "loss") and out.loss is not None:
        return out.loss
    raise TypeError(type(out))


def step(model: nn.Module, inputs: tuple, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One seeded step: forward, loss, backward. Returns (output, loss)."""
    torch.manual_seed(seed)
    out = model(*inputs)
    out = _to_tensor_out(out)
    loss = out.float().square().mean() if out.dim() else out
    loss.backward()
    return out, loss


def clone_inputs(inputs: tuple) -> tuple:
    return tuple(
        x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
        for x in inputs
    )


def assert_bitwise_twin(
    model: nn.Module,
    twin: nn.Module,
    inputs: tuple,
    *,
    steps: int = 1,
    run: Callable[[nn.Module, tuple, int], tuple[torch.Tensor, torch.Tensor]] = step,
) -> None:
    """Run ``steps`` seeded steps on both; outputs, loss, input/param grads, buffers equal."""
    for s in range(steps):
        a_in, b_in = clone_inputs(inputs), clone_inputs(inputs)
        out_a, loss_a = run(model, a_in, s)
        out_b, loss_b = run(twin, b_in, s)
        assert torch.equal(out_a, out_b), f"step {s}: outputs differ"
        assert torch.equal(loss_a, loss_b), f"step {s}: loss differs"
        for i, (x, y) in enumerate(zip(a_in, b_in, strict=True)):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                assert torch.equal(x.grad, y.grad), f"step {s}: grad of input {i} differs"
        pa, pb = dict(model.named_parameters()), dict(twin.named_parameters())
        assert pa.keys() == pb.keys()
        for name in pa:
            ga, gb = pa[name].grad, pb[name].grad
            assert (ga is None) == (gb is None), f"step {s}: grad presence of {name} differs"
            if ga is not None:
                assert torch.equal(ga, gb), f"step {s}: grad of {name} differs"
        ba, bb = dict(model.named_buffers()), dict(twin.named_buffers())
        assert ba.keys() == bb.keys()
        for name in ba:
            assert torch.equal(ba[name], bb[name]), f"step {s}: buffer {name} differs"


def pair(factory: Callable[[], nn.Module], seed: int = 0) -> tuple[nn.Module, nn.Module]:
    model = seeded(factory, seed)
    return model, copy.deepcopy(model)


class CallCounter:
    """Counts forward calls of modules (forward pre-hooks), to prove a region was recomputed."""

    def __init__(self, *modules: nn.Module) -> None:
        self.count = 0
        self._handles = [m.register_forward_pre_hook(self._hook) for m in modules]

    def _hook(self, module: nn.Module, args: Any) -> None:
        self.count += 1

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def dispatch_counter(monkeypatch: Any, mode: type) -> list[int]:
    """How many ops go through ``mode.__torch_dispatch__`` from now on (``[count]``, live)."""
    seen = [0]
    real = mode.__torch_dispatch__

    def counting(self: Any, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        seen[0] += 1
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(mode, "__torch_dispatch__", counting)
    return seen
