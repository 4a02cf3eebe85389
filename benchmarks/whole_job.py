"""Whole-job memory (NOTE [the job's memory]): predicted against measured on this CPU.

For zoo GPTs trained with AdamW (and SGD with momentum), each planned for a device memory of
weights + gradients + optimizer states + half the activation peak, three real optimizer steps
are measured with the CPU allocator; the measured total (weights plus the allocator's peak
over the steps, optimizer states included) is compared with ``plan.memory.total_bytes``.

Usage (from the repository root)::

    python -m benchmarks.whole_job
"""

from __future__ import annotations

import torch

import memfit
from memfit import zoo
from memfit.profiling.meters import AllocatorMeter
from memfit.profiling.optimizer import optimizer_memory

CASES = [
    ("gpt 4x128 seq 128, batch 4", dict(n_layer=4, d_model=128, n_head=4, seq_len=128), 4, "adamw"),
    ("gpt 4x128 seq 128, batch 4", dict(n_layer=4, d_model=128, n_head=4, seq_len=128), 4, "sgd-momentum"),
    ("gpt 6x256 seq 256, batch 4", dict(n_layer=6, d_model=256, n_head=4, seq_len=256), 4, "adamw"),
]


def run_case(options: dict, batch: int, opt_name: str) -> tuple[int, int, int]:
    torch.manual_seed(0)
    model = zoo.gpt(dropout=0.0, **options)
    x = torch.randint(0, 512, (batch, options["seq_len"]))
    prof = memfit.profile(model, x)
    states = optimizer_memory(opt_name, prof.parameters).state_bytes
    weights = sum(p.nbytes for p in prof.parameters) + prof.buffer_bytes
    grads = sum(p.nbytes for p in prof.parameters if p.trainable)
    device = weights + grads + states + prof.peak_bytes // 2
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if opt_name == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    memfit.fit(model, x, device_memory=device, optimizer=opt)
    predicted = model.memfit_plan.memory.total_bytes
    with AllocatorMeter() as m:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            out = model(x)
            out.sum().backward()
            del out
            opt.step()
    return device, predicted, weights + m.peak_bytes


def main() -> None:
    print(f"{'model':<28} {'optimizer':<13} {'device':>12} {'predicted':>12} {'measured':>12} "
          f"{'meas/pred':>9} {'meas/device':>11}")
    for label, options, batch, opt_name in CASES:
        device, predicted, measured = run_case(options, batch, opt_name)
        print(f"{label:<28} {opt_name:<13} {device:>12,} {predicted:>12,} {measured:>12,} "
              f"{measured / predicted:>9.4f} {measured / device:>11.4f}")


if __name__ == "__main__":
    main()
