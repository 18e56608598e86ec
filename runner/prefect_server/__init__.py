"""The Prefect API a run reports to: the server this machine starts for it when none is named (`process`), and the URL in use (`api`)."""
