"""Operator fixtures. The helpers live in operator_helpers.py: test modules import them from there, never from
`conftest` (pytest re-imports every area's conftest.py under that one module name)."""

from operator_helpers import cluster  # noqa: F401  (fixture)
