"""How peers coordinate: membership, matchmaking, rounds, butterfly all-reduce, wire messages."""
