"""Running benchmarks: the runner and its configurations, paper presets' plans, the results writer, merging the
parts of several processes, parity and recheck."""
