"""kvtier: the umbrella CLI, `up`, bench and devstack (the roof), and `kvtier.contract` (the floor).

Imports nothing on purpose: connector, router and operator_patch import `kvtier.contract`, and that must not pull
the roof in (the layers are import-linter contracts in pyproject.toml, docs/DEVELOPING.md "Layers").
"""
