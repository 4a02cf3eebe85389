"""memfit._torch: every private torch API memfit uses works on this torch, and no other module
of memfit touches one (NOTE [private torch APIs] in memfit._torch)."""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import logging
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from memfit import _torch as T
from memfit.errors import MemfitError, UnsupportedTorch

SRC = Path(__file__).resolve().parents[1] / "src" / "memfit"
aten = torch.ops.aten


# ---- one exercise per public name of memfit._torch ---------------------------------------
def _supported_torch() -> None:
    assert T.SUPPORTED_TORCH == ">=2.9,<2.16"
    assert (2, 9) <= T.torch_release(torch.__version__) < (2, 16)
    # the range pyproject.toml declares is this one
    pyproject = (SRC.parents[1] / "pyproject.toml").read_text()
    assert re.findall(r'"torch([<>=!~][^"]*)"', pyproject) == [T.SUPPORTED_TORCH]


def _require_supported_torch() -> None:
    assert T.require_supported_torch() is None  # this torch (the refusals: tests below)


def _torch_dispatch_mode() -> None:
    class Names(T.TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    with Names() as mode:
        torch.ones(2, 2).mm(torch.ones(2, 2))
    assert "aten.mm.default" in mode.names


def _fake_tensor_mode() -> None:
    with T.FakeTensorMode():
        t = torch.empty(3, 5)
    assert type(t).__name__ == "FakeTensor"
    assert t.shape == (3, 5) and t.untyped_storage().nbytes() == 60


def _fake_tensor_logger() -> None:
    # the logger the fake-tensor module logs its failing ops to
    module = sys.modules[T.FakeTensorMode.__module__]
    assert T.FakeTensorMode.__module__ == T.FAKE_TENSOR_LOGGER
    assert module.log is logging.getLogger(T.FAKE_TENSOR_LOGGER)


def _op_overload() -> None:
    assert isinstance(aten.mm.default, T.OpOverload)
    assert not isinstance(aten.mm, T.OpOverload)


def _op_overload_packet() -> None:
    assert isinstance(aten.mm, T.OpOverloadPacket)
    assert not isinstance(aten.mm.default, T.OpOverloadPacket)


def _tree_flatten() -> None:
    a, b = torch.ones(1), torch.zeros(2)
    leaves, _ = T.tree_flatten({"x": [a, 3], "y": (b,)})
    assert leaves[0] is a and leaves[1] == 3 and leaves[2] is b


def _tree_map() -> None:
    out = T.tree_map(lambda v: v * 2, {"x": [1, 2], "y": (3,)})
    assert out == {"x": [2, 4], "y": (6,)}


def _op_schema() -> None:
    schema = T.op_schema(aten.add_.Tensor)
    assert schema.name == "aten::add_"
    assert schema.arguments[0].alias_info.is_write
    assert T.op_schema(len) is None


def _op_packet() -> None:
    assert T.op_packet(aten.mm.default) is aten.mm
    assert T.op_packet(aten.add.out).__name__ == "add"


def _op_namespace() -> None:
    assert T.op_namespace(aten.mm.default) == "aten"
    assert T.op_namespace(torch.ops.prim.device.default) == "prim"


def _written_tensors() -> None:
    a, b, out = torch.ones(2), torch.ones(2), torch.empty(2)
    assert [t is a for t in T.written_tensors(aten.add_.Tensor, (a, b), {})] == [True]
    assert [t is out for t in T.written_tensors(aten.add.out, (a, b), {"out": out})] == [True]
    assert T.written_tensors(aten.add.Tensor, (a, b), {}) == []
    assert T.written_tensors(len, (a,), {}) == []


def _storage_key() -> None:
    a, b = torch.ones(4), torch.ones(4)
    assert T.storage_key(a.untyped_storage()) == T.storage_key(a[1:].untyped_storage())
    assert T.storage_key(a.untyped_storage()) != T.storage_key(b.untyped_storage())
    assert isinstance(T.storage_key(a.untyped_storage()), int)


def _is_view_tensor() -> None:
    a = torch.zeros(4)
    assert T.is_view_tensor(a[1:]) and T.is_view_tensor(a.view(2, 2))
    assert not T.is_view_tensor(a) and not T.is_view_tensor(a.clone())


def _tensor_version() -> None:
    t = torch.zeros(2)
    before = T.tensor_version(t)
    t.add_(1)
    t[0] = 5
    assert T.tensor_version(t) == before + 2


def _check_batch_norm_input() -> None:
    T.check_batch_norm_input(nn.BatchNorm2d(3), torch.zeros(2, 3, 4, 4))
    with pytest.raises(ValueError, match="expected 4D input"):
        T.check_batch_norm_input(nn.BatchNorm2d(3), torch.zeros(2, 3))


def _runs_batch_norm_forward() -> None:
    assert T.runs_batch_norm_forward(nn.BatchNorm2d(3)) and T.runs_batch_norm_forward(nn.BatchNorm3d(3))
    assert not T.runs_batch_norm_forward(nn.SyncBatchNorm(3))
    assert not T.runs_batch_norm_forward(nn.LayerNorm(3))


def _module_buffers() -> None:
    bn = nn.BatchNorm1d(3)
    slots = T.module_buffers(bn)
    assert set(slots) == {"running_mean", "running_var", "num_batches_tracked"}
    new = torch.full((3,), 7.0)
    slots["running_mean"] = new  # the live dict: the module sees the replacement
    assert bn.running_mean is new
    assert "running_mean" in bn.state_dict()


def _module_parameters() -> None:
    lin = nn.Linear(2, 3)
    slots = T.module_parameters(lin)
    assert set(slots) == {"weight", "bias"}
    new = torch.zeros(3, 2, requires_grad=True)
    slots["weight"] = new  # the live dict, as functional_call replaces it
    assert lin.weight is new


def _sac_rearm() -> None:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def keep_mm(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
        return (CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default
                else CheckpointPolicy.PREFER_RECOMPUTE)

    caching, cached = create_selective_checkpoint_contexts(keep_mm)
    x = torch.randn(3, 3, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(lambda t: (t @ t).sin(), x, use_reentrant=False,
                                            context_fn=lambda: (caching, cached))
    out.sum().backward(retain_graph=True)
    if not T.SAC_INDEXED:  # the queued layout: memfit's QueuedEntries do it (tests/runtime)
        assert T.sac_rearm(cached) == 0
        return
    assert T.sac_rearm(cached) == 1  # the mm's entry, consumed by the replay
    out.sum().backward()  # recomputes the mm instead of "Trying to backward an extra time"


def _hooked() -> tuple[nn.Module, list[str], object, object]:
    lin, calls = nn.Linear(2, 2), []

    def plain(m, args):
        calls.append("plain")

    def with_kwargs(m, args, kwargs):
        calls.append("kwargs")

    first = lin.register_forward_pre_hook(plain)
    second = lin.register_forward_pre_hook(with_kwargs, with_kwargs=True)
    return lin, calls, first, second


def _forward_pre_hooks() -> None:
    lin, _, first, second = _hooked()
    hooks = T.forward_pre_hooks(lin)
    assert list(hooks) == [first.id, second.id]
    assert [h.__name__ for h in hooks.values()] == ["plain", "with_kwargs"]


def _forward_pre_hook_takes_kwargs() -> None:
    lin, _, first, second = _hooked()
    assert not T.forward_pre_hook_takes_kwargs(lin, first.id)
    assert T.forward_pre_hook_takes_kwargs(lin, second.id)


def _remove_forward_pre_hook() -> None:
    lin, calls, first, second = _hooked()
    T.remove_forward_pre_hook(lin, second.id)  # a with_kwargs hook: both records go
    T.remove_forward_pre_hook(lin, first.id)
    lin(torch.ones(1, 2))
    assert calls == [] and T.forward_pre_hooks(lin) == {}
    lin, calls, first, second = _hooked()
    T.remove_forward_pre_hook(lin, first.id)
    lin(torch.ones(1, 2))
    assert calls == ["kwargs"]


def _set_display_name() -> None:
    lin = nn.Linear(2, 2)
    T.set_display_name(lin, lambda: "Renamed")
    assert repr(lin).startswith("Renamed(")
    assert copy.deepcopy(lin) is not None


def _clear_display_name() -> None:
    lin = nn.Linear(2, 2)
    T.set_display_name(lin, lambda: "Renamed")
    T.clear_display_name(lin)
    assert repr(lin).startswith("Linear(")
    T.clear_display_name(lin)  # a module never renamed: nothing to undo


def _current_autograd_node() -> None:
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            seen.append(T.current_autograd_node())
            return g

    x = torch.ones(2, requires_grad=True)
    y = Probe.apply(x)
    assert T.current_autograd_node() is None
    y.sum().backward()
    assert len(seen) == 1 and seen[0] is not None
    assert type(seen[0]).__name__ == type(y.grad_fn).__name__


def _node_sequence_nr() -> None:
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    z = y + 1
    assert T.node_sequence_nr(z.grad_fn) == T.node_sequence_nr(y.grad_fn) + 1


def _peek_sequence_nr() -> None:
    x = torch.ones(2, requires_grad=True)
    s = T.peek_sequence_nr()
    y = x * 2  # the next node created on this thread gets s
    assert T.node_sequence_nr(y.grad_fn) == s
    assert T.peek_sequence_nr() == s + 1


def _no_python_dispatch() -> None:
    class Count(T.TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        torch.ones(2).sum()
        seen = Count.n
        with T.no_python_dispatch():
            torch.ones(2).sum()
    assert seen == 2 and Count.n == 2


def _without_dispatch_modes() -> None:
    class Count(T.TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        torch.ones(2).sum()
        with T.without_dispatch_modes():
            torch.ones(2).sum()
        torch.ones(2).sum()  # the mode is back
    assert Count.n == 4


def _outer_saved_tensors_hooks() -> None:
    def pack(t):
        return t

    def unpack(t):
        return t

    assert T.outer_saved_tensors_hooks() is None
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert T.outer_saved_tensors_hooks() == (pack, unpack)
    assert T.outer_saved_tensors_hooks() is None


def _mm_then_written(forget: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A selective checkpoint saving mm, whose output the forward then writes in place."""
    from memfit.runtime.policies import save_ops
    from memfit.runtime.region_policy import RegionPolicy

    # memfit's policy: on torch's queued layout it answers the replay from the forward's
    # decisions and knows each entry's position (NOTE [selective-checkpoint layouts])
    policy = RegionPolicy(save_ops("aten.mm"))
    caching, cached = T.selective_checkpoint_contexts(policy)
    policy.storage = caching.storage  # no caching_mode: the policy must not forget by itself

    forward = [True]  # the replay runs fn again: forget in the forward only

    def fn(x, w):
        h = torch.mm(x, w)
        if forget and forward:
            forward.pop()
            position = policy.positions.pop(("aten.mm.default", 0), None)
            assert T.sac_forget(caching, aten.mm.default, 0, position)
        h.mul_(2)
        return h.sin()

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(fn, x, w, use_reentrant=False,
                                            context_fn=lambda: (caching, cached))
    out.sum().backward()
    return x.grad, w.grad


def _policy_calls() -> tuple[list[bool], list[Any]]:
    """(is_recompute per policy call, op_output per forward call) of one selective region."""
    recompute, outputs = [], []

    def keep_mm(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
        recompute.append(T.sac_is_recompute(ctx))
        if not T.sac_is_recompute(ctx):
            outputs.append(T.sac_op_output(ctx))
        return op is aten.mm.default

    x = torch.randn(3, 3, requires_grad=True)
    torch.utils.checkpoint.checkpoint(
        lambda t: (t @ t).sin(), x, use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, keep_mm)).sum().backward()
    return recompute, outputs


def _sac_indexed() -> None:
    # NOTE [selective-checkpoint layouts]: the indexed layout asks the policy in the forward
    # only; the queued one asks again in the recomputation
    recompute, _ = _policy_calls()
    assert recompute[:2] == [False, False]
    assert any(recompute) is (not T.SAC_INDEXED)
    assert T.SAC_INDEXED is (T.feature_problems()["offload"] is None)


def _sac_op_output() -> None:
    _, outputs = _policy_calls()
    assert len(outputs) == 2 and all((o is not None) is T.SAC_OP_OUTPUT for o in outputs)


def _queued_entries() -> None:
    entries = T.QueuedEntries()
    entries.extend(["a", "b", "c"])
    entries.cursor = 1
    assert entries.pop(0) == "b" and entries.cursor is None  # the policy's occurrence
    assert len(entries) == 2 and list(entries) == ["a", None, "c"]  # a hole keeps positions
    assert entries.pop(0) == "a" and entries.pop(0) == "c"  # torch's own order otherwise
    assert len(entries) == 0 and not entries


def _selective_checkpoint_contexts() -> None:
    caching, cached = T.selective_checkpoint_contexts(lambda *a, **k: False)
    assert caching.storage is cached.storage
    assert all(isinstance(caching.storage[op], T.AnyOccurrenceRecomputed) for op in T.PROFILER_OPS) \
        is T.SAC_INDEXED
    if not T.SAC_INDEXED:
        assert isinstance(caching.storage[aten.mm.default], T.QueuedEntries)


def _any_occurrence_recomputed() -> None:
    entries = T.AnyOccurrenceRecomputed()
    if T.SAC_INDEXED:
        assert entries.get(7) is torch.utils.checkpoint._RECOMPUTE
    storage: dict[Any, Any] = {}
    T.sac_ignore_profiler_ops(storage)
    assert sorted(map(str, storage)) == (sorted(map(str, T.PROFILER_OPS)) if T.SAC_INDEXED else [])


def _profiler_ops() -> None:
    seen = []

    class Ops(T.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Ops(), torch.profiler.record_function("range"):
        pass
    assert seen and all(op in T.PROFILER_OPS for op in seen)


def _checkpoint_options() -> None:
    takes = T.RESPECT_HOOKS in inspect.signature(torch.utils.checkpoint.checkpoint).parameters
    assert T.RESPECT_HOOKS == "respect_saved_tensors_hooks"
    assert T.checkpoint_options({"early_stop": True}) == (
        {"early_stop": True, T.RESPECT_HOOKS: False} if takes else {"early_stop": True})
    assert T.checkpoint_options({T.RESPECT_HOOKS: True}) == {T.RESPECT_HOOKS: True}
    assert (T.feature_problems()[T.RESPECT_HOOKS] is None) is takes


def _keep_out_of_hooks() -> None:
    caching, _ = create_selective_checkpoint_contexts(lambda *a, **k: False)
    T.sac_keep_out_of_hooks(caching)  # torch 2.14 reads the attribute; older ones lack it
    assert getattr(caching, T.RESPECT_HOOKS, False) is False
    assert getattr(T.selective_checkpoint_contexts(lambda *a, **k: False)[0], T.RESPECT_HOOKS,
                   False) is False


def _has_cuda_fake_ops() -> None:
    assert T.has_cuda_fake_ops() is True  # every release of the range has them (cuda_fake_ops)


def _sac_forget() -> None:
    with pytest.raises(Exception, match="mutated"):  # why it exists: torch refuses otherwise
        _mm_then_written(forget=False)
    gx, gw = _mm_then_written(forget=True)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    (torch.mm(x, w) * 2).sin().sum().backward()
    assert torch.equal(gx, x.grad) and torch.equal(gw, w.grad)
    caching, _ = create_selective_checkpoint_contexts(lambda *a, **k: CheckpointPolicy.MUST_SAVE)
    assert not T.sac_forget(caching, aten.mm.default, 0)  # nothing saved: nothing to forget
    assert not T.sac_forget(object(), aten.mm.default, 0)  # another layout: fall back


def _require_sac_storage() -> None:
    if T.SAC_INDEXED:
        assert T.require_sac_storage() is None
    else:  # rule 4: refused, naming the release that has it
        with pytest.raises(UnsupportedTorch, match="offload needs the indexed .* torch 2.13"):
            T.require_sac_storage()


def _sac_storage_entries() -> None:
    """A dict of ours shared by both modes: the caching mode fills it with entries whose
    leaves hold the detached output, the cached mode serves them from it."""
    if not T.SAC_INDEXED:  # refused (rule 4): no offload before torch 2.13
        with pytest.raises(UnsupportedTorch, match="torch 2.13"):
            T.sac_set_storage(None, None, {})
        return
    caching, cached = create_selective_checkpoint_contexts(
        lambda ctx, op, *a, **k: op is aten.mm.default)
    class Storage(dict):
        def __missing__(self, key):
            value = self[key] = {}
            return value

    storage = Storage()
    T.sac_set_storage(caching, cached, storage)
    x = torch.randn(3, 4, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(lambda x: torch.mm(x, x.t()).sin(), x,
                                            use_reentrant=False,
                                            context_fn=lambda: (caching, cached))
    entry = storage[aten.mm.default][0]
    assert T.sac_is_entry(entry) and not T.sac_is_entry(storage[aten.sin.default][0])
    saved = T.sac_saved_tensor(entry)
    assert saved is not None and torch.equal(saved[0], torch.mm(x, x.t())) and saved[1] == 0
    out.sum().backward()
    assert not T.sac_is_entry(storage[aten.mm.default][0])  # consumed by the replay
    packed = torch.utils.checkpoint._VersionWrapper(torch.ones(1))
    packed.unpack_hook = lambda v: v  # what a user's pack hook made (torch 2.14 can cache it)
    assert T.sac_saved_tensor(packed) is None


def _require_chain_segments() -> None:
    assert T.require_chain_segments() is None


def _open_and_close(x: torch.Tensor, w: torch.Tensor, calls: list[int]) -> torch.Tensor:
    def replay(x_saved: torch.Tensor) -> None:
        calls.append(1)
        torch.tanh(torch.mm(x_saved, w)).exp()

    gen = T.open_checkpoint(replay, lambda: (torch.enable_grad(), torch.enable_grad()), [x])
    h = torch.tanh(torch.mm(x, w))  # entered in one function...
    out = h.exp()
    T.close_checkpoint(gen)  # ...and left in another: what ran between is the region
    return out


def _open_checkpoint() -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    calls: list[int] = []
    out = _open_and_close(x, w, calls)
    assert calls == []
    out.sum().backward()
    assert calls == [1]  # recomputed once in backward
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    torch.tanh(torch.mm(x2, w2)).exp().sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


def _close_checkpoint() -> None:
    x = torch.ones(2, 4, requires_grad=True)
    w = torch.eye(4, requires_grad=True)
    gen = T.open_checkpoint(lambda *a: None, lambda: (torch.enable_grad(), torch.enable_grad()),
                            [x])
    T.close_checkpoint(gen)
    with pytest.raises(StopIteration):  # closed: the generator is finished
        next(gen)
    assert _open_and_close(x, w, []).shape == (2, 4)


def _cpu_memory_events() -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t = torch.empty(4096)  # 16,384 bytes
        del t
    events = T.cpu_memory_events(prof)
    assert [b for _, b in events] == [16384, -16384]
    assert events[0][0] <= events[1][0]
    with pytest.raises(UnsupportedTorch, match="allocator meter"):
        T.cpu_memory_events(object())


def _profiler_marker() -> None:
    from torch.profiler import ProfilerActivity, profile

    with (profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
          T.profiler_marker("memfit.test")):
        t = torch.empty(4096)  # 16,384 bytes
        del t
    (start, end), = T.cpu_marked_spans(prof, "memfit.test")
    assert all(start <= at <= end for at, _ in T.cpu_memory_events(prof))
    with pytest.raises(UnsupportedTorch, match="workspace meter"):
        T.cpu_marked_spans(object(), "memfit.test")


def _checkpoint_side_effects_skipped() -> None:
    import torch._dynamo.config as dynamo_config

    ctx = T.checkpoint_side_effects_skipped()
    if ctx is None:  # this torch has no such setting: nothing to patch
        assert not hasattr(dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint")
        return
    before = dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint
    with ctx:
        assert dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint is True
    assert dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint == before


def _profiler_active() -> None:
    from torch.profiler import ProfilerActivity, profile

    assert not T.profiler_active()
    with profile(activities=[ProfilerActivity.CPU]):
        assert T.profiler_active()
    assert not T.profiler_active()


def _traced_source_fn() -> None:
    assert T.traced_source_fn() is None  # nothing is being traced
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append((str(op), T.traced_source_fn()))
        return CheckpointPolicy.PREFER_RECOMPUTE

    drop, lin = nn.Dropout(0.0), nn.Linear(3, 3)

    def region(x):
        return lin(drop(x.sin()))

    def step(x):
        return torch.utils.checkpoint.checkpoint(
            region, x, use_reentrant=False,
            context_fn=functools.partial(create_selective_checkpoint_contexts, policy))

    torch.compile(step, backend="aot_eager")(torch.ones(2, 3, requires_grad=True)).sum().backward()
    # A torch function's source is its name, a module's its class. Dropout with p = 0 traces
    # as a clone on torch 2.13 and as nothing from 2.14 on, as in eager mode (NOTE [op keys
    # under torch.compile] in memfit.runtime.checkpoint counts that clone as nothing).
    dropout = [("aten.clone.default", nn.Dropout)] if T.torch_release(torch.__version__) < \
        (2, 14) else []
    # torch 2.9 names the module's functional as the source, later releases the module
    modules = {torch.nn.functional.dropout: nn.Dropout, torch.nn.functional.linear: nn.Linear}
    seen = [(op, modules.get(src, src)) for op, src in seen]
    assert list(dict.fromkeys(seen)) == [  # each traced op is asked about more than once
        ("aten.sin.default", "sin"), *dropout,
        ("aten.t.default", nn.Linear), ("aten.addmm.default", nn.Linear)]


def _sdp_priority_order() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    default = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
               SDPBackend.CUDNN_ATTENTION)
    assert T.sdp_priority_order()[:4] == tuple(int(b) for b in default)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH], set_priority=True):
        assert T.sdp_priority_order()[:2] == (int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.MATH))
    assert T.sdp_priority_order()[:4] == tuple(int(b) for b in default)


def _cuda_fake_ops() -> None:
    found = T.cuda_fake_ops()
    assert {n: str(op) for n, op in found.items()} == {n: f"aten.{n}.default" for n in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_safe_softmax")}
    with T.FakeTensorMode():  # each has a meta kernel: fake mode runs it on the meta device
        q = torch.empty(1, 2, 8, 16, dtype=torch.bfloat16, device="meta")
        out, lse = found["_scaled_dot_product_flash_attention"](q, q, q, 0.0, True)[:2]
        assert out.shape == q.shape and lse.shape == (1, 2, 8) and lse.dtype == torch.float32


EXERCISES: dict[str, Callable[[], None]] = {
    "SUPPORTED_TORCH": _supported_torch,
    "require_supported_torch": _require_supported_torch,
    "TorchDispatchMode": _torch_dispatch_mode,
    "FakeTensorMode": _fake_tensor_mode,
    "FAKE_TENSOR_LOGGER": _fake_tensor_logger,
    "OpOverload": _op_overload,
    "OpOverloadPacket": _op_overload_packet,
    "tree_flatten": _tree_flatten,
    "tree_map": _tree_map,
    "op_schema": _op_schema,
    "op_packet": _op_packet,
    "op_namespace": _op_namespace,
    "written_tensors": _written_tensors,
    "storage_key": _storage_key,
    "tensor_version": _tensor_version,
    "is_view_tensor": _is_view_tensor,
    "module_parameters": _module_parameters,
    "module_buffers": _module_buffers,
    "runs_batch_norm_forward": _runs_batch_norm_forward,
    "check_batch_norm_input": _check_batch_norm_input,
    "forward_pre_hooks": _forward_pre_hooks,
    "forward_pre_hook_takes_kwargs": _forward_pre_hook_takes_kwargs,
    "remove_forward_pre_hook": _remove_forward_pre_hook,
    "set_display_name": _set_display_name,
    "clear_display_name": _clear_display_name,
    "current_autograd_node": _current_autograd_node,
    "node_sequence_nr": _node_sequence_nr,
    "peek_sequence_nr": _peek_sequence_nr,
    "no_python_dispatch": _no_python_dispatch,
    "without_dispatch_modes": _without_dispatch_modes,
    "outer_saved_tensors_hooks": _outer_saved_tensors_hooks,
    "sac_op_output": _sac_op_output,
    "sac_rearm": _sac_rearm,
    "sac_forget": _sac_forget,
    "SAC_INDEXED": _sac_indexed,
    "SAC_OP_OUTPUT": _sac_op_output,
    "QueuedEntries": _queued_entries,
    "selective_checkpoint_contexts": _selective_checkpoint_contexts,
    "sac_is_recompute": _sac_indexed,
    "AnyOccurrenceRecomputed": _any_occurrence_recomputed,
    "sac_ignore_profiler_ops": _any_occurrence_recomputed,
    "PROFILER_OPS": _profiler_ops,
    "checkpoint_options": _checkpoint_options,
    "RESPECT_HOOKS": _checkpoint_options,
    "sac_keep_out_of_hooks": _keep_out_of_hooks,
    "feature_problems": _sac_indexed,
    "has_cuda_fake_ops": _has_cuda_fake_ops,
    "require_sac_storage": _require_sac_storage,
    "sac_set_storage": _sac_storage_entries,
    "sac_saved_tensor": _sac_storage_entries,
    "sac_is_entry": _sac_storage_entries,
    "traced_source_fn": _traced_source_fn,
    "require_chain_segments": _require_chain_segments,
    "open_checkpoint": _open_checkpoint,
    "close_checkpoint": _close_checkpoint,
    "cpu_memory_events": _cpu_memory_events,
    "profiler_marker": _profiler_marker,
    "cpu_marked_spans": _profiler_marker,
    "profiler_active": _profiler_active,
    "checkpoint_side_effects_skipped": _checkpoint_side_effects_skipped,
    "sdp_priority_order": _sdp_priority_order,
    "cuda_fake_ops": _cuda_fake_ops,
}


def test_every_name_of_memfit_torch_has_an_exercise():
    assert sorted(EXERCISES) == sorted(T.__all__)


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_private_api_wrapper_works_on_this_torch(name):
    EXERCISES[name]()


# ---- version checks ---------------------------------------------------------------------------
def test_lookup_resolves_submodules_and_names_a_missing_api():
    assert T.lookup("torch._C._DisableTorchDispatch") is torch._C._DisableTorchDispatch
    assert T.lookup("torch.utils._pytree.tree_map") is T.tree_map
    with pytest.raises(UnsupportedTorch) as info:
        T.lookup("torch.utils.checkpoint._no_such_api")
    message = str(info.value)
    assert "torch.utils.checkpoint._no_such_api" in message
    assert f"torch {torch.__version__}" in message and T.SUPPORTED_TORCH in message
    assert isinstance(info.value, MemfitError) and isinstance(info.value, ImportError)


def test_generator_problem_names_what_differs():
    assert T.generator_problem(torch.utils.checkpoint._checkpoint_without_reentrant_generator) \
        is None
    assert "_checkpoint_without_reentrant_generator" in T.generator_problem(None)

    def moved(fn, context_fn, preserve_rng_state=True, *args, **kwargs):
        yield

    problem = T.generator_problem(moved)
    assert "('fn', 'context_fn', 'preserve_rng_state', 'args', 'kwargs')" in problem

    def options_keyword_only(fn, *args, preserve_rng_state=True, context_fn=None,
                             determinism_check="default", debug=False, early_stop=True):
        yield

    assert T.generator_problem(options_keyword_only) is not None

    def new_option_without_default(fn, preserve_rng_state, context_fn, determinism_check,
                                   debug, early_stop, *args, must, **kwargs):
        yield

    assert "'must'" in T.generator_problem(new_option_without_default)


def _as_on_2_13(fn, preserve_rng_state=True, context_fn=None, determinism_check="default",
                debug=False, early_stop=True, *args, **kwargs):
    yield


def _as_on_2_14(fn, preserve_rng_state=True, context_fn=None, determinism_check="default",
                debug=False, early_stop=True, *args, respect_saved_tensors_hooks=None,
                **kwargs):
    return _as_on_2_13(fn, preserve_rng_state, context_fn, determinism_check, debug,
                       early_stop, *args, **kwargs)


@pytest.mark.parametrize("generator", [_as_on_2_13, _as_on_2_14], ids=["generator", "wrapper"])
def test_generator_problem_accepts_what_memfit_passes(generator):
    # 2.13: a generator function; 2.14: a function returning the generator of another, with a
    # keyword-only option added after *args (the positional order kept)
    assert T.generator_problem(generator) is None


def _patch_generator(monkeypatch: pytest.MonkeyPatch, generator: Callable[..., object]) -> None:
    monkeypatch.setattr(T.checkpointing, "_generator", generator)
    monkeypatch.setattr(T.checkpointing, "_CHAIN_SEGMENTS_PROBLEM",
                        T.checkpointing.generator_problem(generator))


def test_open_checkpoint_drives_a_wrapper_returning_the_generator(monkeypatch):
    calls = []

    def generator(*args, **kwargs):
        calls.append(args)
        yield

    def wrapper(fn, preserve_rng_state=True, context_fn=None, determinism_check="default",
                debug=False, early_stop=True, *args, respect_saved_tensors_hooks=None):
        return generator(fn, preserve_rng_state, context_fn, determinism_check, debug,
                         early_stop, *args)

    _patch_generator(monkeypatch, wrapper)
    x, replay, contexts = torch.ones(1), (lambda *a: None), (lambda: (None, None))
    T.close_checkpoint(T.open_checkpoint(replay, contexts, [x]))
    assert calls == [(replay, True, contexts, "default", False, True, x)]


def test_open_checkpoint_refuses_what_is_no_generator(monkeypatch):
    def returns_none(fn, preserve_rng_state=True, context_fn=None, determinism_check="default",
                     debug=False, early_stop=True, *args, **kwargs):
        return None

    _patch_generator(monkeypatch, returns_none)
    with pytest.raises(UnsupportedTorch, match="to return a generator .*returned NoneType"):
        T.open_checkpoint(lambda *a: None, lambda: (None, None), [torch.ones(1)])

    def empty(fn, preserve_rng_state=True, context_fn=None, determinism_check="default",
              debug=False, early_stop=True, *args, **kwargs):
        return (x for x in ())

    _patch_generator(monkeypatch, empty)
    with pytest.raises(UnsupportedTorch, match="to yield once"):
        T.open_checkpoint(lambda *a: None, lambda: (None, None), [torch.ones(1)])


@pytest.mark.parametrize("version", ["2.8.1", "2.6.0+cpu", "1.13.1"])
def test_an_older_torch_is_refused_naming_it_and_the_range(monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(UnsupportedTorch) as info:
        T.require_supported_torch()
    assert str(info.value) == (
        f"memfit needs torch >=2.9,<2.16, but torch {version} is installed (memfit is tested "
        f"with {T._TESTED}): install a supported torch, e.g. pip install 'torch>=2.9,<2.16'")


@pytest.mark.parametrize("version", ["2.9.1", "2.11.0+cu130", "2.13.0+cpu", "2.15.0"])
def test_a_supported_torch_passes_silently(monkeypatch, caplog, version):
    monkeypatch.setattr(torch, "__version__", version)
    with caplog.at_level(logging.WARNING, logger="memfit.torch_support.releases"):
        T.require_supported_torch()
    assert caplog.records == []


@pytest.mark.parametrize("version", ["2.16.0", "2.16.0.dev20260101+cpu", "3.0.0"])
def test_a_newer_torch_is_let_through_with_a_warning(monkeypatch, caplog, version):
    monkeypatch.setattr(torch, "__version__", version)
    with caplog.at_level(logging.WARNING, logger="memfit.torch_support.releases"):
        T.require_supported_torch()
    assert [r.getMessage() for r in caplog.records] == [
        f"torch {version} is newer than the releases memfit is tested with ({T._TESTED}, "
        "supported >=2.9,<2.16); memfit checks the private APIs it needs, but was not tested "
        "on this torch"]


def test_torch_release_reads_major_and_minor():
    assert T.torch_release("2.14.1+cpu") == (2, 14)
    assert T.torch_release("2.16.0.dev20260101") == (2, 16)
    assert T.torch_release("10.2") == (10, 2)
    assert T.torch_release("local-build") is None


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(SRC.parent), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.processes
def test_an_older_torch_fails_at_the_first_profiling_import():
    done = _run("""
        import torch
        torch.__version__ = "2.8.0"              # as on an older torch
        import memfit                            # needs no torch internals
        try:
            memfit.profile(torch.nn.Linear(2, 2), torch.ones(1, 2))
        except ImportError as e:
            print(type(e).__name__, "|", e)
    """)
    assert done.returncode == 0, done.stderr
    kind, message = done.stdout.strip().split(" | ", 1)
    assert kind == "UnsupportedTorch"
    assert message.startswith("memfit needs torch >=2.9,<2.16, but torch 2.8.0 is installed")


@pytest.mark.processes
def test_a_missing_core_api_fails_at_import_naming_torch_and_the_range():
    done = _run("""
        import torch
        del torch._C._DisableTorchDispatch   # as on a torch without it
        import memfit                        # needs no torch internals
        try:
            import memfit.runtime.wrap
        except ImportError as e:
            print(type(e).__name__, "|", e)
    """)
    assert done.returncode == 0, done.stderr
    kind, message = done.stdout.strip().split(" | ", 1)
    assert kind == "UnsupportedTorch"
    assert "torch._C._DisableTorchDispatch" in message
    assert f"torch {torch.__version__}" in message and T.SUPPORTED_TORCH in message


@pytest.mark.processes
def test_a_changed_checkpoint_generator_fails_chain_segments_only():
    done = _run("""
        import torch, torch.utils.checkpoint
        def changed(fn, context_fn, *args, **kwargs):  # as on a torch that reordered it
            yield
        torch.utils.checkpoint._checkpoint_without_reentrant_generator = changed
        import memfit
        from memfit.errors import UnsupportedTorch
        from memfit.runtime.segment import checkpoint_segment
        layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))
        memfit.wrap(layers[0])                    # the rest of memfit works
        layers[0](torch.ones(1, 2, requires_grad=True)).sum().backward()
        try:
            checkpoint_segment(layers, [1, 2])
        except UnsupportedTorch as e:
            print(e)
    """)
    assert done.returncode == 0, done.stderr
    message = done.stdout.strip()
    assert message.startswith("memfit's chain segments need")
    assert "_checkpoint_without_reentrant_generator" in message
    assert "(this torch's has ('fn', 'context_fn', 'args', 'kwargs'))" in message
    assert T.SUPPORTED_TORCH in message and "memfit.wrap" in message


# ---- no private torch API outside memfit._torch -----------------------------------------------
# The text pattern of the project's structure check, over whole files (docstrings included).
_PRIVATE_TEXT = re.compile(r"\btorch\.(_C\b|_[a-z]\w*|utils\._\w+)|\._schema\b|\._cdata\b")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_private_attributes() -> set[str]:
    """Private attribute names of the torch objects memfit handles."""
    x = torch.ones(1, requires_grad=True)
    objects = [torch.Tensor, x, x.untyped_storage(), nn.Module(), nn.Linear(1, 1), aten.mm,
               aten.mm.default, (x * 2).grad_fn, T.TorchDispatchMode,
               torch.utils.checkpoint, torch.autograd.profiler.profile()]
    names = set()
    for obj in objects:
        names |= {n for n in dir(obj) if _private(n)}
        names |= {n for n in getattr(obj, "__dict__", {}) if _private(n)}
    return names | {"kineto_results"}


def _defined_names(trees: list[ast.AST]) -> set[str]:
    """Attribute names memfit defines itself: attributes it assigns (``self._x = ...``) and
    the methods and class attributes of its classes."""
    out = set()
    for tree in trees:
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        out.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        out.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        out |= {t.id for t in item.targets if isinstance(t, ast.Name)}
    return out


def _torch_aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> torch module path, from the file's imports."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    out[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _chain(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def private_torch_uses(path: Path, tree: ast.AST, private_attrs: set[str]) -> list[str]:
    """Where a module imports a private torch module or reads a private torch attribute."""
    found = []
    where = path.name if path.parent.name == "memfit" else f"{path.parent.name}/{path.name}"
    for m in _PRIVATE_TEXT.finditer(path.read_text()):
        found.append(f"{where}: text {m.group(0)!r}")
    aliases = _torch_aliases(tree)
    for node in ast.walk(tree):
        line = f"{where}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names
                      if a.name.startswith("torch.") and any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            names = [*node.module.split("."), *(a.name for a in node.names)]
            if any(map(_private, names)):
                found.append(f"{line}: from {node.module} import ...")
        elif isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain is not None and chain[0] in aliases and any(map(_private, chain[1:])):
                found.append(f"{line}: {'.'.join(chain)}")
            elif node.attr in private_attrs:
                found.append(f"{line}: .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in private_attrs):
            found.append(f"{line}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def scan(root: Path) -> list[str]:
    """Private torch API uses in every module under ``root`` except ``memfit._torch`` (the
    package ``_torch/``, or a module ``_torch.py``)."""
    home = {root / "_torch.py", *(root / "_torch").rglob("*.py")}
    files = sorted(p for p in root.rglob("*.py") if p not in home)
    trees = {p: ast.parse(p.read_text(), str(p)) for p in files}
    attrs = _torch_private_attributes() - _defined_names(list(trees.values()))
    return [hit for p, tree in trees.items() for hit in private_torch_uses(p, tree, attrs)]


def test_no_module_but_memfit_torch_uses_private_torch_apis():
    assert scan(SRC) == []


def test_the_scan_finds_each_kind_of_private_use(tmp_path):
    root = tmp_path / "memfit"
    root.mkdir()
    (root / "_torch.py").write_text("import torch._C\n")  # the one allowed home
    (root / "bad.py").write_text(textwrap.dedent("""
        import torch
        import torch.utils.checkpoint as tc
        from torch.utils._pytree import tree_map
        from torch import _ops

        def f(t, op, st):
            torch._C._DisableTorchDispatch()
            tc._RECOMPUTE
            getattr(op, "_overloadpacket")
            return t._version, st.nbytes()
    """))
    found = scan(root)
    for needle in ("from torch.utils._pytree", "from torch import", "torch._C._Disable",
                   "tc._RECOMPUTE", "'_overloadpacket'", "._version"):
        assert any(needle in hit for hit in found), (needle, found)
    assert not any("_torch.py" in hit for hit in found)
