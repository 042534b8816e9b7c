"""tunegate: envsdk."""
