"""Running benchmarks: bench cards, prompt streams, the runner, presets, result files, several processes."""
