# Tasks for https://github.com/casey/just (not in Debian 12's apt: `pip install rust-just`
# into any venv). Each recipe is one plain command: without `just`,
# run it by hand from the repository root. Needs .venv (`./dev` creates it).

set positional-arguments

# List the recipes
default:
    @just --list

# Run the test suite (what CI runs); extra arguments go to pytest
test *ARGS:
    .venv/bin/python -m pytest -q "$@"

# pgbench: direct PostgreSQL vs PgBouncer vs scry (see benchmarks/README.md), e.g. `just bench -T 5 --rounds 1`
bench *ARGS:
    .venv/bin/python benchmarks/bench.py "$@"

# ruff check, ruff format --check and the import-layer contracts
lint:
    .venv/bin/ruff check .
    .venv/bin/ruff format --check .
    .venv/bin/lint-imports

# Apply ruff's safe fixes and formatting
fmt:
    .venv/bin/ruff check --fix .
    .venv/bin/ruff format .

# Regenerate screenshots/*.svg from a demo setup
screenshots:
    .venv/bin/python screenshots/generate.py
