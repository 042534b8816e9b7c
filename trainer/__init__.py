"""tunegate: trainer."""
