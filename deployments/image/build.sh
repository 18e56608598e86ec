#!/usr/bin/env bash
# `make image`: build <project name>:<lock hash> offline, without any registry base image.
#
#   1. wheels   every pin of requirements.lock (and pip) downloaded on the host with the host's pip
#               configuration (torch and torchvision come from this machine's disk), into
#               $IMAGE_BUILD_DIR/wheels-<lock hash>; pip inside the chroot never reaches an index.
#   2. deps     <name>-deps:<lock hash>: debootstrap bookworm (minbase and the C libraries CPython
#               links), the host's CPython (the interpreter `make install` uses, $PYTHON) at
#               /opt/python, and a venv at /opt/venv installed from those wheels with --no-index,
#               `docker import`ed. Made once per lock. Not bookworm's python3: it is 3.11.2, and
#               the lock, resolved on 3.11.7, does not install there (redis needs async-timeout
#               below 3.11.3, which the lock lacks); the same patch release as the host also keeps
#               a driver on the host within Ray's check (it compares Python down to the patch).
#   3. image    <name>:<lock hash>: the project on top (Dockerfile), labelled with a hash of the
#               code, so a code change rebuilds only this small layer.
#   4. check    the image's `pip list` against the lock: every pin at its version, nothing else.
#
# Nothing is rebuilt when the image's code-hash label matches (same lock, same code). Build
# output (wheels, the root filesystem while it is made) stays in $IMAGE_BUILD_DIR, outside git.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
DOCKER="${DOCKER:-docker}"
PIP_VERSION="${PIP_VERSION:-26.3}"
SUITE=bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# The shared libraries CPython's own extension modules link (ssl, ctypes, sqlite3, bz2, lzma,
# readline, curses, uuid, expat), certificates, and ps (Ray's tools call it).
DEBS="ca-certificates,procps,libssl3,libffi8,libsqlite3-0,libbz2-1.0,liblzma5,libreadline8,libncursesw6,zlib1g,libuuid1,libexpat1"
# The interpreter copied into the image: the host's, a self-contained prefix (pyenv-style, not /usr).
PY_PREFIX="$("$PYTHON" -c 'import sys; print(sys.base_prefix)')"
PY_VERSION="$("$PYTHON" -c 'import platform; print(platform.python_version())')"

# The name and tag rule, one for every consumer: deployments/images.py (standard library only).
IMAGE="$(cd "$HERE/../.." && "$PYTHON" -m deployments.images)"
NAME="${IMAGE%%:*}"
LOCK_HASH="${IMAGE##*:}"
DEPS_IMAGE="$NAME-deps:$LOCK_HASH"
BUILD_DIR="${IMAGE_BUILD_DIR:-/var/tmp/$NAME-image}"
WHEELS="$BUILD_DIR/wheels-$LOCK_HASH"
# The project's packages and the bundled sample (download.source=sample reads it on the worker nodes).
PACKAGES=(flows runner tasks training reporting dataset storage_io pipeline_config deployments data/mnist-sample)

say() { printf '%s image: %s\n' "$(date +%H:%M:%S)" "$*"; }

# The files the image's code layer is made of: the packages as they are in the working tree
# (tracked or new, not ignored), pyproject.toml and the lock. Their hash, with the build files',
# is the image's code-hash label.
code_files() {
    git ls-files -co --exclude-standard -- pyproject.toml requirements.lock "${PACKAGES[@]}" | sort -u |
        while read -r f; do [ -f "$f" ] && printf '%s\n' "$f"; done
}
CODE_HASH="$( { code_files | while read -r f; do sha256sum "$f"; done; sha256sum "$HERE"/build.sh "$HERE"/Dockerfile; } |
    sha256sum | cut -c1-12)"

# Before any work: the tools and the daemon this needs, each named with how to get it.
missing=()
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v "$DOCKER" >/dev/null || missing+=(docker.io)
if [ ${#missing[@]} -gt 0 ]; then
    echo "make image needs ${missing[*]}: apt-get install ${missing[*]} (as root), then start dockerd" >&2
    exit 2
fi
if [ "$(id -u)" != 0 ]; then
    echo "make image runs debootstrap, chroot and bind mounts: run it as root" >&2
    exit 2
fi
if ! $DOCKER info >/dev/null 2>&1; then
    echo "make image: the Docker daemon does not answer ('$DOCKER info' fails); start it (systemctl start docker, or 'dockerd &' where no init system runs)" >&2
    exit 2
fi

if [ "$($DOCKER image inspect --format '{{index .Config.Labels "code-hash"}}' "$IMAGE" 2>/dev/null)" = "$CODE_HASH" ]; then
    say "$IMAGE is up to date (lock $LOCK_HASH, code $CODE_HASH)"
    exit 0
fi
mkdir -p "$BUILD_DIR"

# 1. wheels ---------------------------------------------------------------------------------------
if [ ! -f "$WHEELS/.complete" ]; then
    say "downloading the lock's wheels into $WHEELS"
    rm -rf "$WHEELS"
    # `pip wheel` keeps wheels as they are and builds one for any pin published only as an sdist.
    # Its warnings (each local index folder a package is missing from) go to a log, shown on failure.
    "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps -r requirements.lock "pip==$PIP_VERSION" -w "$WHEELS" \
        2> "$BUILD_DIR/wheels.log" || { tail -30 "$BUILD_DIR/wheels.log"; exit 1; }
    cp requirements.lock "$WHEELS/requirements.lock"
    touch "$WHEELS/.complete"
fi

# 2. deps image -----------------------------------------------------------------------------------
if ! $DOCKER image inspect "$DEPS_IMAGE" >/dev/null 2>&1; then
    ROOTFS="$BUILD_DIR/rootfs-$LOCK_HASH"
    cleanup_mounts() {
        for m in "$ROOTFS/wheels" "$ROOTFS/proc"; do mountpoint -q "$m" && umount "$m"; done
        return 0
    }
    trap 'cleanup_mounts; rm -rf "$ROOTFS"' EXIT
    rm -rf "$ROOTFS"
    say "debootstrap $SUITE ($DEBS) into $ROOTFS"
    mkdir -p "$BUILD_DIR/debs"
    debootstrap --variant=minbase --include="$DEBS" --cache-dir="$BUILD_DIR/debs" "$SUITE" "$ROOTFS" "$MIRROR" \
        > "$BUILD_DIR/debootstrap.log" 2>&1 || { tail -20 "$BUILD_DIR/debootstrap.log"; exit 1; }
    mkdir -p "$ROOTFS/wheels" && mount --bind "$WHEELS" "$ROOTFS/wheels" && mount -t proc proc "$ROOTFS/proc"
    # env -i: none of the host's pip settings (its index, find-links, constraints) reach the chroot.
    in_root() { chroot "$ROOTFS" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 PIP_NO_CACHE_DIR=1 "$@"; }
    case "$PY_PREFIX" in /usr|/usr/local|/) echo "$PYTHON is not a self-contained prefix ($PY_PREFIX): point PYTHON at one (e.g. pyenv's)" >&2; exit 1;; esac
    say "CPython $PY_VERSION from $PY_PREFIX -> /opt/python (standard library only)"
    mkdir -p "$ROOTFS/opt/python"
    tar -C "$PY_PREFIX" --exclude='./lib/python3.*/site-packages/*' --exclude='./lib/python3.*/test' \
        --exclude='./lib/python3.*/idlelib' --exclude='./lib/python3.*/tkinter' --exclude='./lib/python3.*/turtledemo' \
        --exclude='*/_tkinter.*' --exclude='./lib/python3.*/lib-dynload/_test*' --exclude='./bin/idle*' --exclude='./share' \
        -c . | tar -C "$ROOTFS/opt/python" -x
    echo /opt/python/lib > "$ROOTFS/etc/ld.so.conf.d/python.conf"  # libpython's RUNPATH names the host's prefix
    chroot "$ROOTFS" /sbin/ldconfig
    say "venv /opt/venv from the lock, offline"
    in_root /opt/python/bin/python3 -m venv /opt/venv
    in_root /opt/venv/bin/python -m pip install --quiet --no-index --find-links /wheels "pip==$PIP_VERSION"
    in_root /opt/venv/bin/python -m pip install --quiet --no-index --find-links /wheels -r /wheels/requirements.lock
    cleanup_mounts
    rmdir "$ROOTFS/wheels"
    rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/root/.cache
    say "docker import -> $DEPS_IMAGE ($(du -sh "$ROOTFS" | cut -f1) root filesystem)"
    tar --numeric-owner --xattrs -C "$ROOTFS" -c . | $DOCKER import \
        --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV VIRTUAL_ENV=/opt/venv' --change 'ENV LANG=C.UTF-8' --change 'ENV PYTHONUNBUFFERED=1' \
        --change 'CMD ["python3"]' \
        --message "debootstrap $SUITE + /opt/venv from requirements.lock $LOCK_HASH" - "$DEPS_IMAGE" >/dev/null
    rm -rf "$ROOTFS"
    trap - EXIT
fi

# 3. the project's layer --------------------------------------------------------------------------
CONTEXT="$BUILD_DIR/context"
rm -rf "$CONTEXT" && mkdir -p "$CONTEXT/project"
code_files | while read -r f; do mkdir -p "$CONTEXT/project/$(dirname "$f")" && cp -p "$f" "$CONTEXT/project/$f"; done
cp "$HERE/Dockerfile" "$CONTEXT/Dockerfile"
say "building $IMAGE (code $CODE_HASH)"
OLD_ID="$($DOCKER image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
# The classic builder: it uses the local DEPS_IMAGE without asking any registry.
if ! built="$(DOCKER_BUILDKIT=0 $DOCKER build --quiet --build-arg DEPS_IMAGE="$DEPS_IMAGE" --build-arg PROJECT="$NAME" \
        --build-arg LOCK_HASH="$LOCK_HASH" --build-arg CODE_HASH="$CODE_HASH" -t "$IMAGE" "$CONTEXT" 2>&1)"; then
    printf '%s\n' "$built" >&2
    exit 1
fi
rm -rf "$CONTEXT"
# The code layer this one replaces (same tag, older code) would stay behind untagged.
[ -n "$OLD_ID" ] && [ "$OLD_ID" != "$($DOCKER image inspect --format '{{.Id}}' "$IMAGE")" ] && $DOCKER image rm "$OLD_ID" >/dev/null 2>&1 || true

# 4. the versions inside equal the lock -----------------------------------------------------------
PROJECT_VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)"
$DOCKER run --rm --network none "$IMAGE" python -m pip list --format=freeze --disable-pip-version-check |
    "$PYTHON" "$HERE/check_versions.py" requirements.lock "pip==$PIP_VERSION" "$NAME==$PROJECT_VERSION"
say "$IMAGE built: $($DOCKER image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1/1e9}'), python $($DOCKER run --rm --network none "$IMAGE" python -c 'import platform; print(platform.python_version())')"
