"""The served champion's row: ``python -m deployments.serve_model`` under load against ``python -m flows.predict``."""
