"""The record of measured selection (``memfit.tune``) that a plan carries: every candidate
timed, which one won, and the time spent (``Plan.tuning``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["TunedCandidate", "Tuning"]


@dataclass(frozen=True)
class TunedCandidate:
    """One plan that measured selection (``memfit.tune``) considered, and what it measured.

    Attributes:
        name: how the candidate was found: a solver name (``"auto"``, ``"sqrt"``), with
            ``@97%`` for a re-solve at 97% of the budget, and ``=``-joined names of the
            sources that gave the same plan.
        solver: the solver that made the plan.
        predicted_peak_bytes: the plan's predicted peak.
        predicted_s: the plan's predicted step seconds (the profiled plain step plus its
            ``recompute_s``).
        measured_s: median wall seconds of its timed steps; None: not timed (``note`` says why).
        rounds: how many of its steps were timed.
        note: why it was not timed, or failed.
        solved_budget_bytes: the budget the plan was solved for when it is not the user's (a
            re-solve at 97% of it); None: the user's budget. The chosen plan's
            ``budget_bytes`` is the user's either way.
    """

    name: str
    solver: str
    predicted_peak_bytes: int
    predicted_s: float
    measured_s: float | None = None
    rounds: int = 0
    note: str = ""
    solved_budget_bytes: int | None = None


@dataclass(frozen=True)
class Tuning:
    """What measured selection timed: every candidate, which one won, and the time spent.

    Attributes:
        candidates: in the order they were found (the solver's plan first).
        chosen: the ``name`` of the candidate whose plan this is (the fastest measured).
        time_limit_s: the stepping time allowed.
        spent_s: the stepping time used (warm-up and timed steps).
        notes: what was left out and why (baselines over the budget, a cut for time).
    """

    candidates: tuple[TunedCandidate, ...]
    chosen: str
    time_limit_s: float
    spent_s: float
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"candidates": [dict(vars(c)) for c in self.candidates], "chosen": self.chosen,
                "time_limit_s": self.time_limit_s, "spent_s": self.spent_s, "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Tuning:
        cands = tuple(
            TunedCandidate(str(c["name"]), str(c["solver"]), int(c["predicted_peak_bytes"]),
                           float(c["predicted_s"]), None if c.get("measured_s") is None else float(c["measured_s"]),
                           int(c.get("rounds", 0)), str(c.get("note", "")),
                           None if c.get("solved_budget_bytes") is None else int(c["solved_budget_bytes"]))
            for c in data["candidates"])
        return cls(cands, str(data["chosen"]), float(data["time_limit_s"]), float(data["spent_s"]),
                   tuple(str(n) for n in data.get("notes", ())))

    def lines(self) -> list[str]:
        """The record as lines of ``print(plan)``: one row per candidate, ``*`` on the chosen."""
        from memfit.units import format_bytes, format_seconds

        timed = [c for c in self.candidates if c.measured_s is not None]
        out = [f"  tuned: {len(timed)} of {len(self.candidates)} candidates timed on the model in "
               f"{format_seconds(self.spent_s)} (limit {format_seconds(self.time_limit_s)}); "
               f"chose {self.chosen}"]
        w = max([len(c.name) for c in self.candidates] + [9])
        out.append(f"    {'candidate'.ljust(w)}  {'peak':>10}  {'predicted':>10}  {'measured':>10}  rounds")
        for c in self.candidates:
            mark = "*" if c.name == self.chosen else " "
            measured = format_seconds(c.measured_s) if c.measured_s is not None else "-"
            out.append(f"  {mark} {c.name.ljust(w)}  {format_bytes(c.predicted_peak_bytes):>10}  "
                       f"{format_seconds(c.predicted_s):>10}  {measured:>10}  {c.rounds:>6}"
                       + (f"  {c.note}" if c.note else "")
                       + (f"  (solved for {format_bytes(c.solved_budget_bytes)})"
                          if c.solved_budget_bytes is not None else ""))
        out.extend(f"    {n}" for n in self.notes)
        return out
