"""The report of ``benchmarks.gpu_probe``: memfit's fake-mode predictions (made here) beside what
the GPU measured (``measure``, and ``trace`` / ``job`` where their files sit beside it).

    python -m benchmarks.gpu_probe report benchmarks/results/gpu-probe-2026-12-04/measured.json \
        --out benchmarks/results/gpu-probe-2026-12-04/report.md
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from benchmarks.gpu_probe_cases import GB, cases, fake_profile

COMPUTE_KINDS = ("conv", "matmul", "attention")


def kind(name: str) -> str:
    """The op type a second is booked to (forward and backward ops alike)."""
    n = name.removeprefix("aten.")
    rules = (("convolution", "conv"), ("scaled_dot_product", "attention"), ("flash_attention", "attention"),
             ("efficient_attention", "attention"), ("batch_norm", "batch norm"),
             ("layer_norm", "layer norm"), ("relu", "relu"), ("threshold", "relu"),
             ("dropout", "dropout"), ("bernoulli", "dropout"), ("softmax", "softmax"),
             ("gelu", "gelu"), ("max_pool", "max pool"))
    for word, k in rules:
        if word in n:
            return k
    if n.split(".")[0] in ("mm", "bmm", "addmm", "matmul", "linear", "baddbmm"):
        return "matmul"
    if n.startswith("add.Tensor"):
        return "add"
    return "other"


def _phase(p: Any) -> str:
    return "forward" if getattr(p, "value", p) == "forward" else "backward"


def by_kind(rows: list[tuple[str, Any, float]]) -> dict[str, dict[str, float]]:
    """Seconds by phase, then op type."""
    out: dict[str, dict[str, float]] = {}
    for name, phase, t in rows:
        d = out.setdefault(_phase(phase), {})
        d[kind(name)] = d.get(kind(name), 0.0) + t
    return out


def measured_time_profile(prof: Any, measured: dict[str, dict[str, float]]) -> Any:
    """``prof`` with each op's seconds scaled by its (phase, op type)'s measured/roofline ratio."""
    roof = by_kind([(o.name, o.phase, o.time_s) for o in prof.ops])
    ops = []
    for o in prof.ops:
        ph, k = _phase(o.phase), kind(o.name)
        r, m = roof.get(ph, {}).get(k, 0.0), measured.get(ph, {}).get(k)
        ops.append(dataclasses.replace(o, time_s=o.time_s * (m / r)) if r > 0 and m is not None else o)
    return dataclasses.replace(prof, ops=tuple(ops), step_time_s=sum(o.time_s for o in ops))


def _load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def _peaks(rec: dict[str, Any], profs: dict[str, Any], every: dict[str, Any]) -> list[str]:
    lines = ["## Activation peaks: one step, gradients freed before it", "",
             "| case | plain predicted | measured | measured/predicted | every-block predicted | "
             "measured | measured/predicted |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rec["cases"]:
        if "error" in row:
            lines.append(f"| {row['case']} | error: {row['error']} | | | | | |")
            continue
        prof, eb = profs[row["case"]], every[row["case"]]
        mp, me = row["plain_peak_bytes"] or 0, row["every_block_peak_bytes"] or 0
        lines.append(f"| {row['case']} | {prof.peak_bytes:,} | {mp:,} | {mp / prof.peak_bytes:.3f} | "
                     f"{eb.predicted_peak_bytes:,} | {me:,} | {me / eb.predicted_peak_bytes:.3f} |")
    return lines


def _jobs(folder: Path, profs: dict[str, Any]) -> list[str]:
    import memfit

    default, expandable = _load(folder / "jobs.json"), _load(folder / "jobs-expandable.json")
    if not default:
        return []
    exp = {r["case"]: r for r in expandable or []}
    lines = ["", "## The whole job: 3 AdamW steps, plain and every-block (`gpu_probe job`)", "",
             "Predicted: memfit's breakdown for `device_memory=\"141GB\", optimizer=\"adamw\"` (weights, "
             "gradients, AdamW states, the step's transients, the activation peak) without its reserve; "
             "measured: `max_memory_allocated` over the steps. Beyond it: the allocator's reserved peak "
             "plus the CUDA context (`mem_get_info`) minus the allocated peak, with the default allocator "
             "and with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, against memfit's default "
             "reserve.", "",
             "| case | plan | predicted | measured | measured/predicted | beyond it, default | "
             "expandable | memfit's reserve |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in default:
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error']} | | | | | | |")
            continue
        for key, solver in (("plain", "none"), ("every_block", "every_block")):
            p = memfit.plan(profs[r["case"]], budget="100%", solver=solver, device_memory="141GB",
                            optimizer="adamw")
            m = p.memory
            pred = m.total_bytes - m.reserve_bytes
            got = r[key]

            def over(g: dict[str, Any]) -> int:
                return g["reserved_peak_bytes"] + g["context"]["context_bytes"] - g["allocated_peak_bytes"]

            e = exp.get(r["case"], {}).get(key)
            lines.append(f"| {r['case']} | {key} | {pred / GB:.3f} GB | {got['allocated_peak_bytes'] / GB:.3f} GB | "
                         f"{got['allocated_peak_bytes'] / pred:.3f} | {over(got) / GB:.2f} GB | "
                         f"{'-' if e is None else f'{over(e) / GB:.2f} GB'} | {m.reserve_bytes / GB:.2f} GB |")
    return lines


def _temporaries(folder: Path) -> list[str]:
    traces = [t for f in sorted(folder.glob("traces*.json")) for t in _load(f) or []]
    if not traces:
        return []
    lines = ["", "## Kernel temporaries: the most allocated inside one op above what it leaves (`gpu_probe trace`)",
             "", "| case (settings) | op | phase | calls | largest temporary | its output |",
             "| --- | --- | --- | ---: | ---: | ---: |"]
    for row in traces:
        if "error" in row:
            continue
        agg: dict[tuple[str, str], list[tuple[int, int]]] = {}
        tr = row["trace"]
        for i, (n, ph, after, most) in enumerate(tr):
            before = tr[i - 1][2] if i else 0
            if most - after >= 1 << 20:
                agg.setdefault((n, ph), []).append((most - after, after - before))
        for (n, ph), v in sorted(agg.items(), key=lambda kv: -max(x[0] for x in kv[1])):
            big = max(v)
            lines.append(f"| {row['case']} {row['settings'] or ''} | {n.removeprefix('aten.')} | {ph} | "
                         f"{len(v)} | {big[0]:,} | {big[1]:,} |")
    return lines


def _kinds(row: dict[str, Any], prof: Any, eb: Any) -> list[str]:
    import memfit

    meas = by_kind([tuple(r) for r in row["ops"]])
    roof = by_kind([(o.name, o.phase, o.time_s) for o in prof.ops])
    calib = measured_time_profile(prof, meas)
    eb_cal = memfit.simulate(calib, eb)
    op_sum = sum(sum(d.values()) for d in meas.values())
    lines = ["", f"### {row['case']}: {row['description']}", "",
             f"Step: measured {row['plain_step_s'] * 1e3:.2f} ms (its ops' CUDA times sum to "
             f"{op_sum * 1e3:.2f} ms), roofline {prof.step_time_s * 1e3:.2f} ms. Every-block "
             f"checkpointing: measured {row['every_block_step_s'] / row['plain_step_s'] - 1:+.1%}; "
             f"predicted {eb.recompute_s / prof.step_time_s:+.1%} (roofline), "
             f"{eb_cal.recompute_s / calib.step_time_s:+.1%} (op types at their measured seconds).", "",
             "| phase | op type | measured ms | roofline ms | measured/roofline |", "| --- | --- | ---: | ---: | ---: |"]
    for ph in ("forward", "backward"):
        for k in sorted(set(meas.get(ph, {})) | set(roof.get(ph, {}))):
            m, r = meas.get(ph, {}).get(k, 0.0), roof.get(ph, {}).get(k, 0.0)
            if m >= 1e-6 or r >= 1e-6:
                lines.append(f"| {ph} | {k} | {m * 1e3:.3f} | {r * 1e3:.3f} | {m / r if r else float('inf'):.2f} |")
    for src, d in (("measured", meas), ("roofline", roof)):
        tot: dict[str, float] = {}
        for part in d.values():
            for k, v in part.items():
                tot[k] = tot.get(k, 0.0) + v
        comp = sum(v for k, v in tot.items() if k in COMPUTE_KINDS)
        mem = sum(v for k, v in tot.items() if k not in COMPUTE_KINDS)
        lines.append(f"- {src}: memory-bound ops / compute ops = {mem / comp if comp else float('nan'):.3f}")
    dev = sorted({n.removeprefix("aten.") for n, ph, _ in row["ops"]
                  if ph == "forward" and kind(n) in ("attention", "dropout", "batch norm")})
    fake = sorted({o.name.removeprefix("aten.") for o in prof.ops[: prof.n_forward]
                   if kind(o.name) in ("attention", "dropout", "batch norm")})
    lines.append(f"- kernels: the device ran {', '.join(dev) or 'none'}; fake mode recorded {', '.join(fake) or 'none'}")
    return lines


def _monet(prof: Any, measured: list[tuple[str, dict[str, dict[str, float]]]]) -> list[str]:
    """MONeT's memories planned on the roofline and on each measured-seconds profile."""
    import memfit
    from benchmarks.published import MONET
    from benchmarks.published_gap import abn
    from memfit.errors import InfeasibleBudget

    def plan(p: Any, gb: float) -> Any:
        try:
            return memfit.plan(p, device_memory=int(gb * GB), optimizer="sgd", reserve=0)
        except InfeasibleBudget as e:
            return e

    def pct(p: Any, prof_: Any) -> str:
        if isinstance(p, InfeasibleBudget):
            return f"none (>= {p.min_feasible_bytes / GB:.2f} GB)"
        return f"+{p.recompute_s / prof_.step_time_s:.1%}"

    lines = ["", "## MONeT's setting with GPU-measured seconds", "",
             "ResNet-50, batch 184, fp32, whole job with SGD in MONeT's four memories. `roofline`: the "
             "h200 preset's profile as `benchmarks.published` plans it. `measured`: the same profile with "
             "each (phase, op type)'s seconds scaled to what the H200 measured, with cuDNN's default TF32 "
             "convolutions and with TF32 off (true fp32, as on MONeT's V100, which has no TF32). "
             "`roofline plan, measured` is the roofline's plan costed with measured seconds; `abn` the "
             "in-place activated batch norm what-if of `benchmarks.published_gap` on the measured profile.", "",
             "| memory | MONeT (V100) | roofline | " + " | ".join(
                 f"roofline plan, {n} | planned on {n} | abn, {n}" for n, _ in measured) + " |",
             "| ---: | ---: | ---: | " + " | ".join("---: | ---: | ---:" for _ in measured) + " |"]
    cal = [(n, measured_time_profile(prof, m)) for n, m in measured]
    for gb, theirs in MONET:
        pr = plan(prof, gb)
        cells = [f"{gb:.2f} GB", f"+{theirs:.1%}", pct(pr, prof)]
        for _, c in cal:
            cells.append("-" if isinstance(pr, InfeasibleBudget) else
                         f"+{memfit.simulate(c, pr).recompute_s / c.step_time_s:.1%}")
            cells.append(pct(plan(c, gb), c))
            cells.append(pct(plan(abn(c), gb), c))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(measured_path: Path, target: str | None) -> str:
    import memfit

    folder = measured_path.parent
    rec = json.loads(measured_path.read_text())
    target = target or next((v for k, v in (("H200", "h200"), ("H100", "h100"), ("A100", "a100"))
                             if k in rec["device"].upper()), "h100")
    by_name = {c.name: c for c in cases(rec["quick"])}
    profs = {n: fake_profile(c, target) for n, c in by_name.items()}
    every = {n: memfit.plan(p, budget="100%", solver="every_block") for n, p in profs.items()}
    ctx = (f" CUDA context (in use per `mem_get_info` beyond the allocator's reserve): "
           f"{rec['context_start']['context_bytes'] / 2**30:.3f} GiB after start, "
           f"{rec['context_end']['context_bytes'] / 2**30:.3f} GiB at the end." if "context_end" in rec else "")
    lines = [f"# Fake-mode predictions ({target} preset) vs {rec['device']} (torch {rec['torch']} there)", "",
             f"`python -m benchmarks.gpu_probe report {measured_path}`. memfit predicts here (fake mode, "
             f"{target} preset); the GPU ran torch alone. cuDNN TF32 {rec['cudnn_allow_tf32']}, matmul TF32 "
             f"{rec['matmul_allow_tf32']}; {rec['repeats']} timed steps each, plain and every-block in turn "
             f"(medians).{ctx}", ""]
    lines += _peaks(rec, profs, every)
    lines += _jobs(folder, profs)
    lines += _temporaries(folder)
    lines += ["", "## Seconds by op type, measured (CUDA events per op) and the roofline's"]
    rows = {row["case"]: row for row in rec["cases"] if "error" not in row}
    for name, row in rows.items():
        lines += _kinds(row, profs[name], every[name])
    if "resnet50" in rows and not rec["quick"]:
        measured = [("measured, TF32", by_kind([tuple(r) for r in rows["resnet50"]["ops"]]))]
        off = [t for t in _load(folder / "traces.json") or []
               if t["case"] == "resnet50" and t.get("settings") == {"cudnn_tf32": False} and "ops" in t]
        if off:
            measured.append(("measured, fp32", by_kind([tuple(r) for r in off[0]["ops"]])))
        lines += _monet(profs["resnet50"], measured)
    return "\n".join(lines) + "\n"
