"""The registered aggregators' names without importing torch: `phalanx join --help` lists them before any
tensor code loads. tests/aggregation/test_agg_registry.py keeps this tuple equal to AGGREGATORS."""

AGGREGATOR_NAMES = (
    "mean",
    "centered_clip",
    "median",
    "trimmed_mean",
    "krum",
    "multi_krum",
    "geometric_median",
    "bucketing",
)
