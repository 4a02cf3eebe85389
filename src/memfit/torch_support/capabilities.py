"""What memfit can do on the installed torch and device: one row per feature that a torch
release or the device decides, full, degraded (how) or refused (which release has it).

NOTE [features by torch release]
    memfit supports torch 2.9 through 2.15 (``SUPPORTED_TORCH``). Each feature below reads
    what it needs from torch by probing (``memfit._torch``: a signature, an attribute, a
    layout), never by version string, so a release that back-ports or removes a piece is read
    as it is; only where a release's own machinery fails (torch 2.9's pipelining schedules
    over gloo) does a row read the release number. docs/torch-releases.md has the table for
    every release of the range, made by ``python -m benchmarks.torch_releases`` from this
    module's rows on each release.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from memfit import _torch as T
from memfit.torch_support.releases import SUPPORTED_TORCH

__all__ = ["Capability", "Capabilities", "capabilities"]

Status = Literal["full", "degraded", "refused"]


@dataclass(frozen=True)
class Capability:
    """One feature on this torch and device.

    Attributes:
        feature: what the user does (``"offload"``, ``"chain segments"``...).
        status: ``"full"``, ``"degraded"`` (works, with ``how`` saying what differs) or
            ``"refused"`` (raises ``UnsupportedTorch`` when used; ``how`` names the release
            that has it).
        how: one line: how memfit provides it here, or why not.
    """

    feature: str
    status: Status
    how: str


@dataclass(frozen=True)
class Capabilities:
    """The rows of :func:`capabilities`; ``str()`` prints them as a table."""

    torch_version: str
    device: str
    rows: tuple[Capability, ...]

    def status(self, feature: str) -> Status:
        """The status of ``feature`` (KeyError naming the features if unknown)."""
        for row in self.rows:
            if row.feature == feature:
                return row.status
        raise KeyError(f"no feature {feature!r}; the features are "
                       f"{', '.join(r.feature for r in self.rows)}")

    def to_dict(self) -> dict[str, Any]:
        return {"torch": self.torch_version, "device": self.device,
                "rows": [asdict(r) for r in self.rows]}

    def __str__(self) -> str:
        width = max(len(r.feature) for r in self.rows)
        lines = [f"memfit on torch {self.torch_version}, {self.device}",
                 f"{'feature':<{width}}  {'status':<8}  how"]
        lines += [f"{r.feature:<{width}}  {r.status:<8}  {r.how}" for r in self.rows]
        return "\n".join(lines)


def _device() -> str:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"cuda: {props.name}, {props.total_memory / 2**30:.1f} GiB"
    return "cpu (no CUDA device)"


def _pipeline_row(release: tuple[int, int]) -> Capability:
    """Pipeline schedules: measured per release (NOTE [features by torch release])."""
    if release < (2, 11):
        return Capability("pipeline schedules", "degraded",
                          "torch 2.9's own schedules fail over gloo before memfit runs (a send "
                          "of another size than the receive expects): untested here")
    if release >= (2, 15):
        return Capability("pipeline schedules", "degraded",
                          "stage peaks off by one boundary tensor per micro-batch in flight "
                          "(torch 2.15 keeps others than memfit's model: up to 3.0% measured)")
    return Capability("pipeline schedules", "full",
                      "torch.distributed.pipelining's schedules with memfit's stage plans")


def capabilities() -> Capabilities:
    """What memfit can do on the installed torch and device (NOTE [features by torch release]).

    Returns:
        ``Capabilities``: ``print()`` it for a table; ``.status("offload")`` for one row;
        ``memfit doctor`` prints the same on the command line.

    Example:
        >>> import memfit
        >>> print(memfit.capabilities())   # doctest: +SKIP
    """
    def row(feature: str, ok: bool, full: str, otherwise: str,
            status: Status = "refused") -> Capability:
        return Capability(feature, "full" if ok else status, full if ok else otherwise)

    problems = T.feature_problems()
    rows = (
        Capability("torch release", "full", f"{torch.__version__} (memfit supports "
                   f"{SUPPORTED_TORCH})"),
        row("selective regions", T.SAC_INDEXED,
            "torch's indexed selective-checkpoint cache",
            "memfit keeps torch's queued cache by occurrence and answers its second policy "
            "call from the forward's decisions (torch < 2.13): same plans, same bits",
            status="full"),
        row("op outputs seen by the policy", T.SAC_OP_OUTPUT,
            "SelectiveCheckpointContext.op_output",
            "a memfit dispatch mode hands each output to the policy (torch < 2.12): one "
            "more Python call per op of a selective region's forward", status="degraded"),
        row("another backward through a region", True,
            "consumed cache entries recomputed (retain_graph, double backward, early stop)",
            ""),
        row("offload", problems["offload"] is None,
            "OFFLOAD decisions move saved outputs to host memory",
            "UnsupportedTorch at apply: needs torch 2.13's indexed cache; plan "
            "without offload"),
        row("chain segments", problems["chain segments"] is None,
            "checkpoints spanning blocks of a Python loop",
            f"refused: needs {problems['chain segments']}; wrap blocks one by one"),
        row("saved-tensor hooks around regions", True,
            "respect_saved_tensors_hooks=False passed (torch >= 2.14)"
            if problems[T.RESPECT_HOOKS] is None else
            "torch < 2.14 keeps a region's saved outputs out of outer hooks, as plans assume",
            ""),
        row("profiler ranges in a replay", True,
            "record_function ops skipped by the check and always recomputed", ""),
        _pipeline_row(T.torch_release(torch.__version__) or (99, 0)),
        row("GPU-faithful fake mode", T.has_cuda_fake_ops(),
            "the CUDA attention kernels' outputs in fake mode",
            "refused: this torch lacks the CUDA attention ops; profile with target='cpu'"),
        row("CUDA peak meter", torch.cuda.is_available(),
            "torch.cuda.max_memory_allocated", "no CUDA device here: CPU allocator meters",
            status="degraded"),
    )
    return Capabilities(torch.__version__, _device(), rows)
