"""Batch norms whose saved input is let go in forward and rebuilt in backward from their output.

NOTE [in-place activated batch norm]
    A batch norm in training mode saves its input ``x`` for backward; its output ``y`` is the
    affine ``y = (x - mean) * invstd * weight + bias`` per channel. When the op after it is an
    in-place leaky relu (``inplace_abn``), ``z = leaky_relu(y)`` overwrites ``y``'s storage and
    is invertible (``y = z`` where ``z >= 0``, else ``z / slope``), so ``x`` can be rebuilt from
    ``z`` and the per-channel ``mean`` and ``invstd`` the kernel normalised with (NOTE [the
    kernel's statistics]): the inverse leaky relu in place, then ``x = y a + b``, ``a = 1 /
    (weight invstd)``, ``b = mean - bias a`` (one ``addcmul`` pass). The planned norm's call
    is taken over by a function mode over its module
    (``memfit.runtime.compress._CallTagging``): the norm's node saves a ``_Rebuilt`` instead of
    ``x``, which holds ``x`` itself until the planned activation has run in place on the norm's
    output, then lets it go. In backward the norm's node unpacks last among the readers of
    ``z`` (every reader of ``z`` feeds the activation, which feeds the norm), so the rebuild
    runs in place in ``z``'s storage. Not exact: ``x'`` differs from ``x`` by fp32 roundings,
    bounded in the codec's ``keeps`` (``|x' - x| <= 2^-20 (|x| + |mean| + |bias / weight| /
    invstd)``), so ``compress="lossy"`` only. A weight with a zero element (no inverse), eval
    statistics, an activation not in place or writing elsewhere, or the output written again
    after the activation: the input is kept whole (the first three) or backward raises with
    what to do (the last). The saved object can be unpacked once (``retain_graph=True`` raises).

NOTE [output-activated batch norm]
    ResNet's batch norms are followed by an in-place ReLU, which is not invertible: the zeros
    it writes lose the values batch norm's backward needs. ``bn_from_output`` keeps the norm's
    output instead: the planned relu after the norm runs *out of place* (``torch.relu``,
    returned in place of the in-place result: ``nn.ReLU(inplace=True)`` and ``F.relu(x,
    inplace=True)`` are called for what they return), so ``y`` stays whole. A caller that
    reads ``y`` afterwards expecting it written is caught where a node saves it (the pack hook
    raises, saying what to write instead); ``torch.relu_(y)`` and ``y.relu_()``, whose callers
    commonly do read ``y``, write ``y`` in place as called and keep a copy (two more passes); the norm's saved input is a ``_Rebuilt`` rebuilt from ``y`` as above, and
    every save of the relu's result ``r`` (relu's own node, the next convolution's input, a max
    pool's input) is a ``ReluOf`` that rebuilds ``relu(y)`` when unpacked: bitwise ``r``; the
    relu's own node reads only ``r <= 0`` (NOTE [sign-only readers] in
    ``memfit.runtime.compress``), which is ``y <= 0`` (NaN included), so it is given ``y``. In
    forward ``x`` is freed after the norm and ``r`` after its last reader; ``y`` is held until
    the norm's backward (in its storage the rebuilt ``x``, one ``addcmul`` pass: ``x = y a + b``
    per channel). One tensor of each norm-relu pair is kept where two were (``x`` and ``r``),
    at no recompute of the convolution before it; the costs are the rebuild and one relu per
    unpack of ``r`` by a reader of its values. The relu's own node
    saves ``r`` while ``torch.relu`` runs, before the mode has its result: the pack hook takes
    the first save whose node is a ``ReluBackward`` while that relu runs, and tags its storage.

NOTE [the kernel's statistics]
    Both variants rebuild ``x`` from the per-channel ``mean`` and ``invstd``. Those are outputs
    1 and 2 of the batch-norm kernel (``ABN_NORMS``: ``native_batch_norm`` and
    ``_native_batch_norm_legit`` return ``save_mean, save_invstd``, ``cudnn_batch_norm`` its
    ``save_mean`` and inverse std), which ``F.batch_norm`` drops and the norm's autograd node
    saves for its own backward. A dispatch mode over the planned call (``_KernelStatistics``)
    takes them as the kernel returns them: no pass over ``x`` and no tensor of memfit's own,
    and the rebuild inverts ``y`` with the very numbers it was made with. Before 2026-12-07 a
    ``var_mean(x)`` pass in forward computed them again and held 8 bytes a channel (on the CPU,
    norms of 8 and 16 channels of 2 x 32^3 and 8 x 32^2: the same means, bitwise, and inverse
    stds within 8.9e-8 of the kernel's, one fp32 rounding). A kernel that returns no such pair
    (another backend's): the input is kept whole.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from memfit._torch import TorchDispatchMode, tensor_version
from memfit.ops import op_name
from memfit.planning.compression import ABN_NORMS

__all__ = ["Rebuilt", "ReluOf", "norm_taken", "activation_in_place", "relu_out_of_place", "check_not_replaced"]


class Rebuilt:
    """A batch norm's saved input, rebuilt in backward from its output (NOTE [in-place activated
    batch norm], NOTE [output-activated batch norm]). Holds the input itself until the planned
    activation has run on the norm's output (``x`` None afterwards)."""

    def __init__(self, x: torch.Tensor, weight: Any, bias: Any, eps: float, from_output: bool) -> None:
        self.x: torch.Tensor | None = x
        self.weight, self.bias, self.eps = weight, bias, eps
        self.from_output = from_output  # bn_from_output: y itself kept; else y inverted from leaky relu
        self.out: torch.Tensor | None = None
        self.mean: torch.Tensor | None = None
        self.invstd: torch.Tensor | None = None
        self.slope = 0.0
        self.version = -1

    def output(self) -> torch.Tensor:
        """The norm's output ``y`` as the forward left it (bn_from_output), for a relu rebuild."""
        y = self.out
        if y is None:
            raise RuntimeError("memfit: a relu result rebuilt from its batch norm's output was "
                               "unpacked after the norm's backward (NOTE [output-activated batch "
                               "norm]): backward with retain_graph=True needs a plan without "
                               "compress='lossy'")
        self._check(y)
        return y

    def _check(self, y: torch.Tensor) -> None:
        if tensor_version(y) != self.version:
            raise RuntimeError("memfit: a batch norm's output was written again after its "
                               "activation, so its input cannot be rebuilt for the backward (NOTE "
                               "[in-place activated batch norm]); plan without compress='lossy'")

    def rebuild(self) -> torch.Tensor:
        if self.x is not None:
            return self.x
        y, self.out = self.out, None
        if y is None:
            raise RuntimeError("memfit: a batch norm's input rebuilt from its output can be "
                               "unpacked once (NOTE [in-place activated batch norm]): backward "
                               "with retain_graph=True needs a plan without compress='lossy'")
        assert self.mean is not None and self.invstd is not None
        self._check(y)
        # in place: every other reader of y (the activation's and the next op's backward) has
        # run by the time the norm's backward unpacks its input
        shape = [1, -1] + [1] * (y.dim() - 2)
        if not self.from_output:
            torch.nn.functional.leaky_relu(y, 1.0 / self.slope, inplace=True)  # the inverse
        # one pass: x = y a + b, a = 1 / (weight invstd), b = mean - bias a, per channel (in
        # the kernel's fp32 statistics, then y's dtype)
        a = 1.0 / (self.invstd if self.weight is None else self.invstd * self.weight.detach())
        b = self.mean if self.bias is None else self.mean - self.bias.detach() * a
        return torch.addcmul(b.to(y.dtype).view(shape), y, a.to(y.dtype).view(shape), out=y)


class ReluOf:
    """A save of a relu result, rebuilt in backward as ``relu(y)`` from the batch norm's kept
    output (NOTE [output-activated batch norm]): bitwise the result. The relu's own node
    (``sign_only``) reads only ``result <= 0``, which is ``y <= 0``: it gets ``y`` itself."""

    def __init__(self, held: Rebuilt, sign_only: bool = False) -> None:
        self.held = held
        self.sign_only = sign_only

    def rebuild(self) -> torch.Tensor:
        y = self.held.output()
        return y if self.sign_only else torch.relu(y)


def norm_taken(owner: Any, func: Any, args: tuple, kwargs: dict, from_output: bool) -> Any:
    """F.batch_norm with its input's save taken by a Rebuilt (training mode, nonzero weight);
    ``owner`` is the Compressor (its ``shape`` marks the input while the norm runs and its
    ``abn_pending`` holds the Rebuilt until the activation)."""
    names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
    bound = dict(zip(names, args, strict=False)) | kwargs  # args may stop early
    x, weight, eps = bound["input"], bound.get("weight"), float(bound.get("eps", 1e-5))
    if not bound.get("training", False) or (weight is not None and not bool((weight != 0).all())):
        return func(*args, **kwargs)  # kept whole: eval statistics, or a weight that is 0
    held = Rebuilt(x, weight, bound.get("bias"), eps, from_output)
    owner.shape = (weakref.ref(x.untyped_storage()), held)
    kernel = _KernelStatistics()
    try:
        with kernel:
            out = func(*args, **kwargs)
    finally:
        owner.shape = None
    if kernel.found is None:  # not one of ABN_NORMS' kernels: the input is kept whole
        return out
    held.mean, held.invstd = kernel.found
    held.out = out
    owner.abn_pending = held
    return out


class _KernelStatistics(TorchDispatchMode):
    """Over one ``F.batch_norm`` call: the per-channel mean and invstd its kernel (one of
    ``ABN_NORMS``: outputs 1 and 2) computed and normalised with, which its autograd node
    saves anyway (NOTE [the kernel's statistics])."""

    def __init__(self) -> None:
        super().__init__()
        self.found: tuple[torch.Tensor, torch.Tensor] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (self.found is None and op_name(func) in ABN_NORMS and isinstance(out, tuple) and len(out) >= 3
                and all(isinstance(t, torch.Tensor) and t.numel() > 0 for t in out[1:3])):
            self.found = (out[1], out[2])
        return out


def activation_in_place(owner: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """F.leaky_relu: in place on the pending norm's output, the norm's input is let go."""
    x = args[0] if args else kwargs["input"]
    slope = float(args[1] if len(args) > 1 else kwargs.get("negative_slope", 0.01))
    inplace = bool(args[2] if len(args) > 2 else kwargs.get("inplace", False))
    held, owner.abn_pending = owner.abn_pending, None
    out = func(*args, **kwargs)
    if (held is not None and not held.from_output and held.out is not None and inplace
            and slope > 0 and x.untyped_storage() is held.out.untyped_storage()):
        held.slope, held.version, held.x = slope, tensor_version(held.out), None
    return out


def relu_out_of_place(owner: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """A relu on the pending norm's whole output, with the output kept: the norm's input let
    go, the result's saves rebuilt (NOTE [output-activated batch norm]). Anything else runs
    as called."""
    x = args[0] if args else kwargs.get("input")
    held, owner.abn_pending = owner.abn_pending, None
    if (held is None or not held.from_output or held.out is None or not isinstance(x, torch.Tensor)
            or x is not held.out or set(kwargs) - {"inplace"} or len(args) > 2):
        return func(*args, **kwargs)
    tensor_call = getattr(func, "__name__", "") == "relu_"  # torch.relu_(x), x.relu_()
    inplace = bool(kwargs.get("inplace", args[1] if len(args) > 1 else False))
    owner.relu_pending = held
    try:
        if tensor_call:
            # its caller may read x afterwards: x is written in place as called, a copy kept
            with torch.no_grad():
                kept = x.detach().clone()
            out = func(*args, **kwargs)
            held.out = kept
        else:
            out = torch.relu(x)
    finally:
        owner.relu_pending = None
    if inplace:  # a save of x from now on is a read of what the caller thinks is the result
        owner.replaced[x.untyped_storage().data_ptr()] = weakref.ref(x.untyped_storage())
    held.version, held.x = tensor_version(held.out), None
    owner.relu_results[out.untyped_storage().data_ptr()] = (weakref.ref(out.untyped_storage()), held)
    return out


def check_not_replaced(owner: Any, t: torch.Tensor) -> None:
    """Raises where ``t`` is a norm output whose in-place relu ran out of place (NOTE
    [output-activated batch norm]): the caller read it instead of the relu's result."""
    storage = t.untyped_storage()
    ref = owner.replaced.get(storage.data_ptr())
    if ref is not None and ref() is storage:
        raise RuntimeError(
            "memfit: a batch norm's output was read after the in-place relu on it, which the plan's "
            "bn_from_output runs out of place (NOTE [output-activated batch norm]): the model uses "
            "the norm's output where it expects the relu to have written it, instead of what the "
            "relu returned. Write `x = relu(x)` there, or plan without compress='lossy' (or with "
            "compress='lossless')")
