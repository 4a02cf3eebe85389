"""Markdown tables of a trade-off result (the JSON ``benchmarks.tradeoff`` writes)."""

from __future__ import annotations

from typing import Any

__all__ = ["markdown", "methods_table", "comparisons_table", "tuned_table"]

MIB = 2**20


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:.1f}"


def _pct(x: float | None, signed: bool = True) -> str:
    if x is None:
        return "-"
    return f"{x:+.1%}" if signed else f"{x:.0%}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _yes(x: bool | None) -> str:
    return "-" if x is None else ("yes" if x else "NO")


def _esc(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _notes(r: dict[str, Any]) -> str:
    bits = []
    if r.get("reason"):
        bits.append(r["reason"])
    if r.get("error") and r["error"] != r.get("reason"):
        bits.append(f"error: {r['error']}")
    info = r.get("info", {})
    if info.get("same_plan_as"):
        bits.append(f"same plan as {info['same_plan_as']}")
    if info.get("matched_peer"):
        bits.append(f"budget = {info['matched_peer']}'s measured peak")
    if r["name"] == "memfit_min" and info.get("budget_bytes"):
        bits.append("smallest feasible budget")
    tuning = info.get("tuning")
    if tuning:
        timed = sum(1 for c in tuning["candidates"] if c.get("measured_s") is not None)
        bits.append(f"tuned: chose {tuning['chosen']} of {timed} timed candidates")
    if "n_regions" in info:
        bits.append(f"{info['n_regions']} regions, {info['n_saved_ops']} saved ops")
    if info.get("segments"):
        bits.append(f"{info['segments']} segments")
    cache = info.get("compile_cache")
    if cache:
        hit = cache.get("fxgraph_cache_hit", 0) + cache.get("autograd_cache_hit", 0)
        bits.append("compile cache warm" if hit else "compile cache cold")
    if r.get("grads_equal") is False and r.get("max_abs_grad_diff") is not None:
        bits.append(f"max |grad diff| {r['max_abs_grad_diff']:.2e}")
    return _esc("; ".join(bits))


def methods_table(result: dict[str, Any]) -> str:
    recs = result["methods"]
    base = next((r for r in recs if r["name"] == "none"), None)
    base_peak = base["peak_bytes"] if base else None
    lines = [
        "| method | peak MiB | peak vs none | predicted MiB | step s | pred. time s | overhead | CPU s "
        "| CPU overhead | plan s | compile s | grads bitwise | buffers equal | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|:-:|---|",
    ]
    for r in recs:
        frac = r["peak_bytes"] / base_peak if (r["peak_bytes"] and base_peak) else None
        lines.append(
            f"| {r['name']} | {_mib(r['peak_bytes'])} | {_pct(frac, signed=False)} | "
            f"{_mib(r['predicted_peak_bytes'])} | {_s(r['step_s'])} | "
            f"{_s(r.get('info', {}).get('predicted_step_s'))} | {_pct(r['overhead'])} | "
            f"{_s(r.get('cpu_s'))} | {_pct(r.get('cpu_overhead'))} | "
            f"{_s(r['planning_s'])} | {_s(r['compile_s'])} | {_yes(r['grads_equal'])} | "
            f"{_yes(r['buffers_equal'])} | {_notes(r)} |"
        )
    return "\n".join(lines)


def comparisons_table(result: dict[str, Any]) -> str:
    rows = result.get("comparisons", [])
    if not rows:
        return "_no peer could be compared with memfit in this run_"
    lines = [
        "| peer | peer peak MiB | peer step s | memfit at peer's peak: peak MiB | step s | time ratio "
        "| CPU ratio | peak <= peer | fastest memfit within peer's peak | step s | time ratio | CPU ratio |",
        "|---|---:|---:|---:|---:|---:|---:|:-:|---|---:|---:|---:|",
    ]
    for c in rows:
        matched = (f"{_mib(c.get('matched_peak_bytes'))} | {_s(c.get('matched_step_s'))} | "
                   f"{c['matched_time_ratio']:.3f} | {_r(c.get('matched_cpu_ratio'))} | "
                   f"{_yes(c.get('matched_peak_ok'))}"
                   if "matched_time_ratio" in c else
                   f"{_esc(c.get('matched_reason') or 'not run')} | - | - | - | -")
        best = (f"{c['best']} | {_s(c['best_step_s'])} | {c['best_time_ratio']:.3f} | {_r(c.get('best_cpu_ratio'))}"
                if "best" in c else "none fits | - | - | -")
        lines.append(f"| {c['peer']} | {_mib(c['peer_peak_bytes'])} | {_s(c['peer_step_s'])} | {matched} | {best} |")
    return "\n".join(lines)


def tuned_table(result: dict[str, Any]) -> str:
    """Per peer: memfit's plan for the peer's measured peak, untuned and tuned (``memfit_tuned@``),
    each with its time ratio to the peer (below 1: memfit faster)."""
    by_name = {r["name"]: r for r in result["methods"]}
    lines = [
        "| peer | peer peak MiB | peer step s | memfit | chose | peak MiB | step s | time ratio | CPU ratio "
        "| peak <= peer |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|:-:|",
    ]
    for c in result.get("comparisons", []):
        peer = by_name[c["peer"]]
        for kind, name in (("memfit", f"memfit@{c['peer']}"), ("memfit (tuned)", f"memfit_tuned@{c['peer']}")):
            r = by_name.get(name)
            head = f"| {c['peer']} | {_mib(peer['peak_bytes'])} | {_s(peer['step_s'])} | {kind} |"
            if r is None or not r.get("step_s") or not r.get("peak_bytes"):
                why = "not run" if r is None else (r.get("reason") or r.get("error") or "not measured")
                lines.append(f"{head} {_esc(why)} | - | - | - | - | - |")
                continue
            tuning = r.get("info", {}).get("tuning")
            chose = tuning["chosen"] if tuning else r.get("info", {}).get("solver", "-")
            cpu = r["cpu_s"] / peer["cpu_s"] if r.get("cpu_s") and peer.get("cpu_s") else None
            lines.append(f"{head} {_esc(str(chose))} | {_mib(r['peak_bytes'])} | {_s(r['step_s'])} | "
                         f"{r['step_s'] / peer['step_s']:.3f} | {_r(cpu)} | {_yes(r['peak_bytes'] <= peer['peak_bytes'])} |")
    if len(lines) == 2:
        return "_no peer could be compared with memfit in this run_"
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    """The result as markdown: a header with the environment, the methods, the comparisons."""
    env = result.get("environment", {})
    st = result.get("settings", {})
    mf = result.get("memfit", {})
    head = [
        f"## {result['model']}: {result['description']}",
        "",
        f"torch {env.get('torch_version', '?')}, {env.get('cpu_model', '?')}, "
        f"{env.get('threads', '?')} threads, commit {str(env.get('git_commit', '?'))[:12]}"
        f"{' (dirty)' if env.get('git_dirty') else ''}, {env.get('date', '?')}; "
        f"malloc pinned: {all(env.get('malloc', {}).values()) if env.get('malloc') else '?'}; "
        f"{st.get('warmup')} warm-up + {st.get('repeats')} timed rounds, interleaved, median"
        f"{' (quick)' if st.get('quick') else ''}; memfit profile {mf.get('profile_s', 0):.1f} s"
        + (f"; load average {result['load_average'][0]} -> {result['load_average'][1]} on "
           f"{env.get('extra', {}).get('cpu_count', '?')} cores while timing" if result.get("load_average") else "")
        + ".",
        "",
        "Peak = activation memory above the start of the step (CPU allocator). Step = median wall time; "
        "CPU = median CPU time of this process (all threads), which other processes on the same cores "
        "inflate much less. Time ratio = memfit / peer, wall (below 1: memfit faster).",
        "",
        methods_table(result),
        "",
        comparisons_table(result),
        "",
        "memfit and memfit (tuned: the solver's best few plans and the baselines that fit, timed on "
        "the model, fastest kept) at each peer's measured peak; ratios are to the peer, from the "
        "same interleaved rounds:",
        "",
        tuned_table(result),
    ]
    from benchmarks.compiled_memfit import table as compiled_table
    if compiled_table(result):
        head += ["", compiled_table(result)]
    if result.get("errors"):
        head += ["", "Errors:", *[f"- {e}" for e in result["errors"]]]
    return "\n".join(head) + "\n"
