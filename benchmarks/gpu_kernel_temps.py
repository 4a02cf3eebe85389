"""The temporaries CUDA kernels hold while they run, op by op, over a grid of shapes (torch only).

    python -m benchmarks.gpu_kernel_temps --out DIR     # on a GPU: DIR/kernel_temps.json
    python -m benchmarks.gpu_kernel_temps --device cpu --out /tmp/k   # the code path (no stats)

``benchmarks.gpu_probe trace`` found two kinds of temporaries above what an op leaves on an
H200: ``_softmax_backward_data`` (as large as its output, on two shapes) and the column sums of
bias gradients (``sum.dim_IntList``, 64-132 MiB at 8192 rows). This measures each op alone on
a grid, its inputs made first, as ``max_memory_allocated`` inside the call minus the memory
before it minus its output's bytes, so that fake mode's rule for them (NOTE [CUDA kernels in
fake mode], 5) rests on more than one shape.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _temp(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[int, int]:
    """(temporary bytes, output bytes) of one call of ``fn``."""
    if device.type != "cuda":
        out = fn()
        return 0, out.numel() * out.element_size()
    fn()  # warm-up: lazily loaded kernels, cached launch configurations
    gc.collect()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    nbytes = out.numel() * out.element_size()
    return torch.cuda.max_memory_allocated(device) - before - nbytes, nbytes


def _softmax_calls(shape: tuple[int, ...], dt: torch.dtype,
                   device: torch.device) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    out = torch.softmax(torch.randn(shape, device=device, dtype=dt), dim=-1)
    grad = torch.randn_like(out)
    return [("_softmax_backward_data", lambda: torch.ops.aten._softmax_backward_data(grad, out, -1, dt)),
            ("_log_softmax_backward_data",
             lambda: torch.ops.aten._log_softmax_backward_data(grad, out, -1, dt))]


def _colsum_calls(n: int, c: int, dt: torch.dtype,
                  device: torch.device) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    x = torch.randn(n, c, device=device, dtype=dt)
    x3 = x.view(8, n // 8, c)
    return [("sum dim 0", lambda: x.sum(0)), ("sum dims (0, 1)", lambda: x3.sum((0, 1)))]


def _rows(calls: list[tuple[str, Callable[[], torch.Tensor]]], shape: list[int], dtype: str,
          device: torch.device) -> list[dict[str, Any]]:
    rows = []
    for op, fn in calls:
        try:
            temp, nbytes = _temp(fn, device)
            rows.append({"op": op, "shape": shape, "dtype": dtype, "temp_bytes": temp, "output_bytes": nbytes})
        except Exception as e:  # noqa: BLE001  (recorded; the grid goes on)
            rows.append({"op": op, "shape": shape, "dtype": dtype, "error": str(e)[:200]})
    return rows


def softmax_rows(device: torch.device, small: bool) -> list[dict[str, Any]]:
    shapes = [(2, 2, 64, 64), (64, 300)] if small else [
        (8, 16, 128, 128), (8, 16, 512, 512), (8, 16, 1024, 1024), (4, 16, 2048, 2048),
        (1, 8, 4096, 4096), (8192, 512), (8192, 2048), (4096, 32000), (1024, 128256)]
    rows = []
    for shape in shapes:
        for name, dt in DTYPES.items():
            rows += _rows(_softmax_calls(shape, dt, device), list(shape), name, device)
    return rows


def colsum_rows(device: torch.device, small: bool) -> list[dict[str, Any]]:
    rows = []
    for n in ((64,) if small else (512, 2048, 8192, 32768)):
        for c in ((16, 48) if small else (256, 1024, 2048, 3072, 4096, 8192, 16384)):
            for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
                rows += _rows(_colsum_calls(n, c, dt, device), [n, c], name, device)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a few small shapes (CPU code path)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rec: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "torch": torch.__version__,
                           "sms": torch.cuda.get_device_properties(device).multi_processor_count
                           if device.type == "cuda" else None}
    rec["softmax"] = softmax_rows(device, args.small)
    rec["colsum"] = colsum_rows(device, args.small)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_temps.json").write_text(json.dumps(rec, indent=1) + "\n")
    print(f"gpu_kernel_temps: {len(rec['softmax'])} softmax rows, {len(rec['colsum'])} column sums")
    return 0


if __name__ == "__main__":
    sys.exit(main())
