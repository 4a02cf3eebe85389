"""Per-layer saved bytes of a Megatron GPT layer in fake mode against Korthikanti et al.'s count.

    python -m benchmarks.fake_gpu_megatron [--target a100]

Korthikanti et al. 2022 count 34sbh + 5as^2b bytes per layer (bf16, dropout on the attention
probabilities and after both blocks, eager attention); with flash attention the s^2 terms go and
a (b, a, s) fp32 logsumexp comes: 34sbh + 4asb. "Per layer" is the difference between the
fake-mode profiles of 2 and 1 layers (tests/profiling/test_fake_gpu.py says why). Prints a
markdown table; seconds per shape on a CPU, as fake mode makes meta tensors only.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from benchmarks.gpu_fake_check import MegatronLayer

SHAPES = ((6144, 64, 2048, 4), (4096, 32, 8192, 1))


def per_layer_saved(h: int, a: int, s: int, b: int, attention: str, target: str) -> int:
    import memfit

    x = torch.zeros(b, s, h, dtype=torch.bfloat16, device="meta")
    saved = []
    for n in (1, 2):
        with torch.device("meta"):
            model = nn.Sequential(*(MegatronLayer(h, a, s, attention) for _ in range(n)))
        saved.append(memfit.profile(model.to(torch.bfloat16), x, mode="fake", target=target).saved_bytes)
    return saved[1] - saved[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="a100")
    args = ap.parse_args(argv)
    print(f"| shape (h, a, s, b) | attention | reference | bytes | target {args.target} | ratio |"
          " target cpu | ratio |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for h, a, s, b in SHAPES:
        for attention in ("eager", "sdpa"):
            if attention == "eager":
                ref, name = 34 * s * b * h + 5 * a * s * s * b, "34sbh + 5as^2b"
            else:
                ref, name = 34 * s * b * h + 4 * a * s * b, "34sbh + 4asb (flash)"
            got = per_layer_saved(h, a, s, b, attention, args.target)
            cpu = per_layer_saved(h, a, s, b, attention, "cpu")
            print(f"| ({h}, {a}, {s}, {b}) | {attention} | {name} | {ref:,} | {got:,} | "
                  f"{got / ref:.4f} | {cpu:,} | {cpu / ref:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
