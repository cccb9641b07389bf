"""benchmarks/pooled.py: several bench.py runs pooled into one verdict."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import pooled  # type: ignore[import-not-found]  # noqa: E402


def run(tps: dict[str, list[float]], scenario: str = "S10") -> dict[str, Any]:
    """A bench.py --json document: each target's tps, round by round."""
    kinds = {"pgbouncer": "pgbouncer", "scry": "scry", "floor": "floor"}
    runs = [
        {"round": i + 1, "scenario": scenario, "target": target, "kind": kinds[target],
         "ok": True, "tps": value}
        for target, values in tps.items()
        for i, value in enumerate(values)
    ]  # fmt: skip
    return {"meta": {}, "runs": runs, "summary": {}}


def write(tmp_path: Path, name: str, doc: dict[str, Any]) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_rounds_are_paired_within_each_run_not_across(tmp_path: Path) -> None:
    # Round 1 of the second run must be divided by that run's PgBouncer, not the first's.
    a = write(tmp_path, "a.json", run({"pgbouncer": [100, 100], "scry": [90, 80]}))
    b = write(tmp_path, "b.json", run({"pgbouncer": [50, 200], "scry": [45, 170]}))
    got = pooled.pool([a, b])
    assert got == {("S10", "scry"): [[0.9, 0.8], [0.9, 0.85]]}


def test_a_run_without_pgbouncer_is_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    alone = write(tmp_path, "alone.json", run({"scry": [90], "floor": [95]}))
    assert pooled.pool([alone]) == {}
    assert "no PgBouncer target" in capsys.readouterr().err


@pytest.mark.parametrize(("ratio", "status"), [(0.9, 0), (0.8, 1)])
def test_the_exit_status_says_whether_every_interval_clears_its_bound(
    tmp_path: Path, ratio: float, status: int, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = [
        write(tmp_path, f"{i}.json", run({"pgbouncer": [100.0] * 6, "scry": [100 * ratio] * 6}))
        for i in range(2)
    ]
    assert pooled.main(["--bound", "S10=0.85", *map(str, paths)]) == status
    line = next(li for li in capsys.readouterr().out.splitlines() if li.startswith("S10"))
    assert line.split()[:4] == ["S10", "scry", f"{ratio:.3f}", f"{ratio:.3f}–{ratio:.3f}"]
    assert line.rstrip().endswith("0 of 2" if status == 0 else "2 of 2")


def test_a_malformed_bound_is_refused() -> None:
    with pytest.raises(SystemExit):
        pooled.main(["--bound", "S10", "x.json"])
