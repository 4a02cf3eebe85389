"""``profile``: trace one training step op by op into a ``Profile``.

One traced run records every aten op (a ``StorageTracker`` dispatch mode), the module running
it (``ModuleRecorder``), and what autograd saved for backward (saved-tensor hooks); further
runs only time ops (``OpTimer``), and plain runs time the step. The model, its gradients,
buffers and the RNG state are left as they were (``memfit.step.harness.ModelState``).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memfit.errors import ProfileMismatch
from memfit.profiling.hf_masks import hf_causal_mask_skip
from memfit.profiling.model_state import buffer_bytes, describe_parameters
from memfit.profiling.modules import ModuleRecorder, param_owners
from memfit.profiling.profile import (
    PYTHON_RELEASES,
    OpRecord,
    Phase,
    Profile,
    StorageKind,
    TensorMeta,
    op_signature,
)
from memfit.profiling.tracker import OpTimer, StorageTracker, live_timeline
from memfit.step.harness import ModelState, Step
from memfit.step.inputs import LossFn, call_user, default_loss, iter_tensors
from memfit.timemodel.calibration import Calibration
from memfit.timemodel.devices import collective_time_s, op_time_s, preset

__all__ = ["ProfileMode", "trace", "check_profile_matches", "forward_signature", "region_state_bytes"]

log = logging.getLogger(__name__)


# NOTE [hooked op sequence]
#     The traced run has saved-tensor hooks installed (to see what autograd saves). Under any
#     saved-tensor hooks autograd skips the ``aten.detach`` it otherwise dispatches when it saves
#     an op's output, so the forward op sequence recorded is the one a non-reentrant
#     checkpoint region (which installs its own hooks) dispatches and its selective policy
#     counts: op keys ("aten.mm.default#2") agree between plan and runtime. Timing runs install
#     identity hooks so their op sequence lines up with the traced one. Memory is unaffected
#     (the skipped detach is a view).

# NOTE [traced op times]
#     An op's time is the median of the timing runs (``OpTimer``), not of the traced run: the
#     traced run tracks every storage and meters kernel workspaces around each op, and it is
#     the step's first run on fresh heap pages, so its op times run slow, and by a factor that
#     differs between ops. Measured on the zoo GPT 8x512 (2-core CPU): forward ops summed
#     0.344 s with the traced run's times in the median (``repeats=2``) and 0.288 s from the
#     timing runs, against a 0.668 s plain step; GELU 1.08 vs 0.53 ms (0.47-0.55 ms under
#     torch's profiler in a plain step), an elementwise mul 0.70 vs 0.22 ms, a matmul 6.79 vs
#     6.25 ms. The calibration's one common scale (0.81-0.87 then) cannot undo a factor that
#     depends on the op, and the solver, choosing what to rerun by those times, was misled
#     most about the small elementwise ops it prefers to rerun. With ``repeats=1`` there is
#     no timing run and the traced run's times are used.


FAKE_CALIBRATION = ("fake mode: op times come from the cost model and no step runs, so "
                    "recompute is not timed; the default time model applies")


class ProfileMode(str, enum.Enum):
    MEASURE = "measure"  # run the step for real, time ops
    FAKE = "fake"        # run it on the meta device, times from the cost model


@dataclass
class _Setup:
    step: Step                              # on fake inputs in fake mode
    forward: Callable[..., Any]
    state: dict[str, torch.Tensor] | None   # fake-mode parameters and buffers, by name
    device: torch.device
    outer: Any                              # the fake mode, or a null context
    kernels: Any = None                     # CudaKernels for a CUDA target in fake mode
    host_numbers: bool = False              # fake mode for a CPU target: NOTE [wrapped numbers saved for backward]


@contextlib.contextmanager
def _traced(su: _Setup, time_ops: bool, count_flops: bool = True, forward_only: bool = False,
            measure_workspace: bool = False,
            keep_saved: bool = True) -> Iterator[tuple[StorageTracker, ModuleRecorder]]:
    model, state, st = su.step.model, su.state, su.step
    owners = param_owners(model)
    named = dict(model.named_parameters()) if state is None else {n: state[n] for n in owners}
    tracker = StorageTracker(time_ops=time_ops, count_flops=count_flops,
                             param_owner={id(p): owners[n] for n, p in named.items()},
                             measure_workspace=measure_workspace,
                             autocast_devices=st.autocast_devices())
    tracker.host_numbers = su.host_numbers
    rec = ModuleRecorder(model, tracker)
    tracker.module_of = rec.current
    for p in named.values():
        tracker.register(p, StorageKind.PARAMETER)
    buffers = model.named_buffers() if state is None else ((n, state[n]) for n, _ in model.named_buffers())
    for _, b in buffers:
        tracker.register(b, StorageKind.BUFFER)
    for t in iter_tensors(st.inputs):
        tracker.register(t, StorageKind.INPUT)
    if forward_only and st.call is None:
        def step() -> None:
            out = call_user(su.forward, st.args, st.kwargs, model=st.name, what="forward")
            (st.loss_fn or default_loss)(out)
    elif forward_only:
        def step() -> None:
            st.output_and_loss()
    else:
        def step() -> None:
            st.run(forward=su.forward, on_backward=tracker.begin_backward)
    try:
        # NOTE [HF causal mask in fake mode]: in fake mode (su.state), HF's mask checks as on real tensors
        masks = (hf_causal_mask_skip(positions_given="position_ids" in (st.kwargs or {}))
                 if su.state is not None else contextlib.nullcontext())
        # keep_saved=False: autograd keeps nothing (NOTE [Python releases] in memfit.profiling.profile)
        hooks = (tracker.saved_tensors_hooks() if keep_saved
                 else torch.autograd.graph.saved_tensors_hooks(_nothing, _never_unpacked))
        with su.outer, su.kernels or contextlib.nullcontext(), masks, rec, hooks, tracker:
            step()
    finally:
        tracker.close()
    yield tracker, rec


def _setup(step: Step, mode: ProfileMode, device: str | torch.device | None,
           target: str = "cpu") -> _Setup:
    model = step.model
    args, kwargs = step.inputs
    if mode is ProfileMode.FAKE:
        if step.call is not None:
            raise ValueError("fake mode profiles model(*example_inputs); a step given as a "
                             "callable runs real tensors: profile it in measure mode")
        from memfit.profiling.cuda_kernels import cuda_kernels_for
        from memfit.profiling.fake import fake_device, meta_inputs, meta_state, new_fake_mode

        fake_mode = new_fake_mode()
        on = fake_device(step.autocast_devices())
        with fake_mode:  # NOTE [fake mode under autocast]
            state = meta_state(model, on)
            args, kwargs = meta_inputs((args, kwargs), on)

        def forward(*a: Any, **k: Any) -> Any:
            return torch.func.functional_call(model, state, a, k, tie_weights=True, strict=False)

        # NOTE [CUDA kernels in fake mode]: a CUDA target's dropout and attention kernels
        return _Setup(step.with_inputs(args, kwargs), forward, state, torch.device("meta"),
                      fake_mode, cuda_kernels_for(target), host_numbers=target == "cpu")
    if device is None:
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else "cpu"
    dev = torch.device(device)
    if dev.type == "meta":
        raise ValueError("the model is on the meta device: profile it with mode='fake'")
    return _Setup(step, model, None, dev, contextlib.nullcontext())


def trace(
    model: torch.nn.Module | Step,
    example_inputs: Any = None,
    *,
    loss_fn: LossFn | None = None,
    mode: ProfileMode | str = ProfileMode.MEASURE,
    device: str | torch.device | None = None,
    repeats: int = 3,
    target: str = "cpu",
) -> Profile:
    """Trace one forward + loss + backward of ``model`` on ``example_inputs`` into a Profile.

    Args:
        model: the module, left unchanged (grads, buffers and RNG state restored); or a
            ``memfit.step.harness.Step`` (then no inputs or loss_fn).
        example_inputs: a tensor, a tuple of positional args or a dict of keyword args.
        loss_fn: ``loss_fn(output) -> scalar``; default ``output.loss`` if present, else the
            sum of ``t.sum()`` over the output tensors.
        mode: ``"measure"`` (run for real, times measured) or ``"fake"`` (meta device,
            memory exact, times from the roofline model of ``target``).
        device: where the model runs in measure mode (default: its parameters' device).
        repeats: runs of the step in measure mode: one traced, the others time its ops
            (medians; NOTE [traced op times]); default 3, two timing runs (the profile costs
            about 5 plain steps: 5.1x on the zoo GPT 8x512 at batch 4, 4.7x before the
            forward traced for NOTE [Python releases], medians of 3).
            1: the traced run's own op times, which run slow.
        target: device preset of the cost model in fake mode (``"cpu"``, ``"v100"``, ``"a100"``,
            ``"h100"``, ``"h200"``); a GPU preset also traces the dropout and attention
            kernels that GPU runs (NOTE [CUDA kernels in fake mode]); ignored in measure mode.

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        >>> p = profile(m, torch.randn(4, 8))
        >>> p.ops[0].name, p.peak_bytes > 0
        ('aten.t.default', True)
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    try:
        mode = ProfileMode(mode)
    except ValueError:
        raise ValueError(f"mode must be 'measure' or 'fake', got {mode!r}") from None
    t_begin = time.perf_counter()
    the_step = _as_step(model, example_inputs, loss_fn)
    model = the_step.model
    cost = preset(target) if mode is ProfileMode.FAKE else None
    su = _setup(the_step, mode, device, cost.name if cost is not None else "cpu")
    dev = su.device
    fake = mode is ProfileMode.FAKE
    keep = ModelState(model, su.step.inputs, buffers=not fake)
    op_times: list[list[float]] = []
    plain: list[float] = []
    try:
        keep.reset()
        # A CUDA op returns once its kernels are queued: the traced run's wall-clock op times
        # would be launch times, so on CUDA only the timing runs' events count (NOTE [CUDA
        # op times] in ``memfit.profiling.timer``), and at least one timing run is made.
        async_dev = dev.type == "cuda"
        # NOTE [kernel workspaces]: measured on CPU only (CUDA workspaces not modelled yet)
        with _traced(su, time_ops=not fake and not async_dev,
                     measure_workspace=not fake and dev.type == "cpu") as (tr, rec):
            pass
        keep.reset()
        releases = _python_releases(su, tr)
        if not fake:
            # NOTE [traced op times]: the timing runs' times, the traced run's only without them
            op_times = [[] for _ in tr.ops]
            step = su.step.run
            for _ in range(max(repeats - 1, 1 if async_dev else 0)):
                keep.reset()
                timer = OpTimer()
                # the same hooks as the traced run, so the same ops (NOTE [hooked op sequence])
                with torch.autograd.graph.saved_tensors_hooks(_identity, _identity), timer:
                    step()
                if len(timer.times) == len(tr.ops):
                    for ts, t in zip(op_times, timer.times, strict=True):
                        ts.append(t)
                else:
                    log.warning("profile: a timing run dispatched %d ops, the traced run %d; "
                                "its op times are ignored", len(timer.times), len(tr.ops))
            if not any(op_times):
                if async_dev:
                    log.warning("profile: no timing run matched the traced run's ops; every op "
                                "time is 0 (plans are then chosen by memory alone)")
                else:
                    op_times = [[op.time_s] for op in tr.ops]
            for _ in range(max(1, repeats // 2)):
                keep.reset()
                _sync(dev)
                t0 = time.perf_counter()
                step()
                _sync(dev)
                plain.append(time.perf_counter() - t0)
    finally:
        keep.restore()

    ops = []
    n_forward = tr.n_forward if tr.n_forward is not None else len(tr.ops)
    # NOTE [CUDA kernels in fake mode] (5): the kernel temporaries measured on a GPU
    from memfit.profiling.cuda_kernels import cuda_kernels_for, cuda_workspace_bytes

    gpu_fake = fake and cuda_kernels_for(target) is not None
    for i, op in enumerate(tr.ops):
        if gpu_fake:
            op.workspace_bytes = max(op.workspace_bytes, cuda_workspace_bytes(op.name, op.outputs))
        if cost is not None:
            dtype = op.outputs[0][2] if op.outputs else "float32"
            t = op_time_s(op.flops, op.bytes_moved, dtype, cost)
            if op.name.startswith(_COLLECTIVES):  # NOTE [collective times] in memfit.timemodel.devices
                moved = sum(tr.storages[sid].nbytes for sid, _, _ in op.outputs)
                t = collective_time_s(op.name, moved, _world_size(), cost) or t
        else:
            t = statistics.median(op_times[i]) if op_times[i] else 0.0
        ops.append(OpRecord(
            index=i, name=op.name, module=op.module,
            phase=Phase.BACKWARD if i >= n_forward else Phase.FORWARD,
            inputs=op.inputs, outputs=tuple(TensorMeta(s, sh, dt) for s, sh, dt in op.outputs),
            time_s=t, inplace=op.inplace, random=op.random, flops=op.flops,
            workspace_bytes=op.workspace_bytes, packs=op.packs,
            next_packs=op.next_packs, forward_op=op.forward_op))
    storages = tuple(
s.freeze(sid) for sid, s in enumerate(tr.storages))
    live = tuple(live_timeline(storages, len(ops), [op.workspace_bytes for op in ops]))
    bwd: dict[str, float] = {}
    for rec_op in ops[n_forward:]:
        bwd[rec_op.module] = bwd.get(rec_op.module, 0.0) + rec_op.time_s
    step_time = statistics.median(plain) if plain else sum(o.time_s for o in ops)
    cost_s = time.perf_counter() - t_begin
    result = Profile(
        ops=tuple(ops), storages=storages, modules=rec.records(bwd), n_forward=n_forward,
        live_bytes=live, peak_bytes=max(live, default=0), baseline_bytes=tr.baseline_bytes,
        step_time_s=step_time, model=type(model).__name__,
        device=cost.name if cost is not None else str(dev), mode=mode.value,
        cost_model=f"roofline:{cost.name}" if cost is not None else "measured",
        signature=op_signature(ops, n_forward),
        # NOTE [calibration]: nothing runs in fake mode to time recompute against
        calibration=Calibration.default(FAKE_CALIBRATION) if fake else None,
        region_state_bytes=region_state_bytes(cost.name if cost is not None else dev.type),
        input_signature=rec.root_signature,
        parameters=describe_parameters(model), buffer_bytes=buffer_bytes(model),
        extra={"profile_wall_s": cost_s, "tracked_peak_bytes": tr.peak_bytes,
               "repeats": repeats if not fake else 1, **({PYTHON_RELEASES: True} if releases else {}),
               "workspace_measured": tr.workspace_measured, "workspace_s": tr.workspace_s,
               **({"cuda_kernels": dict(sorted(su.kernels.counts.items()))}
                  if su.kernels is not None else {})},
    )
    log.info("profiled %s: %d ops (%d forward), peak %d bytes, %.3fs (%.1fx a step)",
             result.model, len(ops), n_forward, result.peak_bytes, cost_s,
             cost_s / step_time if step_time > 0 else float("nan"))
    return result


def region_state_bytes(device: str) -> int:
    """Device bytes one checkpointed call keeps besides the step's tensors (NOTE [region
    state bytes] in ``memfit.profiling.profile``): the CPU generator's state on a CPU."""
    return int(torch.get_rng_state().nbytes) if device == "cpu" else 0


def _as_step(model: Any, example_inputs: Any, loss_fn: LossFn | None) -> Step:
    if isinstance(model, Step):
        if example_inputs is not None or loss_fn is not None:
            raise TypeError("a Step carries its inputs and loss: pass no example_inputs or loss_fn")
        return model
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"profile needs an nn.Module or a memfit Step, got {type(model).__name__}")
    return Step.of(model, example_inputs, loss_fn=loss_fn)


def _python_releases(su: _Setup, tr: StorageTracker) -> bool:
    """Sets ``released_after`` of the storages the traced step's forward created from one
    forward and loss run with saved-tensor hooks that keep nothing (NOTE [Python releases] in
    ``memfit.profiling.profile``); False (nothing set) where that forward ran other ops."""
    counts = su.kernels.counts.copy() if su.kernels is not None else None
    with _traced(su, time_ops=False, count_flops=False, forward_only=True, keep_saved=False) as (rel, _):
        pass
    if su.kernels is not None:  # what the step's trace rewrote, not this forward too
        su.kernels.counts = counts
    n = tr.n_forward if tr.n_forward is not None else len(tr.ops)
    if [o.name for o in rel.ops] != [o.name for o in tr.ops[:n]]:
        log.info("profile: a forward without saved tensors ran other ops (%d against %d); "
                 "Python releases not recorded", len(rel.ops), n)
        return False

    def by_creator(storages: Sequence[Any]) -> dict[tuple[int, int], int]:
        out: dict[tuple[int, int], int] = {}
        count: dict[int, int] = {}
        for sid, s in enumerate(storages):
            if s.created_by is not None and s.created_by < n:
                k = count.get(s.created_by, 0)
                count[s.created_by] = k + 1
                out[(s.created_by, k)] = sid
        return out

    theirs = by_creator(rel.storages)
    for key, sid in by_creator(tr.storages).items():
        other = theirs.get(key)
        if other is None or rel.storages[other].nbytes != tr.storages[sid].nbytes:
            continue
        freed = rel.storages[other].freed_after
        tr.storages[sid].released_after = freed if freed is not None and freed < n else None
    return True


def _nothing(_: Any) -> None:
    return None


def _never_unpacked(_: Any) -> torch.Tensor:
    raise AssertionError("a forward traced for its Python releases runs no backward")


def _identity(t: Any) -> Any:
    return t


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _forward_ops(model: Any, example_inputs: Any, loss_fn: LossFn | None,
                 mode: ProfileMode, target: str = "cpu") -> list[OpRecord]:
    """The forward ops (names and module paths) of one traced forward and loss, with grads,
    buffers and RNG state restored afterwards (fake mode: the kernels of ``target``)."""
    su = _setup(_as_step(model, example_inputs, loss_fn), mode, None, target)
    with ModelState(su.step.model, su.step.inputs, buffers=mode is ProfileMode.MEASURE) as keep:
        keep.reset()
        with _traced(su, time_ops=False, count_flops=False, forward_only=True) as (tr, _):
            pass
    return [OpRecord(index=i, name=o.name, module=o.module, phase=Phase.FORWARD)
            for i, o in enumerate(tr.ops)]


def forward_signature(model: torch.nn.Module | Step, example_inputs: Any = None, *,
                      loss_fn: LossFn | None = None) -> tuple[str, int]:
    """The op-sequence signature a profile of this step would carry, and its forward op count.

    Runs the forward and loss once, traced (fake mode on the meta device for a model there),
    with grads, buffers and RNG state restored afterwards: far less than a profile.

    Example:
        >>> m = torch.nn.Linear(4, 4); x = torch.randn(2, 4)
        >>> forward_signature(m, x)[0] == profile(m, x, repeats=1).signature
        True
    """
    step = _as_step(model, example_inputs, loss_fn)
    on_meta = any(p.device.type == "meta" for p in step.model.parameters())
    ops = _forward_ops(step, None, None, ProfileMode.FAKE if on_meta else ProfileMode.MEASURE)
    return op_signature(ops), len(ops)


def check_profile_matches(profile: Profile, model: torch.nn.Module, example_inputs: Any, *,
                          loss_fn: LossFn | None = None) -> None:
    """Raise ``ProfileMismatch`` unless ``model`` on ``example_inputs`` runs the forward op
    sequence (names and module paths) that ``profile`` recorded.

    The forward and loss are run once (on the meta device for a fake-mode profile) with grads,
    buffers and RNG state restored afterwards.

    Example:
        >>> m = torch.nn.Linear(4, 4); x = torch.randn(2, 4)
        >>> check_profile_matches(profile(m, x, repeats=1), m, x)   # same model: no error
    """
    mode = ProfileMode(profile.mode)  # a fake-mode profile's device is its target
    got = _forward_ops(model, example_inputs, loss_fn, mode,
                       profile.device if mode is ProfileMode.FAKE else "cpu")
    sig = op_signature(got)
    if sig == profile.signature:
        return
    want = profile.forward_ops
    first = next((i for i, (a, b) in enumerate(zip(want, got, strict=False))
                  if (a.name, a.module) != (b.name, b.module)), min(len(want), len(got)))
    have = f"{got[first].name} in {got[first].module!r}" if first < len(got) else "nothing"
    expected = f"{want[first].name} in {want[first].module!r}" if first < len(want) else "nothing"
    raise ProfileMismatch(
        f"the profile (model {profile.model}, signature {profile.signature}, {len(want)} forward "
        f"ops) does not describe this {type(model).__name__} (signature {sig}, {len(got)} forward "
        f"ops): forward op {first} is {have}, the profile has {expected}. Profile this model "
        "with these input shapes again."
    )


_COLLECTIVES = ("_c10d_functional.", "c10d.")


def _world_size() -> int:
    """The job's world size (1 outside a distributed job): what fake mode's collectives span."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
