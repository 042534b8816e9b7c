"""tunegate: inference."""
