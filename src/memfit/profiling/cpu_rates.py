"""This CPU's matmul and copy rates, measured with torch, as a device preset for the roofline
(``memfit.timemodel.devices``: the presets themselves are torch-free data)."""

from __future__ import annotations

import time

import torch

from memfit.timemodel.devices import DevicePreset

__all__ = ["calibrate_cpu"]


def calibrate_cpu(n: int = 1024, copy_bytes: int = 64 * 2**20, repeats: int = 5) -> DevicePreset:
    """Measure this CPU's matmul FLOP/s (fp32 and bf16) and copy bandwidth (best of repeats).

    Example:
        >>> calibrate_cpu(n=128, copy_bytes=2**20, repeats=1).name
        'cpu-calibrated'
    """

    def best(fn: object) -> float:
        ts = []
        for _ in range(repeats + 1):  # first run warms up
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            ts.append(time.perf_counter() - t0)
        return min(ts[1:]) if len(ts) > 1 else ts[0]

    a = torch.randn(n, n)
    b = torch.randn(n, n)
    fp32 = 2 * n**3 / best(lambda: torch.mm(a, b))
    ah, bh = a.bfloat16(), b.bfloat16()
    bf16 = 2 * n**3 / best(lambda: torch.mm(ah, bh))
    src = torch.empty(copy_bytes // 4)
    dst = torch.empty_like(src)
    bw = 2 * copy_bytes / best(lambda: dst.copy_(src))
    return DevicePreset("cpu-calibrated", flops_per_s=bf16, fp32_flops_per_s=fp32,
                        bandwidth_bytes_per_s=bw, memory_bytes=0, op_overhead_s=5e-6,
                        source=f"calibrate_cpu() with {torch.get_num_threads()} threads")
