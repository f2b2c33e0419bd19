"""connector."""
