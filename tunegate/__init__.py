"""tunegate: the command line and the one-machine stack (`tunegate up`)."""
