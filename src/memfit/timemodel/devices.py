"""Device presets and the roofline cost model for op times (torch-free: the planner reads it).

An op takes ``max(flops / peak_flops, bytes_moved / bandwidth) + overhead`` seconds, where
``bytes_moved`` is what it reads plus what it writes; an op that only makes a view (moves no
byte, does no FLOP) is free. Used where ops cannot be timed: fake mode (a model profiled on
the meta device for a target it does not run on here).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["DevicePreset", "PRESETS", "preset", "op_time_s", "collective_time_s", "profile_preset"]


class Target(str, enum.Enum):
    CPU = "cpu"
    V100 = "v100"
    A100 = "a100"
    H100 = "h100"
    H200 = "h200"


@dataclass(frozen=True)
class DevicePreset:
    """Peak rates of one device.

    Attributes:
        name: preset key.
        flops_per_s: peak dense FLOP/s for half-precision (bf16/fp16) math.
        fp32_flops_per_s: peak dense FLOP/s for fp32 math (no TF32).
        bandwidth_bytes_per_s: memory bandwidth, bytes/s.
        memory_bytes: device memory, bytes (0 when not meaningful).
        op_overhead_s: fixed cost per op (kernel launch / dispatch), seconds.
        source: where the figures come from.
        host_link_bytes_per_s: effective host<->device copy rate, bytes/s each way, pinned
            host memory (0: no host link to offload over, as for the CPU preset).
        asynchronous: whether the host enqueues work that the device runs later (a GPU), so
            host overhead can hide behind device work (NOTE [host overhead on an async
            device] in ``memfit.planning.hosttime``); False for the CPU.
        board_power_w: the board's maximum power (TDP), watts, from its datasheet: what
            ``Plan.cost`` charges per device-hour when no power is given (NOTE [board
            power]); None: not known (the CPU preset: a CPU's draw depends on the machine).
        link_bytes_per_s: the device-to-device link (NVLink), bytes/s each way per device,
            for collectives in fake mode (NOTE [collective times]); 0: none known.
    """

    name: str
    flops_per_s: float
    fp32_flops_per_s: float
    bandwidth_bytes_per_s: float
    memory_bytes: int
    op_overhead_s: float
    source: str
    host_link_bytes_per_s: float = 0.0
    asynchronous: bool = False
    board_power_w: float | None = None
    link_bytes_per_s: float = 0.0

    def peak_for(self, dtype: str) -> float:
        return self.flops_per_s if dtype in ("bfloat16", "float16") else self.fp32_flops_per_s


_GB = 1000**3
_T = 1e12

# NOTE [host link] The datasheets give the PCIe x16 rate summed over both directions: "PCIe
# Gen4: 64 GB/s" (A100), "PCIe Gen5: 128 GB/s" (H100 SXM5, H200 SXM), i.e. 32 and 64 GB/s each
# way. Pinned copies reach about 80% of that (packet and protocol overhead; the issue quotes
# ~50-64 GB/s for an H100), so the presets assume 0.8 x half the datasheet figure each way:
# 25.6 GB/s (A100), 51.2 GB/s (H100, H200). Pageable host memory is slower; the runtime pins.
_LINK_EFFICIENCY = 0.8

# NOTE [board power] ``board_power_w`` is the datasheet's "Max thermal design power (TDP)"
# of the SXM board: V100 SXM2 300 W, A100 SXM4 400 W, H100 SXM5 up to 700 W, H200 SXM up to
# 700 W. A board under a training load draws close to it, so energy figures charge it for
# every extra second; that is an upper-end assumption (it leaves out the host, cooling and
# networking), stated with every figure and overridable (``Plan.cost(board_power_w=...)``).

# NOTE [collective times] A collective in fake mode takes the ring algorithm's time over the
# device's link: each device sends and receives ``2 (n - 1) / n`` times the tensor for an
# all-reduce, ``(n - 1) / n`` of the whole for an all-gather, a reduce-scatter or an
# all-to-all, once for a broadcast, plus the op overhead; ``n`` is the job's world size (a
# smaller group, TP within a 2D mesh, takes less: the time is then an upper bound). Link
# rates are the datasheets' NVLink totals (V100 SXM2 300 GB/s, A100 SXM4 600 GB/s, H100 and
# H200 SXM 900 GB/s), both directions summed, so half of each way. A collective's output
# then waits for it (``wait_tensor``): the time is charged once, on the collective.

PRESETS: dict[str, DevicePreset] = {
    # Measured on the development machine with calibrate_cpu() on 2026-11-30 (torch 2.13 CPU,
    # 2 threads, machine shared with other jobs): 1024^3 matmul fp32 200 GFLOP/s, bf16 438
    # GFLOP/s (the CPU has bf16 matrix units), 64 MiB copy 49 GB/s (read + write). With 1
    # thread: 101 / 217 GFLOP/s, 33 GB/s.
    "cpu": DevicePreset("cpu", flops_per_s=438e9, fp32_flops_per_s=200e9,
                        bandwidth_bytes_per_s=49 * _GB, memory_bytes=0, op_overhead_s=5e-6,
                        source="calibrate_cpu() on the dev machine, 2026-11-30, 2 threads"),
    # NVIDIA V100 Tensor Core GPU datasheet (SXM2 16GB): FP16 tensor 125 TFLOPS (Volta has no
    # bf16; half precision runs on its tensor cores), FP32 15.7 TFLOPS, HBM2 900 GB/s, 16 GiB
    # (four 4 GiB stacks), PCIe Gen3 32 GB/s (NOTE [host link]: 12.8 GB/s each way).
    "v100": DevicePreset("v100", flops_per_s=125 * _T, fp32_flops_per_s=15.7 * _T,
                         bandwidth_bytes_per_s=900 * _GB, memory_bytes=16 << 30,
                         op_overhead_s=5e-6, source="NVIDIA V100 datasheet, SXM2 16GB",
                         host_link_bytes_per_s=_LINK_EFFICIENCY * 32 * _GB / 2, asynchronous=True,
                         board_power_w=300, link_bytes_per_s=300 * _GB / 2),
    # NVIDIA A100 Tensor Core GPU datasheet (2020/2021, SXM4 80GB): BF16 tensor core 312
    # TFLOPS dense (624 with sparsity), FP32 19.5 TFLOPS, HBM2e 2,039 GB/s, PCIe Gen4 64 GB/s
    # (NOTE [host link]).
    "a100": DevicePreset("a100", flops_per_s=312 * _T, fp32_flops_per_s=19.5 * _T,
                         bandwidth_bytes_per_s=2039 * _GB, memory_bytes=80 * _GB,
                         op_overhead_s=5e-6, source="NVIDIA A100 datasheet, SXM4 80GB",
                         host_link_bytes_per_s=_LINK_EFFICIENCY * 64 * _GB / 2, asynchronous=True,
                         board_power_w=400, link_bytes_per_s=600 * _GB / 2),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity, i.e.
    # 989.5 dense; FP32 67 TFLOPS; HBM3 3.35 TB/s; 80 GB; PCIe Gen5 128 GB/s.
    "h100": DevicePreset("h100", flops_per_s=989.5 * _T, fp32_flops_per_s=67 * _T,
                         bandwidth_bytes_per_s=3350 * _GB, memory_bytes=80 * _GB,
                         op_overhead_s=4e-6, source="NVIDIA H100 datasheet, SXM5",
                         host_link_bytes_per_s=_LINK_EFFICIENCY * 128 * _GB / 2, asynchronous=True,
                         board_power_w=700, link_bytes_per_s=900 * _GB / 2),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity (989.5
    # dense), FP32 67 TFLOPS, HBM3e 4.8 TB/s, 141 GB, PCIe Gen5 128 GB/s.
    "h200": DevicePreset("h200", flops_per_s=989.5 * _T, fp32_flops_per_s=67 * _T,
                         bandwidth_bytes_per_s=4800 * _GB, memory_bytes=141 * _GB,
                         op_overhead_s=4e-6, source="NVIDIA H200 datasheet, SXM",
                         host_link_bytes_per_s=_LINK_EFFICIENCY * 128 * _GB / 2, asynchronous=True,
                         board_power_w=700, link_bytes_per_s=900 * _GB / 2),
}


def preset(target: str | DevicePreset) -> DevicePreset:
    """The preset for a target name (``"cpu"``, ``"v100"``, ``"a100"``, ``"h100"``, ``"h200"``).

    Example:
        >>> preset("h100").bandwidth_bytes_per_s
        3350000000000
    """
    if isinstance(target, DevicePreset):
        return target
    key = str(target).lower()
    if key not in PRESETS:
        raise ValueError(f"unknown target {target!r}; known device presets: {sorted(PRESETS)}")
    return PRESETS[key]


def profile_preset(device: str, cost_model: str = "") -> DevicePreset | None:
    """The preset a Profile was made for, from its ``device`` and ``cost_model`` fields.

    A fake-mode profile names its target (``device="h100"``, ``cost_model="roofline:h100"``);
    a measured one names the device it ran on (``"cpu"``, ``"cuda:0"``), which says nothing of
    its host link: ``None`` then, except for ``"cpu"`` (the CPU preset).

    Example:
        >>> profile_preset("h100", "roofline:h100").name
        'h100'
        >>> profile_preset("cuda:0") is None
        True
    """
    name = cost_model.split(":", 1)[1] if cost_model.startswith("roofline:") else device
    key = str(name).lower()
    if key in PRESETS:
        return PRESETS[key]
    return PRESETS["cpu"] if key.startswith("cpu") else None


def op_time_s(flops: int, bytes_moved: int, dtype: str, device: DevicePreset) -> float:
    """Roofline time of one op, seconds (0 for a pure view).

    Example:
        >>> op_time_s(0, 0, "float32", preset("h100"))
        0.0
    """
    if flops == 0 and bytes_moved == 0:
        return 0.0
    compute = flops / device.peak_for(dtype)
    memory = bytes_moved / device.bandwidth_bytes_per_s
    return max(compute, memory) + device.op_overhead_s


_RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
                "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
                "broadcast": lambda n: 1.0}


def collective_time_s(name: str, nbytes: int, world_size: int, device: DevicePreset) -> float | None:
    """Time of the collective ``name`` on tensors of ``nbytes`` (the larger of its input and
    output), over ``device``'s link (NOTE [collective times]); None where the device has no
    link figure or ``name`` is no collective it knows (the roofline time applies).

    Example:
        >>> round(collective_time_s("_c10d_functional.all_reduce.default", 2**20, 2, preset("h100")) * 1e6, 2)
        6.33
    """
    if device.link_bytes_per_s <= 0 or world_size < 2:
        return None
    op = name.split(".")[1] if "." in name else name
    for kind, factor in _RING_FACTOR.items():
        if op.startswith(kind):
            return factor(world_size) * nbytes / device.link_bytes_per_s + device.op_overhead_s
    return None
