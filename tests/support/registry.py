"""Registry test data: real checkpoints, datasets with a manifest, promotion candidates, bucket listings."""

from __future__ import annotations

import io
import os

from storage_io import MANIFEST, StorageLayout, atomic_write_bytes, atomic_write_json, join
from training.champion import registry, registry_files
from training.checkpoint.files import MODEL_FILE
from training.checkpoint.model_files import build_resnet18


def make_checkpoint(folder: str, seed: int = 0) -> str:
    """A checkpoint folder holding a real ResNet-18's model.pt (seeded weights)."""
    import torch

    torch.manual_seed(seed)
    buffer = io.BytesIO()
    torch.save(build_resnet18().state_dict(), buffer)
    atomic_write_bytes(join(folder, MODEL_FILE), buffer.getvalue())
    return folder


def make_dataset(layout: StorageLayout, name: str) -> str:
    """A dataset folder with a manifest (what data_hash reads)."""
    folder = join(layout.root, "datasets", name)
    atomic_write_json(join(folder, MANIFEST), {"fingerprint": name})
    return folder


def candidate(layout: StorageLayout, run: str, accuracy: float, dataset: str, passed: bool = True, seed: int = 0):
    """A promotion candidate of run ``run`` whose checkpoint holds a real ResNet-18."""
    checkpoint = make_checkpoint(join(layout.runs_dir, run, "checkpoint_000000"), seed)
    return registry.Candidate(
        run_name=run, flow_run_id=f"id-{run}", checkpoint=checkpoint, accuracy=accuracy, passed_gate=passed,
        data_hash=registry_files.data_hash(dataset), dataset_dir=dataset, raw_dir=join(layout.root, "raw", "sample"),
        metrics={"rows": 1000}, config={"train": {"epochs": 1}}, code_version="abc123",
    )


def light_candidate(layout: StorageLayout, run: str, accuracy: float, dataset: str) -> registry.Candidate:
    """A candidate whose model.pt is a few bytes (the registry copies and checksums it, never loads it):
    keeps the S3 tests from moving a ResNet-18's 45 MB around the loopback server again and again."""
    checkpoint = join(layout.runs_dir, run, "checkpoint_000000")
    atomic_write_bytes(join(checkpoint, MODEL_FILE), f"weights of {run}".encode())
    return registry.Candidate(run_name=run, checkpoint=checkpoint, accuracy=accuracy, passed_gate=True,
                              data_hash=registry_files.data_hash(dataset), dataset_dir=dataset, raw_dir=join(layout.root, "raw", "sample"))


def s3_objects(root: str) -> list[str]:
    """Every object under ``root`` in the bucket, listed with boto3 (not through the code under test)."""
    import boto3

    bucket, _, prefix = root.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sorted(item["Key"][len(prefix) + 1 :] for page in pages for item in page.get("Contents", []))
