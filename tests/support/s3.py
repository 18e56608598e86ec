"""The S3-compatible test server's credentials and buckets (the server itself is the ``s3_server`` fixture)."""

from __future__ import annotations

import uuid

S3_TEST_ENV = {"AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": "test-secret", "AWS_REGION": "us-east-1"}


def s3_bucket(endpoint: str, name: str) -> str:
    """Create bucket ``name`` on the test server; return its ``s3://`` root."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="test-key", aws_secret_access_key="test-secret")
    client.create_bucket(Bucket=name)
    return f"s3://{name}"


def unique_bucket_name(request) -> str:
    """A valid S3 bucket name from the test's name, unique within the session."""
    stem = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    return f"t-{stem}-{uuid.uuid4().hex[:8]}"
