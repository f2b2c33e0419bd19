"""kvtier."""
