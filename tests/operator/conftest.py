"""Operator fixtures. The helpers live in operator_helpers.py: test modules import them from there, never from
`conftest` (pytest re-imports every area's conftest.py under that one module name)."""

from operator_helpers import cluster  # noqa: F401  (fixture)


def pytest_configure(config):  # noqa: ANN001, ANN201 - pytest's hook
    config.addinivalue_line("markers", "image: builds the container images with buildah (KVTIER_IMAGE_TESTS=1; ~15 min)")
