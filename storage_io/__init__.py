"""Reading and writing the storage root, a local folder or an ``s3://`` bucket prefix, the same way.

By concern, each importing only the ones above it in this list:

    redact      URLs as shown or stored: without the user, password or token they carry
    errors      a full, read-only or over-quota root as one clear `StorageWriteError`
    walk        a local folder's files, each once: no link followed into itself, links out named
    filesystem  local and S3 primitives (join, exists, read_bytes, list_files, remove, sha256)
    writes      atomic writes, folders built in staging and published whole, local copies
    layout      where a run's files live under the root (`StorageLayout`)
    paths       paths the root stores about itself, relative to it (a root can be copied or moved)
    locks       build locks and run leases

The names below are the package's API: ``from storage_io import StorageLayout, join``.
"""

from storage_io.errors import (
    STORAGE_ERRNOS,
    StorageWriteError,
    s3_write_error,
    storage_errno,
    storage_write_error,
    storage_writes,
)
from storage_io.filesystem import (
    S3_ENV_VARS,
    S3_SCHEME,
    S3Settings,
    basename,
    exists,
    filesystem,
    is_dir,
    is_file,
    is_remote,
    join,
    list_dirs,
    list_files,
    list_tree,
    parent,
    read_bytes,
    read_json,
    read_lines,
    remove,
    s3_filesystem,
    sha256_file,
    sha256_json,
    total_bytes,
)
from storage_io.layout import (
    StorageLayout,
)
from storage_io.paths import (
    ROOT_FOLDERS,
    StoredPathError,
    from_stored,
    has_control_characters,
    mapped_places,
    relative_to_root,
    stored_places,
    to_stored,
)
from storage_io.locks import (
    RunInUseError,
    file_lock,
    lease_path,
    lease_uses,
    live_leases,
    paths_in_use,
    run_lease,
)
from storage_io.redact import (
    has_credentials,
    redact_error,
    redact_text,
    redact_url,
    redact_value,
)
from storage_io.writes import (
    MANIFEST,
    append_line,
    atomic_write_bytes,
    atomic_write_json,
    building,
    local_copy,
    publish_dir,
    staging_dir,
    upload_dir,
)

__all__ = [
    "STORAGE_ERRNOS",
    "s3_write_error",
    "StorageWriteError",
    "storage_errno",
    "storage_write_error",
    "storage_writes",
    "S3_SCHEME",
    "S3_ENV_VARS",
    "S3Settings",
    "is_remote",
    "s3_filesystem",
    "filesystem",
    "join",
    "basename",
    "parent",
    "exists",
    "is_file",
    "is_dir",
    "read_bytes",
    "read_lines",
    "read_json",
    "list_files",
    "list_tree",
    "list_dirs",
    "total_bytes",
    "remove",
    "sha256_file",
    "sha256_json",
    "MANIFEST",
    "atomic_write_bytes",
    "atomic_write_json",
    "append_line",
    "local_copy",
    "upload_dir",
    "building",
    "staging_dir",
    "publish_dir",
    "StorageLayout",
    "ROOT_FOLDERS",
    "StoredPathError",
    "from_stored",
    "has_control_characters",
    "mapped_places",
    "relative_to_root",
    "stored_places",
    "to_stored",
    "file_lock",
    "RunInUseError",
    "lease_path",
    "live_leases",
    "paths_in_use",
    "run_lease",
    "lease_uses",
    "has_credentials",
    "redact_error",
    "redact_text",
    "redact_url",
    "redact_value",
]
