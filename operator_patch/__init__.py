"""operator_patch."""
