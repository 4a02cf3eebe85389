"""What every per-rank script of ``test_distributed.py`` shares: the process group, the tiny
Llama of ``tests/integrations/hf_models.py``, 3 AdamW steps, full weights, the JSON result.

Run by ``torch.distributed.run`` (never collected by pytest: no ``test_`` prefix)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
from hf_models import batch, llama  # noqa: E402

__all__ = ["batch", "llama", "setup", "train", "full_weights", "same_weights", "gather", "write"]

STEPS = 3
_START_S: list[float] = []


def setup() -> int:
    """Join the gloo process group; this rank's global rank."""
    _START_S.append(time.perf_counter())
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    return dist.get_rank()


def train(model: torch.nn.Module, rank: int, steps: int = STEPS) -> torch.nn.Module:
    """``steps`` AdamW steps on this rank's own batches, from a fixed RNG seed (dropout)."""
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(steps):
        loss = model(**batch(seed=100 + 10 * rank + i)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor (``full_tensor()`` of FSDP's DTensors: a collective),
    keyed by the name of the unwrapped model (no DDP ``module.`` prefix)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.removeprefix("module.")] = t.detach().clone()
    return out


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names of the parameters not bitwise equal (``torch.equal``) in ``a`` and ``b``."""
    if a.keys() != b.keys():
        return sorted(a.keys() ^ b.keys())
    return [n for n in a if not torch.equal(a[n], b[n])]


def gather(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def write(rank: int, result: dict[str, Any]) -> None:
    """This rank's result as ``$MEMFIT_DIST_OUT/rank<r>.json``, with the seconds since
    ``setup()``; leaves the process group and the process."""
    result["seconds_after_imports"] = time.perf_counter() - _START_S[0]
    path = Path(os.environ["MEMFIT_DIST_OUT"]) / f"rank{rank}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: a C++ thread left joinable there (gloo's) has
    # aborted a rank ("terminate called without an active exception") after its result was
    # written, which the launcher reports as the job failing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
