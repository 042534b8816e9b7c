"""tunegate: tunegate."""
