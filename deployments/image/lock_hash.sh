#!/bin/sh
# The image tag: the first 12 hex characters of the sha256 of requirements.lock's bytes.
# One rule for every consumer (`make image`, the cluster test, Kubernetes manifests):
#   deployments/image/lock_hash.sh [path/to/requirements.lock]
set -eu
lock="${1:-$(dirname "$0")/../../requirements.lock}"
sha256sum "$lock" | cut -c1-12
