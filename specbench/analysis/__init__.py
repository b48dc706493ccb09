"""Analysis of result files: pairing, orderings, the cost model, the report and the Spec-Bench export."""
