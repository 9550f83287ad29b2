"""Pure tensor math for combining peers' vectors: robust aggregators, staleness corrections, attacks.

No I/O, no networking, no hivemind: everything here takes and returns torch tensors
(CPU or CUDA) so it can be tested with plain tensors and shared by the live swarm and
the simulator. Nothing is imported here, so torch-free modules (``names``) stay cheap to import.

Map: base (input checks, AggregateResult) · registry (AGGREGATORS, make_aggregator) ·
coordinatewise (mean, median, trimmed mean) + sortnet (their comparator networks) ·
centered_clip · krum · geometric_median · bucketing · gossip (ClippedGossip) ·
span (Gram-matrix distances shared by the iterative rules) · staleness (SA, Gap-Aware,
DC-ASGD) · dana (DANA-Zero/Slim/GA) · attacks (ATTACKS).
"""
