"""Builds the one optional C extension, scry.protocol._scan (the relay's
message scanner, from Cython). Without a C compiler the install still
succeeds and scry uses the pure-Python scanner; metadata is in pyproject.toml."""

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError:  # (a build without Cython: the pure-Python scanner)
    ext_modules = []
else:
    ext_modules = cythonize(
        [Extension("scry.protocol._scan", ["scry/protocol/_scan.pyx"], optional=True)],
        quiet=True,
    )

setup(ext_modules=ext_modules)
