"""Shared by the fuzz suites: a fixed, seeded example budget, and outcome counts per surface.

CI runs each fuzz test with its default budget (`examples(n)`), derandomized, so every run
draws the same cases. For a longer local search raise the budget of every fuzz test at once:

    OUTRIDER_FUZZ_EXAMPLES=2000 .venv/bin/pytest tests/cpu/cluster/test_fuzz_http.py

`OUTRIDER_FUZZ_SEED` (an integer) draws a different fixed sequence of cases instead (with
derandomize off, hypothesis seeds from it); `OUTRIDER_FUZZ_REPORT=<file.json>` makes each
fuzz test add its outcome counts (how many generated cases ended in which class) to that file,
which `python -m outrider.benchmarks.fuzz_report` renders (benchmarks/results/fuzz_outcomes.md).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, seed, settings


def examples(default: int) -> int:
    """The example budget: `default`, or OUTRIDER_FUZZ_EXAMPLES when set."""
    return int(os.environ.get("OUTRIDER_FUZZ_EXAMPLES") or default)


def fuzz(default_examples: int):
    """hypothesis settings + seed for one fuzz test: fixed budget, reproducible, no deadline."""
    chosen_seed = os.environ.get("OUTRIDER_FUZZ_SEED")
    config = settings(
        max_examples=examples(default_examples),
        derandomize=chosen_seed is None,
        deadline=None,
        database=None,  # no example database: CI and local runs draw exactly the same cases
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        print_blob=True,
    )

    def apply(test):
        test = config(test)
        return seed(int(chosen_seed))(test) if chosen_seed is not None else test

    return apply


def _update_report(key: str, value: object) -> None:
    path = os.environ.get("OUTRIDER_FUZZ_REPORT")
    if not path:
        return
    report_path = Path(path)
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    report[key] = value
    report_path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


def record_measurement(name: str, value: float, unit: str) -> None:
    """A figure a test measured (e.g. how fast a 10 MB prompt is refused), for the report."""
    path = os.environ.get("OUTRIDER_FUZZ_REPORT")
    report = json.loads(Path(path).read_text()) if path and Path(path).is_file() else {}
    measured = report.get("measurements", {})
    measured[name] = {"value": round(value, 3), "unit": unit}
    _update_report("measurements", measured)


class Outcomes:
    """Counts of each outcome class for one surface; `save` adds them to OUTRIDER_FUZZ_REPORT."""

    def __init__(self, surface: str):
        self.surface, self.counts, self.seconds = surface, Counter(), 0.0

    def add(self, outcome: str, started: float) -> None:
        """One case ended in `outcome`; `started` is its time.monotonic() at the start."""
        self.counts[outcome] += 1
        self.seconds += time.monotonic() - started

    def save(self) -> None:
        if not self.counts:
            return
        surfaces = {}
        path = os.environ.get("OUTRIDER_FUZZ_REPORT")
        if path and Path(path).is_file():
            surfaces = json.loads(Path(path).read_text()).get("surfaces", {})
        surfaces[self.surface] = {
            "cases": sum(self.counts.values()),
            "outcomes": dict(sorted(self.counts.items())),
            "seed": os.environ.get("OUTRIDER_FUZZ_SEED", "derandomized"),
            "seconds": round(self.seconds, 1),  # the cases' own time, without setup
        }
        _update_report("surfaces", surfaces)
