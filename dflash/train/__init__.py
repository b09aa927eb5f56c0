"""train stage."""
