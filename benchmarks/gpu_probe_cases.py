"""The pieces ``benchmarks.gpu_probe`` and its helpers share: the cases (model, inputs, loss),
memfit's fake-mode profile of a case, and the torch-only step, peak, op timer and whole-region
checkpointing a GPU without memfit runs.

``gpu_probe`` (the command), ``gpu_probe_memory`` (its memory runs on the GPU),
``gpu_probe_report`` (its report) and ``gpu_largest_batch`` import from here; this module imports
none of them, so the four form no import cycle.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

GB = 10**9


@dataclasses.dataclass
class Case:
    name: str
    description: str
    build: Callable[[torch.device], nn.Module]
    inputs: Callable[[torch.device], tuple[Any, ...]]
    loss_fn: Callable[[Any], torch.Tensor]


def _sum_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().sum()


def _square_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def resnet50(device: torch.device, stages: tuple[int, ...], classes: int) -> nn.Module:
    """``benchmarks.published.resnet50``, on ``device`` and seeded (meta: as built)."""
    from benchmarks.published import resnet50

    model = resnet50(num_classes=classes, stages=stages)
    if device.type == "meta":
        return model
    torch.manual_seed(0)
    model = model.to_empty(device=device)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()  # BatchNorm's resets its running statistics too
    return model


def cases(quick: bool) -> list[Case]:
    """MONeT's ResNet-50 (batch 184, fp32), then ``benchmarks.gpu_fake_check``'s cases."""
    from benchmarks import gpu_fake_check

    stages, batch, side, classes = ((1, 1, 1, 1), 4, 64, 10) if quick else ((3, 4, 6, 3), 184, 224, 1000)
    out = [Case("resnet50", f"ResNet-50 (stages {stages}), fp32, batch {batch}, {side}x{side} (MONeT's setting)",
                lambda dev: resnet50(dev, stages, classes),
                lambda dev: (torch.randn(batch, 3, side, side, device=dev, generator=None),),
                _square_loss)]
    for c in gpu_fake_check._cases(quick):
        def build(dev: torch.device, c: Any = c) -> nn.Module:
            torch.manual_seed(0)
            with torch.device(dev):
                return c.build()
        out.append(Case(c.name, c.description, build, c.inputs, c.loss_fn))
    out.append(llama_case(quick))
    return out


def llama_case(quick: bool, batch: int | None = None) -> Case:
    """An HF Llama fine-tune: bf16, SDPA attention (HF's default), no dropout, GQA."""
    h, layers, heads, kv, seq, default_batch, vocab = ((64, 2, 4, 2, 64, 2, 256) if quick else
                                                       (2048, 8, 16, 4, 2048, 4, 32000))
    batch = batch or default_batch

    def build(dev: torch.device) -> nn.Module:
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import LlamaConfig, LlamaForCausalLM

        from benchmarks.models import _LlamaStep

        cfg = LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=int(2.75 * h),
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                          max_position_embeddings=seq, use_cache=False)
        torch.manual_seed(0)
        with torch.device(dev):
            return _LlamaStep(LlamaForCausalLM(cfg).to(torch.bfloat16))

    def inputs(dev: torch.device) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(0)
        return (torch.randint(0, vocab, (batch, seq), generator=g).to(dev),)

    return Case("hf-llama", f"HF LlamaForCausalLM {layers}x{h}, {heads} heads ({kv} KV), bf16, SDPA, "
                f"seq {seq}, batch {batch}, vocab {vocab}, labels = inputs", build, inputs,
                lambda out: out.loss)


# ---- here: fake-mode profiles ----------------------------------------------------------------

def fake_profile(case: Case, target: str) -> Any:
    import memfit

    model = case.build(torch.device("meta"))
    return memfit.profile(model, case.inputs(torch.device("meta")), loss_fn=case.loss_fn,
                          mode="fake", target=target)


# ---- on the GPU: torch only ------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class OpTimes:
    """Every aten op of a step with its time: CUDA events around it (CPU: wall clock)."""

    def __init__(self, device: torch.device) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        self.device, self.phase = device, "forward"
        self.rows: list[list[Any]] = []  # [op name, phase, (start, end) events or seconds]
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if outer.device.type == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    out = func(*args, **(kwargs or {}))
                    end.record()
                    outer.rows.append([str(func), outer.phase, (start, end)])
                else:
                    t0 = time.perf_counter()
                    out = func(*args, **(kwargs or {}))
                    outer.rows.append([str(func), outer.phase, time.perf_counter() - t0])
                return out

        self.mode = Mode()

    def seconds(self) -> list[tuple[str, str, float]]:
        sync(self.device)
        return [(n, ph, t[0].elapsed_time(t[1]) / 1e3 if isinstance(t, tuple) else t)
                for n, ph, t in self.rows]


class _Checkpointed(nn.Module):
    """Runs ``modules`` (consecutive siblings) in order under one non-reentrant checkpoint."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.inner = nn.ModuleList(modules)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        x = self.inner[0](*args, **kwargs)  # keyword arguments: a lone module's (HF layers')
        for m in self.inner[1:]:
            x = m(x)
        return x

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self._run, *args, use_reentrant=False, **kwargs)


def checkpoint_regions(model: nn.Module, regions: list[list[str]]) -> nn.Module:
    """``model`` with each region (module paths: one, or consecutive siblings) checkpointed."""
    for paths in regions:
        parent_path, _, first = paths[0].rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        names = [p.rpartition(".")[2] for p in paths]
        wrapped = _Checkpointed([parent.get_submodule(n) for n in names])
        if len(names) == 1:
            setattr(parent, first, wrapped)
            continue
        if not isinstance(parent, nn.Sequential):
            raise TypeError(f"a run of siblings under {parent_path!r} ({type(parent).__name__}) "
                            "needs an nn.Sequential parent here")
        kept = [(n, m) for n, m in parent.named_children() if n not in names[1:]]
        for n, _ in list(parent.named_children()):
            delattr(parent, n)
        for n, m in kept:
            parent.add_module(n, wrapped if n == first else m)
    return model


def train_step(case: Case, model: nn.Module, inputs: tuple[Any, ...]) -> None:
    """Forward, loss, backward, the output referenced through backward as in a usual training
    loop (``out = model(x); loss_fn(out).backward()``) and as memfit's profile counts it."""
    out = model(*inputs)
    case.loss_fn(out).backward()
    del out


def peak_bytes(step: Callable[[], None], model: nn.Module, device: torch.device) -> int | None:
    for p in model.parameters():
        p.grad = None  # the profile counts the gradients backward allocates
    gc.collect()
    if device.type != "cuda":
        step()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
