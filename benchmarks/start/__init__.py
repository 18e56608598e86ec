"""How long a run takes to start and what it holds in memory: first step, fixed overheads, a nightly run on unchanged data."""
