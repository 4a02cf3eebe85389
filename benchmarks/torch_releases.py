"""memfit's suite and capabilities on every torch release of its range, one venv each.

    python -m benchmarks.torch_releases 2.9.1 2.11.0 2.13.0 2.14.1 2.15.0
    python -m benchmarks.torch_releases --table-only      # rewrite the table from the results

Run before declaring a torch range (not in CI: each release is a download of several GB and
a suite run). For each release: ``./run test-torch VERSION`` (the whole suite, every tier, in
``.venv-torch-VERSION``; 2.13.0 also in that venv, so that every release runs alike), then
``memfit doctor --json`` in the same venv. Writes ``benchmarks/results/torch-releases.json``
(each release's pytest summary, wall seconds and capability rows) and the table of
docs/torch-releases.md between its markers (NOTE [features by torch release] in
``memfit.torch_support.capabilities``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "torch-releases.json"
DOC = ROOT / "docs" / "torch-releases.md"
BEGIN, END = "<!-- torch-releases table: begin -->", "<!-- torch-releases table: end -->"
_SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+, )*\d+ (?:passed|failed)[^=]*?) in ([\d.]+)s", re.M)


def run_release(version: str, pytest_args: list[str]) -> dict[str, Any]:
    """The suite and ``memfit doctor`` on one release (its venv made by ``./run`` if needed)."""
    env = dict(os.environ)
    if tuple(map(int, version.split("."))) > (2, 14, 1):  # this machine's pip cap: ./run
        env["PIP_CONSTRAINT"] = "/dev/null"
    start = time.perf_counter()
    done = subprocess.run([str(ROOT / "run"), "test-torch", version, "-p", "no:cacheprovider",
                           *pytest_args], cwd=ROOT, env=env, capture_output=True, text=True)
    wall_s = time.perf_counter() - start
    found = _SUMMARY.findall(done.stdout)
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in done.stdout.splitlines()
              if line.startswith(("FAILED ", "ERROR "))]
    python = ROOT / f".venv-torch-{version}" / "bin" / "python"
    doctor = subprocess.run([str(python), "-m", "memfit", "doctor", "--json"], cwd=ROOT,
                            capture_output=True, text=True, env=env)
    caps = json.loads(doctor.stdout) if doctor.returncode == 0 else {"error": doctor.stderr}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    return {"version": version, "returncode": done.returncode, "commit": commit,
            "summary": found[-1][0] if found else done.stdout[-2000:], "wall_s": round(wall_s, 1),
            "failed": failed, "capabilities": caps}


def table(results: list[dict[str, Any]]) -> str:
    """Feature x release: full / degraded / refused, then each release's suite summary."""
    versions = [r["version"] for r in results]
    features: list[str] = []
    status: dict[tuple[str, str], str] = {}
    for r in results:
        for row in r["capabilities"].get("rows", []):
            if row["feature"] == "torch release":
                continue
            if row["feature"] not in features:
                features.append(row["feature"])
            text = row["status"] if row["status"] == "full" else f"{row['status']}: {row['how']}"
            status[row["feature"], r["version"]] = text
    lines = ["| feature | " + " | ".join(versions) + " |",
             "|---|" + "---|" * len(versions)]
    for f in features:
        lines.append(f"| {f} | " + " | ".join(status.get((f, v), "-") for v in versions) + " |")
    lines.append("| **suite** (`./run test-torch V`) | "
                 + " | ".join(f"{_summary(r['summary'])} ({r['wall_s']:.0f} s, {r.get('commit', '-')})"
                              for r in results) + " |")
    if any("rerun" in r for r in results):
        lines.append("| **rerun** of the test files changed since, and of those that failed | "
                     + " | ".join(f"{_summary(r['rerun']['summary'])} ({r['rerun']['commit']})"
                                  if "rerun" in r else "-" for r in results) + " |")
    return "\n".join(lines)


def _summary(text: str) -> str:
    """pytest's last summary line in ``text`` (``text`` itself if it holds none)."""
    found = _SUMMARY.findall(text)
    return found[-1][0] if found else text.strip().splitlines()[-1] if text.strip() else "-"


def write_doc(results: list[dict[str, Any]]) -> None:
    text = DOC.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    DOC.write_text(f"{head}{BEGIN}\n{table(results)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("versions", nargs="*", help="torch releases, e.g. 2.9.1 2.15.0")
    p.add_argument("--table-only", action="store_true", help="rewrite the doc from the results")
    p.add_argument("--pytest", default="", help="extra pytest arguments, one string")
    args = p.parse_args(argv)
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"releases": []}
    by_version = {r["version"]: r for r in old["releases"]}
    for version in [] if args.table_only else args.versions:
        print(f"torch {version}: the suite ...", file=sys.stderr, flush=True)
        by_version[version] = run_release(version, args.pytest.split())
        print(f"torch {version}: {by_version[version]['summary']}", file=sys.stderr, flush=True)
        RESULTS.write_text(json.dumps({"releases": sorted(
            by_version.values(), key=lambda r: tuple(map(int, r["version"].split("."))))},
            indent=1) + "\n")
    results = json.loads(RESULTS.read_text())["releases"] if RESULTS.exists() else []
    if results:
        write_doc(results)
    return 0 if all(r["returncode"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
