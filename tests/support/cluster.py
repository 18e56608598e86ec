"""A Ray cluster of containers on one Docker network, from the image `make image` builds.

``DockerCluster.up()`` starts, on a network of its own:

* ``s3``: moto's S3 server (``moto_server``, a real HTTP server speaking the S3 API) on port 5000;
* ``prefect``: ``prefect server start`` on port 4200;
* ``head``: ``ray start --head --num-cpus=0`` (it schedules no CPU work: the driver, Ray Train's
  controller and the zero-CPU stage tasks live there);
* ``worker-1``, ``worker-2``: ``ray start --address=head:6379 --num-cpus=1``.

Every container runs the same image, has its own filesystem (no bind mount, no shared volume:
artifacts reach the other nodes only through S3) and a ``--shm-size`` for Ray's object store.
Token authentication is on: every Ray node and the driver get ``RAY_AUTH_MODE=token`` and one
``RAY_AUTH_TOKEN``. Names resolve on the network (``s3``, ``prefect``, ``head``), so the Ray
workers reach the Prefect API as ``http://prefect:4200/api``; this test process reaches the
containers by their addresses on the bridge.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
import uuid
from pathlib import Path

from deployments.images import image_reference

ROOT = Path(__file__).resolve().parents[2]
S3_PORT, PREFECT_PORT, GCS_PORT = 5000, 4200, 6379
S3_ENV = {"AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": "test-secret", "AWS_REGION": "us-east-1"}
SHM = "1g"  # /dev/shm of each Ray node (Docker's default 64 MB would push the object store to disk)
OBJECT_STORE_BYTES = 500_000_000
# Ray's graceful drain on SIGTERM (`ray start --block`): the node is marked draining with reason
# PREEMPTION and this deadline, then its processes are stopped. Docker's stop timeout is longer.
DRAIN_S = 30


def default_image() -> str:
    """``<project name>:<lock hash>``, the tag `make image` builds (deployments/image/)."""
    return image_reference()


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=check)


class DockerCluster:
    def __init__(self, image: str, prefix: str | None = None):
        self.image = image
        self.prefix = prefix or f"mrp-{uuid.uuid4().hex[:6]}"
        self.network = f"{self.prefix}-net"
        self.token = secrets.token_hex(32)
        self.started: list[str] = []

    # --- names and environments ---------------------------------------------------------------

    def container(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def ray_env(self) -> dict[str, str]:
        """Every Ray node's environment (the driver on the head inherits it)."""
        return {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_USAGE_STATS_ENABLED": "0",
            # As a run's own local Ray (runner.cluster.ray_head.LOCAL_RAY_SYSTEM_CONFIG): idle workers stay.
            "RAY_num_workers_soft_limit": "16",
            "RAY_idle_worker_killing_time_threshold_ms": "600000",
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(DRAIN_S),
            # Ray Train's preemption watcher asks the GCS for draining nodes every second (default 5).
            "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1",
            # After a node is gone, Ray Train settles for the workers left after 20 s (default 60).
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20",
            "PREFECT_API_URL": f"http://prefect:{PREFECT_PORT}/api",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "AWS_ENDPOINT_URL": f"http://s3:{S3_PORT}",
            **S3_ENV,
        }

    # --- lifecycle ------------------------------------------------------------------------------

    def run(self, name: str, command: list[str], env: dict[str, str] | None = None, ray_node: bool = False) -> None:
        args = ["run", "-d", "--name", self.container(name), "--hostname", name, "--network", self.network,
                "--network-alias", name, "--init"]
        if ray_node:
            args += ["--shm-size", SHM]
        for key, value in (env or {}).items():
            args += ["-e", f"{key}={value}"]
        docker(*args, self.image, *command)
        self.started.append(self.container(name))

    def up(self, timeout_s: float = 300) -> DockerCluster:
        docker("network", "create", self.network)
        try:
            self.run("s3", ["moto_server", "-H", "0.0.0.0", "-p", str(S3_PORT)])
            self.run("prefect", ["prefect", "server", "start", "--host", "0.0.0.0", "--port", str(PREFECT_PORT)],
                     env={"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": "/tmp/prefect"})
            ray_start = ["ray", "start", "--block", "--disable-usage-stats", f"--object-store-memory={OBJECT_STORE_BYTES}"]
            self.run("head", [*ray_start, "--head", "--num-cpus=0", f"--port={GCS_PORT}", "--dashboard-host=0.0.0.0"],
                     env=self.ray_env(), ray_node=True)
            self.wait(lambda: self.exec("head", ["ray", "status"], check=False).returncode == 0, timeout_s, "the Ray head")
            for worker in ("worker-1", "worker-2"):
                self.start_worker(worker)
            self.wait(lambda: self.cpus() == 2.0, timeout_s, "two 1-CPU Ray workers")
            self.wait(self.prefect_healthy, timeout_s, "the Prefect server")
            self.wait(self.s3_healthy, timeout_s, "the S3 server")
        except BaseException:
            self.down()
            raise
        return self

    def start_worker(self, name: str) -> None:
        """A Ray worker node with one CPU joining the head (not waited for)."""
        command = ["ray", "start", "--block", "--disable-usage-stats", f"--object-store-memory={OBJECT_STORE_BYTES}",
                   f"--address=head:{GCS_PORT}", "--num-cpus=1"]
        self.run(name, command, env=self.ray_env(), ray_node=True)

    def down(self) -> None:
        for name in reversed(self.started):
            docker("rm", "-f", name, check=False, timeout=120)
        self.started.clear()
        docker("network", "rm", self.network, check=False)

    @staticmethod
    def wait(check, timeout_s: float, what: str, interval_s: float = 1.0):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = check()
            except Exception:  # not up yet
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
            time.sleep(interval_s)

    # --- looking at it --------------------------------------------------------------------------

    def exec(self, name: str, command: list[str], env: dict[str, str] | None = None, check: bool = True,
             timeout: float = 120) -> subprocess.CompletedProcess:
        args = ["exec"]
        for key, value in (env or {}).items():
            args += ["-e", f"{key}={value}"]
        return docker(*args, self.container(name), *command, check=check, timeout=timeout)

    def python(self, name: str, code: str, timeout: float = 120) -> str:
        return self.exec(name, ["python", "-c", code], timeout=timeout).stdout

    def nodes(self) -> list[dict]:
        """Ray's view of the nodes (alive and dead), from a driver on the head."""
        code = "import json, ray; ray.init(address='auto', logging_level='ERROR'); print(json.dumps(ray.nodes()))"
        return json.loads(self.python("head", code).strip().splitlines()[-1])

    def cpus(self) -> float:
        return sum(n["Resources"].get("CPU", 0.0) for n in self.nodes() if n["Alive"])

    def node_ids(self) -> dict[str, str]:
        """{container name (hostname): Ray node id} of the alive nodes."""
        return {n["NodeManagerHostname"]: n["NodeID"] for n in self.nodes() if n["Alive"]}

    def ip(self, name: str) -> str:
        out = docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", self.container(name))
        return out.stdout.strip()

    @property
    def s3_endpoint(self) -> str:
        return f"http://{self.ip('s3')}:{S3_PORT}"

    @property
    def prefect_api(self) -> str:
        return f"http://{self.ip('prefect')}:{PREFECT_PORT}/api"

    def s3_healthy(self) -> bool:
        self.s3_client().list_buckets()
        return True

    def prefect_healthy(self) -> bool:
        import httpx

        return httpx.get(f"{self.prefect_api}/health", timeout=5).status_code == 200

    def s3_client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.s3_endpoint, region_name=S3_ENV["AWS_REGION"],
                            aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"], aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"])

    def running(self, name: str) -> bool:
        out = docker("inspect", "-f", "{{.State.Running}}", self.container(name), check=False)
        return out.stdout.strip() == "true"

    def logs(self, name: str, tail: int = 200) -> str:
        out = docker("logs", "--tail", str(tail), self.container(name), check=False)
        return out.stdout + out.stderr

    def dump_logs(self, folder: Path) -> None:
        """Every container's log (and the head's Ray logs) into ``folder``, for a failed test."""
        folder.mkdir(parents=True, exist_ok=True)
        for full in self.started:
            name = full.removeprefix(f"{self.prefix}-")
            (folder / f"{name}.log").write_text(self.logs(name, tail=2000))
        tar = subprocess.run(["docker", "exec", self.container("head"), "tar", "-C", "/tmp/ray/session_latest", "-c", "logs"],
                             capture_output=True, timeout=120)
        (folder / "head-ray-logs.tar").write_bytes(tar.stdout)
