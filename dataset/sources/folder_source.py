"""A labelled image folder as a run's data (``download.source=folder``): `FolderSource`.

The layout and its checks, the listing cache and the images' headers are `dataset.formats.folder`'s; the
conversion, with Ray Data, `dataset.formats.folder_convert`'s. The folder is the user's: read where it is,
never copied, changed or deleted (cleanup deletes nothing of it), and the watcher watches it.
"""

from __future__ import annotations

from dataset.formats import folder, folder_scan
from dataset.formats.folder import FolderError
from dataset.formats.folder_convert import convert_folder
from dataset.formats.parquet import FORMAT_VERSION
from dataset.sources.interface import DataToCome, Defaults, RawData, Source, Written, check_reachable
from dataset.tensors.memory import release_memory
from pipeline_config import ParquetConfig
from storage_io import StorageLayout, is_remote, sha256_json

# How an image folder's pixels are decoded (`dataset.formats.images`), part of its datasets' fingerprint:
# 2 since 16-bit grayscale is scaled to 8 bits (before, it was clipped at 255), so a dataset
# converted the old way is not reused.
FOLDER_DECODE = 2
# How an image folder's training rows are ordered (`dataset.formats.folder_convert.plan_rows`): "shuffled" since a
# streamed split is read in windows of row groups; before, in file order (class by class).
FOLDER_ORDER = "shuffled"


class FolderSource(Source):
    """``download.path``: ``train/<class>/*.png|jpg``, ``test/<class>/...``, optionally ``val/<class>/...``."""
    predict_input = "<folder of images>"

    kind = "folder"
    title = "Image folder"
    defaults = Defaults(measure_stats=True, augment="shifts")

    def check(self, image_size: int | None, storage_root: str | None, decode: bool = True) -> DataToCome:
        """The layout of ``download.path`` and its images' shape; FolderError naming the path: an ``s3://`` folder whose
        endpoint or bucket does not answer (the storage root's check, `StorageLayout.check_reachable`), a bad layout
        (`dataset.formats.folder.check_folder`), and for a local folder a file that is not a readable image (with
        ``decode``, every image decoded in full: one that stops short too), one of more than
        ``download.max_image_pixels`` pixels, sizes that differ without ``transform.image_size``. An ``s3://``
        folder's images are opened by the conversion stage only: reading every image over the network before any
        work is too much to spend, so its channels are not known yet. ``storage_root``: where the listing cache lives;
        an image it says decoded in full at this limit or a stricter one, and unchanged since (size, mtime), has its
        header read only. What a decoding check learns is held in this process, not written (`keep_checks` writes it
        once the run is past every check)."""
        cfg = self.cfg
        check_reachable(cfg.path, "download.path", FolderError)
        try:
            layout = folder.check_folder(cfg.path)
        except OSError as exc:  # the listing failed half-way (network, permissions)
            raise FolderError(f"download.path {cfg.path}: cannot list it ({type(exc).__name__}: {exc})") from None
        if is_remote(cfg.path):
            return DataToCome((None, image_size, image_size), layout.classes)
        if not decode:
            return DataToCome(folder_scan.image_shape(layout, image_size, storage_root), layout.classes)
        cache = folder.listing_cache(layout, storage_root)
        shape = folder_scan.scan_images(layout, image_size, cfg.max_image_pixels, decode=True, cache=cache)
        cache.hold()  # written by `keep_checks` once the run is past every check: a refused run writes nothing
        release_memory()  # what decoding every image took, handed back: the flow's process trains beside it
        return DataToCome(shape, layout.classes)

    def fetch(self, layout: StorageLayout | None, log) -> RawData:
        """Check the layout and record every image's sha256 (the dataset's fingerprint changes when the data
        does). Nothing is copied: the folder is read where it is, and never deleted.

        ``layout``: its storage root keeps the listing cache (`dataset.formats.listing`): an image whose size and
        mtime are unchanged since an earlier run reuses its sha256, so an unchanged folder is listed, not
        read. An edit that keeps both size and mtime is not noticed. None: every image is hashed."""
        cfg = self.cfg
        found = folder.check_folder(cfg.path)
        cache = folder.listing_cache(found, layout.root if layout is not None else None)
        files = folder.folder_files(found, cache)
        cache.save()
        counts = {split: len(rows) for split, rows in found.files.items()}
        log.info("Image folder %s: %d classes (%s), images %s", cfg.path, len(found.classes), ", ".join(found.classes), counts)
        notes = [found.skipped_note()] if found.skipped_note() else []  # the files the listing passed over
        return RawData(source="folder", url=cfg.path, directory=cfg.path, files=files, skipped=False, notes=notes)

    def fingerprint(self, raw: RawData, cfg: ParquetConfig, image_size: int | None) -> str:
        key = {"v": FORMAT_VERSION, "source": "folder", "inputs": raw.files, "cfg": cfg.model_dump(), "image_size": image_size,
               "decode": FOLDER_DECODE, "order": FOLDER_ORDER}
        return sha256_json(key)[:16]

    def write(self, raw, cfg, staging, image_size, max_pixels, storage_root) -> Written:
        """The images read and decoded (`dataset.formats.folder_convert`: here on one node, by Ray Data on a cluster), as the download stage listed them."""
        found = folder.check_folder(raw.directory)
        listed = {rel for rows in found.files.values() for rel, _ in rows}
        if listed != set(raw.files):  # the folder changed between the download stage and now
            raise FolderError(f"{raw.directory}: its images changed since the download stage listed them; run again")
        rows, shape = convert_folder(found, staging, cfg, image_size, max_pixels=max_pixels, storage_root=storage_root)
        split = "its val/ folder" if found.has_val else f"a stratified split of train/ (parquet.split_seed={cfg.split_seed})"
        detail = f", {shape[1]}x{shape[2]}x{shape[0]} images, {len(found.classes)} classes; validation from {split}"
        return Written(rows, shape, found.classes, detail)


SOURCE = FolderSource
