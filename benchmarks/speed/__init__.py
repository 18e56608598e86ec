"""Training speed and accuracy against plain baselines: throughput, DDP, the GPU rows, the step's parts, the recipe, Tune's trials."""
