"""`phalanx bench …`: benchmarks that measure a reference in the same run and print ratios."""
