"""The Ray side of a run: the local head, joining a cluster, its token, the run slot, the runtime."""
