"""Prefect deployments of the MNIST flow: `python -m deployments.serve` or `prefect deploy` with prefect.yaml."""
