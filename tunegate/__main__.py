"""`python -m tunegate` is the `tunegate` command."""

from tunegate.cli import main

main()
