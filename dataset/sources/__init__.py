"""Where a run's data comes from: the `Source` interface and one module per kind of source."""
