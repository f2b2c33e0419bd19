"""kvtier router: cache-aware OpenAI-compatible proxy (see docs/router.md)."""
