"""setup.py: an extension Cython cannot translate is left to its pure-Python
twin instead of failing the whole install."""

from __future__ import annotations

from pathlib import Path

import pytest
import setuptools
from setuptools import Extension

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def setup_namespace(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """setup.py's names, run with setuptools.setup a no-op (its own
    extensions are translated as an install would; their C is up to date)."""
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)
    namespace: dict[str, object] = {"__name__": "scry_setup", "__file__": str(REPO / "setup.py")}
    monkeypatch.chdir(REPO)
    source = (REPO / "setup.py").read_text()
    exec(compile(source, str(REPO / "setup.py"), "exec"), namespace)  # noqa: S102
    return namespace


def test_an_extension_cython_rejects_is_left_out(
    setup_namespace: dict[str, object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.pyx"
    broken.write_text("cdef int broken = \n")
    fine = tmp_path / "fine.pyx"
    fine.write_text("def answer():\n    return 42\n")
    translated = setup_namespace["translated"]
    built = translated(  # type: ignore[operator]
        [Extension("broken", [str(broken)]), Extension("fine", [str(fine)])]
    )
    assert [ext.name for ext in built] == ["fine"]
    assert (tmp_path / "fine.c").exists()
    assert "broken was not translated" in capsys.readouterr().out


def test_every_extension_of_the_tree_translates(setup_namespace: dict[str, object]) -> None:
    extensions = setup_namespace["EXTENSIONS"]
    assert len(setup_namespace["translated"](extensions)) == len(extensions)  # type: ignore[arg-type,operator]
