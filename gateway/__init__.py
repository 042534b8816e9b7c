"""tunegate: gateway."""
