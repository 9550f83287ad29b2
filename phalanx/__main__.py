"""`python -m phalanx …` is the `phalanx` command."""

from phalanx.peer.cli import main

main()
