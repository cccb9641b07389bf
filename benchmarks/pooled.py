#!/usr/bin/env python3
"""Pool the rounds of several bench.py runs: one verdict from many runs.

A single run of 6 rounds moves by about ±5% on a 2-core host, so a ratio
near a bound passes in one run and fails in the next. Each run's rounds are
still paired (every target's run of a round is seconds from the others'),
so the same-round ratios of many runs of the same code can be pooled; the
median of the pool has a much narrower interval than any one run's.

Usage (from the repository root)::

    .venv/bin/python benchmarks/pooled.py run1.json run2.json ...
    .venv/bin/python benchmarks/pooled.py --target scry --bound C50=0.9 \\
        --bound S10=0.85 --bound S50=0.85 runs/*.json

For each scenario and target, it prints the median of the pooled ratios to
PgBouncer, the distribution-free interval for that median (order statistics,
as bench.py's same-round column), how many rounds it pools from how many
runs, and how often a single round and a single run's median fell below each
``--bound``. The exit status is 1 if some interval's low end is below its
bound, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import RunResult, median_interval, paired_ratios  # noqa: E402


def load_runs(path: Path) -> list[RunResult]:
    data = json.loads(path.read_text())
    return [RunResult(**run) for run in data["runs"]]


def baseline_of(runs: list[RunResult]) -> str | None:
    return next((r.target for r in runs if r.kind == "pgbouncer"), None)


def pool(paths: list[Path]) -> dict[tuple[str, str], list[list[float]]]:
    """(scenario, target) -> each run's same-round ratios to PgBouncer."""
    pooled: dict[tuple[str, str], list[list[float]]] = defaultdict(list)
    for path in paths:
        runs = load_runs(path)
        baseline = baseline_of(runs)
        if baseline is None:
            print(f"{path}: no PgBouncer target; left out", file=sys.stderr)
            continue
        pairs = sorted({(r.scenario, r.target) for r in runs if r.target != baseline})
        for scenario, target in pairs:
            ratios = paired_ratios(runs, scenario, target, baseline)
            if ratios:
                pooled[(scenario, target)].append(ratios)
    return pooled


def parse_bound(spec: str) -> tuple[str, float]:
    scenario, sep, value = spec.partition("=")
    try:
        if not sep or not scenario:
            raise ValueError
        return scenario.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SCENARIO=RATIO, got {spec!r}") from None


def report(
    pooled: dict[tuple[str, str], list[list[float]]], bounds: dict[str, float], target: str | None
) -> bool:
    """Print the table; True if every bounded interval lies at or above its bound."""
    held = True
    print("scenario  target          median  interval (coverage)     rounds  runs  "
          "rounds below  run medians below")  # fmt: skip
    for (scenario, label), per_run in sorted(pooled.items()):
        if target is not None and label != target:
            continue
        ratios = [ratio for run in per_run for ratio in run]
        interval = median_interval(ratios)
        if interval is None:
            shown = "-"
        else:
            low, high, coverage = interval
            shown = f"{low:.3f}–{high:.3f} ({coverage:.0%})"
        bound = bounds.get(scenario)
        below, runs_below = "", ""
        if bound is not None:
            below = f"{sum(r < bound for r in ratios) / len(ratios):.0%} < {bound:g}"
            run_medians = [statistics.median(run) for run in per_run]
            runs_below = f"{sum(m < bound for m in run_medians)} of {len(run_medians)}"
            if interval is None or interval[0] < bound:
                held = False
        print(
            f"{scenario:<9} {label:<14} {statistics.median(ratios):>7.3f}  {shown:<23} "
            f"{len(ratios):>6}  {len(per_run):>4}  {below:<13} {runs_below}"
        )
    return held


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="bench.py --json files")
    p.add_argument("--target", help="only this target (default: every one but PgBouncer)")
    p.add_argument(
        "--bound",
        type=parse_bound,
        action="append",
        default=[],
        metavar="SCENARIO=RATIO",
        help="a lower bound for the ratio to PgBouncer (repeatable), e.g. S10=0.85",
    )
    args = p.parse_args(argv)
    pooled = pool(args.results)
    if not pooled:
        raise SystemExit("no rounds with both PgBouncer and another target in these files")
    held = report(pooled, dict(args.bound), args.target)
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
