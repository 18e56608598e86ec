"""A training attempt's checkpoints: their files, the model files in them, resumption, the run's records."""
