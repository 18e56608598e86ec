"""HTTP load on a served endpoint: sequential requests for latency, a few concurrent clients for throughput.

Standard library only (``http.client``), one kept-alive connection per client, the request bodies built before the
clock starts, so what is timed is the server's answer and the loopback, not the client's encoding.
"""

from __future__ import annotations

import http.client
import statistics
import threading
import time
from urllib.parse import urlsplit


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, interpolated between the two nearest ranks."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


class Client:
    """One client: a kept-alive connection to ``url``'s host, posting bodies and timing each answer."""

    def __init__(self, url: str, timeout_s: float = 300):
        parts = urlsplit(url)
        self.host, self.port, self.timeout_s = parts.hostname, parts.port, timeout_s
        self.connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)

    def post(self, path: str, body: bytes, content_type: str) -> tuple[float, bytes]:
        """(seconds to the whole answer, the answer's body); RuntimeError for an answer other than 200. A connection the
        server closed (keep-alive timeout) is opened again once, that request timed from its first try."""
        start = time.perf_counter()
        for attempt in (1, 2):
            try:
                self.connection.request("POST", path, body=body, headers={"content-type": content_type})
                response = self.connection.getresponse()
                answer = response.read()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.connection.close()
                if attempt == 2:
                    raise
                self.connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        seconds = time.perf_counter() - start
        if response.status != 200:
            raise RuntimeError(f"POST {path}: {response.status} {answer[:500]!r}")
        return seconds, answer

    def close(self) -> None:
        self.connection.close()


def _summary(latencies: list[float], wall_s: float) -> dict:
    return {"requests": len(latencies), "requests_per_s": round(len(latencies) / wall_s, 2),
            "p50_ms": round(percentile(latencies, 50) * 1000, 1), "p99_ms": round(percentile(latencies, 99) * 1000, 1),
            "mean_ms": round(statistics.fmean(latencies) * 1000, 1)}


def sequential(url: str, bodies: list[bytes], content_type: str, requests: int, path: str = "/predict") -> dict:
    """``requests`` requests one after the other from one client, cycling through ``bodies``: latency."""
    client = Client(url)
    try:
        start = time.perf_counter()
        latencies = [client.post(path, bodies[i % len(bodies)], content_type)[0] for i in range(requests)]
        wall = time.perf_counter() - start
    finally:
        client.close()
    return _summary(latencies, wall)


def concurrent(url: str, bodies: list[bytes], content_type: str, clients: int, per_client: int, path: str = "/predict") -> dict:
    """``clients`` clients, each with its own connection and thread, sending ``per_client`` requests back to back
    (client ``c`` starts at body ``c``): throughput over the wall time from their common start to the last answer."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    failures: list[BaseException] = []
    ready = threading.Barrier(clients + 1)
    connections = [Client(url) for _ in range(clients)]

    def ask(c: int) -> None:
        ready.wait()
        try:
            for i in range(per_client):
                latencies[c].append(connections[c].post(path, bodies[(c + i * clients) % len(bodies)], content_type)[0])
        except BaseException as exc:  # noqa: BLE001 - said once every client is done
            failures.append(exc)

    threads = [threading.Thread(target=ask, args=(c,), daemon=True) for c in range(clients)]
    for thread in threads:
        thread.start()
    try:
        ready.wait()
        start = time.perf_counter()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - start
    finally:
        for connection in connections:
            connection.close()
    if failures:
        raise RuntimeError(f"{len(failures)} of {clients} clients failed: {failures[0]}") from failures[0]
    return {"clients": clients, **_summary([s for mine in latencies for s in mine], wall)}


def medians(rounds: list[dict], batch: int) -> dict:
    """Each figure's median over ``rounds`` (one `sequential` or `concurrent` result each), with images/s at ``batch``
    images per request and each round's requests/s."""
    out = {key: rounds[0][key] for key in ("clients",) if key in rounds[0]}
    out["requests"] = sum(r["requests"] for r in rounds)
    for key in ("requests_per_s", "p50_ms", "p99_ms", "mean_ms"):
        out[key] = round(statistics.median(r[key] for r in rounds), 2 if key == "requests_per_s" else 1)
    out["images_per_s"] = round(out["requests_per_s"] * batch, 1)
    out["rounds_requests_per_s"] = [r["requests_per_s"] for r in rounds]
    return out
