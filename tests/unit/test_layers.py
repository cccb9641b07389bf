"""The import-layer contract of STYLE.md holds (import-linter, configured in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_layers_are_kept() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter is a test dependency; install .[test]"
    result = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_protocol_layer_does_not_import_asyncio() -> None:
    # Belt and braces for the most important rule: the codec stays sans-I/O.
    for path in (ROOT / "scry" / "protocol").glob("*.py"):
        text = path.read_text()
        assert "import asyncio" not in text and "from asyncio" not in text, path


def test_the_compiled_relay_is_used_when_it_was_built() -> None:
    # An import cycle through scry._relay makes relay_core fall back to the
    # pure-Python twins without a word (and the compiled-path tests skip).
    built = list((ROOT / "scry").glob("_relay.*.so"))
    result = subprocess.run(
        [sys.executable, "-c", "import scry.relay_core as r; print(r.COMPILED)"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("True" if built else "False"), (built, result.stdout)
