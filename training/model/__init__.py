"""The network: models by name, the trial before any work, the weights a run starts from."""
