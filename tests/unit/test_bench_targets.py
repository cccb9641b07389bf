"""bench.py names the Python each scry target runs on."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench  # type: ignore[import-not-found]  # noqa: E402


def test_a_console_script_names_its_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "scry"
    script.write_text(f"#!{sys.executable}\nprint('hi')\n")
    version = sys.version.split()[0]
    assert (
        bench.interpreter_of(str(script))
        == f"Python {version} ({os.path.realpath(sys.executable)})"
    )


def test_env_shebangs_are_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "scry"
    script.write_text(f"#!/usr/bin/env {Path(sys.executable).name}\n")
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert bench.interpreter_of(str(script)).startswith(f"Python {sys.version.split()[0]} (")


def test_no_shebang_or_no_file_says_so(tmp_path: Path) -> None:
    binary = tmp_path / "scry"
    binary.write_bytes(b"\x7fELF")
    assert bench.interpreter_of(str(binary)) == "?"
    assert bench.interpreter_of(str(tmp_path / "missing")) == "?"
