"""Builds scry's optional C extensions from Cython: scry.protocol._scan (the
relay's message scanner), scry._relay (the relay's hot state and its fast
paths), scry._accept (the client listeners' accept callback),
scry.observe._hot (the drain's hot-value counter),
scry.observe._columns (the drain's walk over a chunk of records),
scry.observe._encode (the event sink's batch encoder) and
scry.observe._histogram (durations counted into buckets). Without a
C compiler, or with a Cython that cannot translate one of them, the install
still succeeds and scry uses their pure-Python twins; metadata is in
pyproject.toml."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildWhatCompiles(build_ext):
    """Builds each extension it can and warns about the others, which scry
    then runs as their pure-Python twins. (``Extension(optional=True)`` is
    not enough: ``cythonize`` hands back new Extension objects without it,
    and one failed compile failed the whole install.)"""

    failed: frozenset[str] = frozenset()

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # a compile error, no compiler at all, ...
            self.failed = self.failed | {ext.name}
            print(f"warning: {ext.name} was not built ({exc}); scry uses its pure-Python twin")

    # What is copied into the tree (an editable install) or the wheel: only what was built.
    def copy_extensions_to_source(self) -> None:
        self._only_built(super().copy_extensions_to_source)

    def get_outputs(self) -> list[str]:
        return self._only_built(super().get_outputs)

    def get_output_mapping(self) -> dict[str, str]:
        return self._only_built(super().get_output_mapping)

    def _only_built(self, step):  # type: ignore[no-untyped-def]
        every = self.extensions
        self.extensions = [ext for ext in every if ext.name not in self.failed]
        try:
            return step()
        finally:
            self.extensions = every


EXTENSIONS = [
    Extension("scry.protocol._scan", ["scry/protocol/_scan.pyx"]),
    Extension("scry._relay", ["scry/_relay.pyx"]),
    Extension("scry._accept", ["scry/_accept.pyx"]),
    Extension("scry.observe._hot", ["scry/observe/_hot.pyx"]),
    Extension("scry.observe._columns", ["scry/observe/_columns.pyx"]),
    Extension("scry.observe._encode", ["scry/observe/_encode.pyx"]),
    Extension("scry.observe._histogram", ["scry/observe/_histogram.pyx"]),
]


def translated(extensions: list[Extension]) -> list[Extension]:
    """Each extension Cython translates to C; one it cannot (a Cython too new
    or too old for its source) is left to its pure-Python twin, as one that
    does not compile is."""
    try:
        from Cython.Build import cythonize
    except ImportError:  # (a build without Cython: the pure-Python twins)
        return []
    out = []
    for ext in extensions:
        try:
            out += cythonize([ext], quiet=True)
        except Exception as exc:  # Cython's CompileError, ...
            print(f"warning: {ext.name} was not translated ({exc}); scry uses its pure-Python twin")
    return out


setup(ext_modules=translated(EXTENSIONS), cmdclass={"build_ext": BuildWhatCompiles})
