"""memfit beside the published optimisers' own tables, and the planner's own cost at depth.

Published figures are the papers' (their hardware, their frameworks); memfit's are predicted,
from fake-mode profiles with the paper's GPU preset (``target="v100"`` for MONeT and
Checkmate: NVIDIA V100 SXM2 16GB datasheet figures in ``memfit.timemodel.devices``), so the
comparison is of plans, not of measured runs.

- MONeT (Shah et al., ICLR 2021), ResNet-50 at 224x224, batch 184, fp32, SGD: the whole job in
  10.01 / 8.01 / 6.00 / 4.99 GB; MONeT's overhead +3.2% / +5.6% / +9.3% / +12.0%.
- Checkmate (Jain et al., MLSys 2020), VGG19 largest batch on a 16 GB V100: 167 without
  checkpointing, 197 with sqrt(n), 289 with Checkmate (``--checkmate``: benchmarks.largest_batch,
  some minutes).
- Chen et al. 2016, a ~1,000-layer ResNet on ImageNet, 48 GB to 7 GB at about +30%: here a
  bottleneck ResNet of 998 layers (33 / 100 / 166 / 33 blocks) at 224x224, batch 16, fp32,
  v100 preset, planned at 7/48 of its plain activation peak (``--only chen``).
- Korthikanti et al. 2022, the 22B GPT layer shape (h 6144, 64 heads, s 2048, b 4, bf16,
  eager attention with dropout), 48 layers, a100 preset: full recompute costs them +39%;
  memfit at full recompute's (every_block's) predicted peak (``--only korthikanti``).
- Planner scale: Llama 3 405B layer shapes (hidden 16384, 128 heads, 8 KV heads, MLP 53248,
  vocab 128256), bf16, h100 preset, batch 4 at sequence 8192, 8 / 32 / 126 layers: planning
  seconds and the planner's resident memory at 40%, 70% and "min", and an infeasible budget
  at batch 1 (where gradients set the peak).

Usage (from the repository root)::

    python -m benchmarks.published [--only monet,chen,korthikanti,scale] [--checkmate] [--layers 8,32,126]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from torch import nn

import memfit
from memfit.errors import InfeasibleBudget

GB = 10**9
MONET = [(10.01, 0.032), (8.01, 0.056), (6.00, 0.093), (4.99, 0.120)]


class Bottleneck(nn.Module):
    """ResNet-50's block (torchvision's layout: stride on the 3x3 conv)."""

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = width * 4
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
                           if stride != 1 or c_in != c_out else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + idt)


def resnet50(num_classes: int = 1000, stages: tuple[int, ...] = (3, 4, 6, 3)) -> nn.Module:
    """ResNet-50 (3, 4, 6, 3 bottlenecks; other counts per stage by ``stages``) on the meta device."""
    with torch.device("meta"):
        layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                   nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
        c = 64
        for i, (n, w) in enumerate(zip(stages, (64, 128, 256, 512), strict=True)):
            blocks = []
            for k in range(n):
                blocks.append(Bottleneck(c, w, 2 if k == 0 and i > 0 else 1))
                c = w * 4
            layers.append(nn.Sequential(*blocks))
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, num_classes))


def monet() -> None:
    from memfit.measuring.codec_cost import codec_costs_for
    from memfit.planning.compress_pass import choose
    from memfit.planning.planner import plan_for_budget
    from memfit.profiling.compiled_costs import for_compiler

    t0 = time.perf_counter()
    prof = memfit.profile(resnet50(), torch.empty(184, 3, 224, 224, device="meta"), mode="fake", target="v100")
    secs = time.perf_counter() - t0
    costs = codec_costs_for("lossless", profile=prof)
    variant_costs = codec_costs_for("lossy", None, profile=prof)
    compiled = for_compiler(prof)  # NOTE [compiled costs]
    print(f"MONeT setting: ResNet-50 224x224 batch 184 fp32, SGD, v100 preset (profile {secs:.0f} s; "
          f"plain step {prof.step_time_s * 1e3:.0f} ms predicted, activation peak {prof.peak_bytes / GB:.2f} GB)")
    print("  memfit: recompute only; + lossless: and the exact codecs (relu's bits, max pool's "
          "input as shape_only, narrowed indices; v100 costs estimated from their passes);\n"
          "  + bn variants: and the batch norms rebuilt from their outputs (bn_from_output, "
          "compress='lossy' with lossy_codec=None: gradients within fp32 roundings, not bitwise)")
    print("  compiled: recompute only, priced as torch.compile runs the step (memfit.Search(compiled=True):"
          " pointwise ops fused, 0 s; overhead of the compiled step's estimate, "
          f"{for_compiler(prof).step_time_s * 1e3:.0f} ms)")
    print(f"  {'memory':>8}  {'MONeT':>7}  {'memfit':>8}  {'solver':<7} {'activations':>11}  "
          f"{'+ lossless':>10} {'activations':>11}  {'+ bn variants':>13} {'activations':>11}  "
          f"{'compiled':>8}  plan seconds")
    for gb, theirs in MONET:
        t0 = time.perf_counter()
        spec = memfit.Job(device=int(gb * GB), optimizer="sgd", reserve=0).spec(prof)

        def solve(b, spec=spec):
            return plan_for_budget(prof, budget=b, job=spec)

        def solve_on(p, b, spec=spec):
            return plan_for_budget(p, budget=b, job=spec)

        cells = []
        for compress in (None, "lossless", "lossy"):
            try:
                p = (solve(None) if compress is None else
                     choose(prof, solve, None, mode=compress, lossy_codec=None,
                            costs=costs if compress == "lossless" else variant_costs, solve_on=solve_on))
                cells.append((f"+{p.recompute_s / prof.step_time_s:.1%}", f"{p.predicted_peak_bytes / GB:.2f} GB",
                              p.solver))
            except InfeasibleBudget as e:
                cells.append(("no plan", f">= {e.min_feasible_bytes / GB:.2f} GB", "-"))
        try:
            p = plan_for_budget(compiled, budget=None, job=spec)
            fused = f"+{p.recompute_s / compiled.step_time_s:.1%}"
        except InfeasibleBudget:
            fused = "no plan"
        (ours, acts, solver), (packed, packed_acts, _), (bn, bn_acts, _) = cells
        print(f"  {gb:>6.2f}GB  {f'+{theirs:.1%}':>7}  {ours:>8}  {solver:<7} {acts:>11}  "
              f"{packed:>10} {packed_acts:>11}  {bn:>13} {bn_acts:>11}  {fused:>8}  "
              f"{time.perf_counter() - t0:.1f}")


def _llama(layers: int, batch: int, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=16384, intermediate_size=53248, num_attention_heads=128,
                      num_key_value_heads=8, vocab_size=128256, num_hidden_layers=layers,
                      max_position_embeddings=seq, rope_theta=500000.0, torch_dtype=torch.bfloat16)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, ids


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def scale(layer_counts: list[int]) -> None:
    print("Planner scale: Llama 3 405B layer shapes, bf16, h100 preset, solver auto "
          "(seconds of memfit.plan; RSS: the process's peak resident MiB after it)")
    print(f"  {'layers':>6}  {'batch x seq':>11}  {'budget':>7}  {'seconds':>7}  {'RSS MiB':>7}  result")
    for n in layer_counts:
        for batch, seq, budgets in ((4, 8192, (0.4, 0.7, "min")), (1, 4096, (0.4,))):
            model, ids = _llama(n, batch, seq)
            prof = memfit.profile(model, ids, loss_fn=lambda out: out.logits.float().mean(), mode="fake",
                                   target="h100")
            del model
            for b in budgets:
                t0 = time.perf_counter()
                try:
                    p = memfit.plan(prof, budget=b)
                    res = (f"{p.solver}, peak {p.predicted_peak_bytes / 2**30:.1f} GiB, "
                           f"+{p.recompute_s / prof.step_time_s:.1%}, {len(p.regions)} regions")
                except InfeasibleBudget as e:
                    res = f"infeasible, smallest {e.min_feasible_bytes / 2**30:.1f} GiB"
                secs = time.perf_counter() - t0
                label = f"{b:.0%}" if isinstance(b, float) else b
                print(f"  {n:>6}  {f'{batch} x {seq}':>11}  {label:>7}  {secs:>7.2f}  {_rss_mib():>7.0f}  {res}",
                      flush=True)


CHEN_STAGES = (33, 100, 166, 33)  # 3 x 332 convs + the stem conv and the classifier: 998 layers
CHEN_RATIO, CHEN_OVERHEAD = 7 / 48, 0.30
KORTHIKANTI_FULL = 0.39  # their full-recompute overhead at the 22B shape (their Table 4)


def chen() -> None:
    t0 = time.perf_counter()
    prof = memfit.profile(resnet50(stages=CHEN_STAGES), torch.empty(16, 3, 224, 224, device="meta"),
                          mode="fake", target="v100")
    secs = time.perf_counter() - t0
    print(f"Chen setting: bottleneck ResNet, {3 * sum(CHEN_STAGES) + 2} layers, 224x224, batch 16, fp32, "
          f"v100 preset (profile {secs:.0f} s; plain activation peak {prof.peak_bytes / GB:.2f} GB)")
    print(f"  {'budget':>16}  {'Chen':>6}  {'memfit':>7}  {'solver':<7} {'peak':>9}  plan seconds")
    for label, budget in ((f"{CHEN_RATIO:.1%} (7/48)", int(prof.peak_bytes * CHEN_RATIO)), ("sqrt", None),
                          ("min", "min")):
        t0 = time.perf_counter()
        try:
            p = (memfit.plan(prof, budget=0.99, solver="sqrt") if budget is None
                 else memfit.plan(prof, budget=budget))
            ours = f"+{p.recompute_s / prof.step_time_s:.1%}"
            peak = f"{p.predicted_peak_bytes / prof.peak_bytes:.1%}"
            solver = p.solver
        except InfeasibleBudget as e:
            ours, peak, solver = "no plan", f">= {e.min_feasible_bytes / prof.peak_bytes:.1%}", "-"
        theirs = f"+{CHEN_OVERHEAD:.0%}" if budget is not None and budget != "min" else "-"
        print(f"  {label:>16}  {theirs:>6}  {ours:>7}  {solver:<7} {peak:>9}  {time.perf_counter() - t0:.1f}")


def korthikanti() -> None:
    from benchmarks.gpu_fake_check import MegatronLayer

    h, a, s, b, n = 6144, 64, 2048, 4, 48
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = nn.Sequential(*(MegatronLayer(h, a, s, "eager") for _ in range(n))).to(torch.bfloat16)
    x = torch.empty(b, s, h, dtype=torch.bfloat16, device="meta")
    prof = memfit.profile(model, x, mode="fake", target="a100")
    secs = time.perf_counter() - t0
    full = memfit.plan(prof, budget=1.0, solver="every_block")
    ours = memfit.plan(prof, budget=full.predicted_peak_bytes)
    print(f"Korthikanti setting: 22B layer shape (h {h}, {a} heads, s {s}, b {b}), {n} layers, bf16, "
          f"a100 preset (profile {secs:.0f} s)")
    print(f"  at full recompute's peak {full.predicted_peak_bytes / GB:.1f} GB "
          f"({full.predicted_peak_bytes / prof.peak_bytes:.1%} of plain): full recompute published "
          f"+{KORTHIKANTI_FULL:.0%}, predicted +{full.recompute_s / prof.step_time_s:.1%}; memfit "
          f"+{ours.recompute_s / prof.step_time_s:.1%} ({ours.solver}, peak "
          f"{ours.predicted_peak_bytes / GB:.1f} GB, {len(ours.regions)} regions)")


def checkmate() -> None:
    from benchmarks.largest_batch import TARGET, vgg19

    model = vgg19()
    rows = []
    for label, solver in (("none", "none"), ("sqrt(n)", "sqrt"), ("memfit", "auto")):
        found = memfit.largest_batch(lambda n: (model, torch.empty(n, 3, 224, 224, device="meta")),
                                     device_memory="16GiB", optimizer="sgd", target=TARGET,
                                     solver=solver, reserve=0)
        rows.append((label, found.batch))
    print("Checkmate setting: VGG19 largest batch, 16 GiB, v100 preset "
          "(Checkmate: none 167, sqrt(n) 197, Checkmate 289)")
    for label, batch in rows:
        print(f"  {label:<8} {batch:>5}  ({batch / rows[0][1]:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="monet,chen,korthikanti,scale",
                    help="sections: monet, chen, korthikanti, scale")
    ap.add_argument("--checkmate", action="store_true", help="also the VGG19 largest-batch search (minutes)")
    ap.add_argument("--layers", default="8,32,126", help="layer counts of the scale table")
    args = ap.parse_args()
    only = {s.strip() for s in args.only.split(",")}
    if "monet" in only:
        monet()
    if "chen" in only:
        chen()
    if "korthikanti" in only:
        korthikanti()
    if args.checkmate:
        checkmate()
    if "scale" in only:
        scale([int(x) for x in args.layers.split(",")])


if __name__ == "__main__":
    main()
