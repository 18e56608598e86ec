"""Plain helpers shared by the test modules (no fixtures: those are in ``tests/conftest.py``).

``digits``: synthetic MNIST-shaped IDX files and a file:// mirror of a few real digits;
``parquet``: reading a converted split back; ``runs``: a seed-style ResNet-18 and a run folder
with checkpoints, raw files and a dataset (built for the ``run_tree`` fixture); ``s3``: the
loopback S3 server's credentials and buckets; ``prefect_server``: a real Prefect server, the
``deployments.serve`` process and the polling and stopping helpers around them; ``ray_cluster``:
the session's Ray head and how a run joins it. Test modules import from here, never from
``conftest`` or another test module.
"""
