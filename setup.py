"""Builds scry's optional C extensions from Cython: scry.protocol._scan (the
relay's message scanner), scry._relay (the relay's hot state and its fast
paths), scry.observe._hot (the drain's hot-value counter),
scry.observe._columns (the drain's walk over a chunk of records) and
scry.observe._encode (the event sink's batch encoder). Without a
C compiler the install still succeeds and scry uses their pure-Python twins;
metadata is in pyproject.toml."""

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError:  # (a build without Cython: the pure-Python twins)
    ext_modules = []
else:
    ext_modules = cythonize(
        [
            Extension("scry.protocol._scan", ["scry/protocol/_scan.pyx"], optional=True),
            Extension("scry._relay", ["scry/_relay.pyx"], optional=True),
            Extension("scry.observe._hot", ["scry/observe/_hot.pyx"], optional=True),
            Extension("scry.observe._columns", ["scry/observe/_columns.pyx"], optional=True),
            Extension("scry.observe._encode", ["scry/observe/_encode.pyx"], optional=True),
        ],
        quiet=True,
    )

setup(ext_modules=ext_modules)
