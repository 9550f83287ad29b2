"""Pure tensor math for combining peers' vectors: robust aggregators, staleness corrections, attacks.

No I/O, no networking, no hivemind: everything here takes and returns torch tensors
(CPU or CUDA) so it can be tested with plain tensors and shared by the live swarm and
the simulator.
"""
