"""`phalanx swarm`: a bootstrap peer and N trainers on this machine (swarm), the trainers forked from one
process that imported torch once (zygote), what the launcher knows of them (views) and says (report)."""
