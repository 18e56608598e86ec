"""Reading an image folder's images: each one's mode and size, decoded in full or by its header, with Ray tasks (`scan_images`), through the listing cache when a run has one (`image_shape`)."""

from __future__ import annotations

from dataset.formats import images
from dataset.formats.folder import GRAY_MODES, FolderError, FolderLayout, listing_cache
from dataset.formats.listing import ListingCache
from storage_io import filesystem, is_remote, join, read_bytes


def image_shape(
    layout: FolderLayout, image_size: int | None, storage_root: str | None, max_pixels: int | None = None,
) -> tuple[int, int, int]:
    """`scan_images` through the listing cache on ``storage_root``: the headers `dataset.sources.interface.check_data` recorded are
    not read again while their files are unchanged (None: every header read). The cache is only read here:
    a check that refuses the run before any work writes nothing on the storage root."""
    return scan_images(layout, image_size, max_pixels, cache=listing_cache(layout, storage_root) if storage_root else None)


def _read_image(path: str, max_pixels: int | None, decode: bool) -> tuple[str, tuple[int, int]]:
    """(PIL mode, (width, height)) of the image at ``path``: from its header, or (``decode``) after decoding all of it."""
    if decode:
        return images.check_image(read_bytes(path), path, max_pixels)
    if is_remote(path):
        fs, where = filesystem(path)
        handle = fs.open_input_file(where)
    else:  # Python's own file: PIL reads a header in many small reads, each a call into pyarrow otherwise
        handle = open(path, "rb")  # noqa: SIM115 (closed below)
    try:
        with images.open_image(handle, path, max_pixels) as image:
            return image.mode, image.size  # header only: the pixels are not decoded
    finally:
        handle.close()


def scan_images(
    layout: FolderLayout, image_size: int | None, max_pixels: int | None = None, decode: bool = False,
    cache: ListingCache | None = None,
) -> tuple[int, int, int]:
    """(channels, height, width) the converted images will have; FolderError naming a file that cannot be read,
    one of more than ``max_pixels`` pixels (None: no limit), one whose size differs from the first one's when
    ``image_size`` is unset, and (``decode``) one that cannot be decoded in full. ``cache``: a file it says
    was decoded already is not decoded again, an unchanged file's header is taken from it instead of the
    file, and each header read and each file decoded is recorded there (the caller saves it)."""
    channels, first = 1, None
    for split in ("train", "val", "test"):
        for rel, _ in layout.files.get(split, []):
            path = join(layout.path, rel)
            full = decode and not (cache is not None and cache.checked(rel, max_pixels))
            known = cache.header(rel) if cache is not None and not full else None
            if known is not None and max_pixels is not None and known[1][0] * known[1][1] > max_pixels:
                known = None  # read it again: the file's own read names the limit it is over
            try:
                mode, size = known or _read_image(path, max_pixels, full)
            except images.ImageError as exc:
                raise FolderError(str(exc)) from None
            except OSError as exc:  # gone since the listing, unreadable
                raise FolderError(f"{path}: cannot read it ({type(exc).__name__}: {exc})") from None
            if cache is not None:
                cache.mark_header(rel, mode, size)
                if full:
                    cache.mark_checked(rel, max_pixels)
            if mode not in GRAY_MODES:
                channels = 3
            if first is None:
                first = (rel, size)
            elif image_size is None and size != first[1]:
                raise FolderError(
                    f"{path}: {size[0]}x{size[1]} pixels, but {join(layout.path, first[0])} is {first[1][0]}x{first[1][1]}; "
                    "set transform.image_size to resize every image to one square size"
                )
    if first is None:
        raise FolderError(f"download.path {layout.path}: no images")
    width, height = (image_size, image_size) if image_size is not None else first[1]
    return channels, height, width


def decode_task_cpus() -> float:
    """Logical CPUs each decoding task of `convert_folder` asks for: as many tasks run at once as the cluster
    has CPUs, beside the CPUs the calling process holds (the to-parquet stage holds one, and only routes and
    writes the decoded rows, about a fifth of the work): 0.5 each on 2 CPUs, 0.94 on 16.

    At one whole CPU each, a 2-CPU machine decoded one batch at a time while the stage's CPU sat mostly idle:
    40,000 64x64 RGB PNGs took 7.7-8.4 s, against 6.2-6.5 s two at a time, and the plain PIL loop's 5.3-6.2 s
    (2-core AMD EPYC Zen 4, docs/performance.md)."""
    import ray  # Ray: only where the cluster is used

    context = ray.get_runtime_context()
    cpus = float(ray.cluster_resources().get("CPU", 1))
    held = float(context.get_assigned_resources().get("CPU", 0)) if context.worker.mode == ray.WORKER_MODE else 0.0
    return round(max(0.25, (cpus - held) / cpus), 3)
