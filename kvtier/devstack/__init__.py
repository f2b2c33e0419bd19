"""Dev and test tooling that `kvtier up`, `kvtier model tiny`, the benchmarks and the tests share.

Kept out of the product packages (l2fs, connector, router, operator_patch), which a deployment runs:
- `replica`: launch one vLLM CPU replica (OpenAI server + LMCache + our connector) and wait for /health.
- `tiny_model`: build a seeded random-init tiny Llama with a local tokenizer (no download).
- `testreplica`: a fake vLLM engine for routing tests and benchmarks (`python -m kvtier.devstack.testreplica`).
"""
