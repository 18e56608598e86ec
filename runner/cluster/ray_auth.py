"""Joining a Ray cluster that asks for an authentication token: refused before any work when this process
would be turned away.

A head started with ``RAY_AUTH_MODE=token`` (``deployments.serve``'s, or an operator's) refuses every
driver that does not present its token. ``ray.init`` then retried for 20 seconds, printing a line of
``InvalidAuthToken`` a second, and failed with a ConnectionError naming the node's own address rather
than the one given, and the CLI ended with exit 1 and a hint to resume a run that never started.
`token_problem` asks the head once, with the token this process would present (none unless
``RAY_AUTH_MODE=token``): one call to its GCS, refused or answered within a second on a reachable head.
Anything but a refused token (a head that does not answer, a ``ray://`` client address) is left to
``ray.init``, whose own error says what happened.
"""

from __future__ import annotations

import os

PROBE_TIMEOUT_S = 5.0


def token_problem(address: str | None, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the Ray head at ``address`` (``host:port``, ``ray.address``) refuses this process's token, naming the
    address and how to pass the token; None when it does not (or cannot be asked: unset, ``auto``, ``ray://``)."""
    if not address or "://" in address or ":" not in address or address in ("auto", "local"):
        return None
    import grpc  # Ray's gRPC: only to ask a head
    import ray  # noqa: F401 (the whole package first: its exit handler needs what `import ray` loads)

    # Ray's internals: only where used
    from ray._private.authentication.authentication_utils import is_token_auth_enabled
    from ray._private.grpc_utils import init_grpc_channel  # Ray's internals: only where used
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc  # Ray's internals: only where used

    channel = init_grpc_channel(address)  # with this process's token, when token authentication is on
    try:
        gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
            return None  # not answering, or another error: ray.init says what it is
    else:
        return None
    finally:
        channel.close()
    if not is_token_auth_enabled():
        return (f"ray.address {address}: that Ray cluster asks for an authentication token and this process presents none: "
                "set RAY_AUTH_MODE=token, with the cluster's token in ~/.ray/auth_token, in RAY_AUTH_TOKEN or in a file "
                "RAY_AUTH_TOKEN_PATH names "
                "(`ray get-auth-token` on the head prints it)")
    where = next((name for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH") if os.environ.get(name)), "~/.ray/auth_token")
    return (f"ray.address {address}: that Ray cluster refused the authentication token this process presents (from {where}): "
            "put the cluster's token there (`ray get-auth-token` on the head prints it)")
