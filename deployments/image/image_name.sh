#!/bin/sh
# The image name: the project's name in pyproject.toml ([project] name), e.g. mnist-ray-prefect.
set -eu
pyproject="${1:-$(dirname "$0")/../../pyproject.toml}"
sed -n 's/^name = "\(.*\)"$/\1/p' "$pyproject" | head -n 1
