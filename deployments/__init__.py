"""Prefect deployments of the flows (MNIST's, the search, the generic flow): `python -m deployments.serve` or `prefect deploy` with prefect.yaml."""
