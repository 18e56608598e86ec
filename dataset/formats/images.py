"""One PNG or JPEG as the pipeline reads it: checked, 8-bit, resized, gray or RGB.

The image folder's check (`dataset.formats.folder`), its conversion (in Ray Data tasks) and
``flows.predict``'s folders of images (`dataset.inputs.tables`) all decode through here, so an image
gives the same pixels wherever it is read.

- **Pixel limit.** PIL reads the header first and the pixels only on ``load()``, so an image of
  more than ``download.max_image_pixels`` (width x height) is refused from its header, naming
  the file, before its pixels take any memory.
- **A full decode check.** `check_image` decodes every pixel (``Image.verify()`` only checks the
  chunks' checksums and lets a PNG whose pixel data stops short pass); a JPEG is decoded at 1/8
  scale (``draft``), which still reads every byte of it, at a fraction of the cost.
- **16-bit images.** A 16-bit grayscale PNG (PIL modes ``I;16``, ``I;16B``, ``I;16L``, and ``I``,
  which is how PIL reads 16-bit PNGs that are not ``I;16``) is scaled to 8 bits by its bit depth:
  ``value >> 8`` (65535 -> 255, 32768 -> 128), where PIL's own ``convert("L")`` would clip every
  value above 255 to white. 16-bit RGB and RGBA PNGs PIL already reads as 8 bits (the high byte).
- **Then** resized (bilinear) to the requested size when it differs, then converted to ``L``
  (one channel) or ``RGB``, in that order (the order ``ray.data.read_images`` used, so 8-bit
  images give the bytes they gave before).
"""

from __future__ import annotations

import io
import warnings

import numpy as np

from dataset.tensors.memory import release_memory

# PIL modes holding more than 8 bits per pixel, scaled to 8 bits by `to_8bit`.
SIXTEEN_BIT_MODES = {"I;16", "I;16B", "I;16L", "I;16N", "I"}
LIMIT_FIELD = "download.max_image_pixels"


class ImageError(ValueError):
    """A file that is not an image the pipeline can read, naming it and what is wrong."""


def _damaged(name: str, exc: Exception) -> ImageError:
    return ImageError(
        f"{name}: cannot be decoded in full ({type(exc).__name__}: {exc}); "
        "the file is damaged or cut short: replace it or remove it"
    )


def open_image(data, name: str, max_pixels: int | None, field: str | None = LIMIT_FIELD):
    """The image in ``data`` (bytes or a binary file) opened lazily (header only); ImageError naming ``name``
    when it is not an image, or when it has more than ``max_pixels`` pixels (None: no limit; ``field``:
    the setting that raises it, None when there is none)."""
    from PIL import Image  # Pillow: only where an image is decoded

    try:
        with warnings.catch_warnings():  # PIL warns above 89 megapixels; the limit here is max_pixels
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
    except Exception as exc:  # UnidentifiedImageError, a cut header, PIL's own decompression-bomb guard
        raise ImageError(f"{name}: not a readable image ({type(exc).__name__}: {exc})") from None
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        image.close()
        fix = f"more than {field} ({max_pixels:,}); shrink the image, remove it, or raise {field}" if field else (
            f"more than the {max_pixels:,} an image may have; shrink it")
        raise ImageError(f"{name}: {width}x{height} = {width * height:,} pixels, {fix}")
    return image


def check_image(data: bytes, name: str, max_pixels: int | None, field: str = LIMIT_FIELD) -> tuple[str, tuple[int, int]]:
    """(PIL mode, (width, height)) of the image in ``data`` after decoding all of it; ImageError naming
    ``name`` when it is not an image, is over the pixel limit, or cannot be decoded in full."""
    image = open_image(data, name, max_pixels, field)
    mode, size = image.mode, image.size
    try:
        if image.format == "JPEG":
            image.draft(image.mode, (max(1, size[0] // 8), max(1, size[1] // 8)))  # every byte read, 1/8 of the work
        image.load()
    except Exception as exc:  # "image file is truncated", "broken data stream", a bad zlib stream
        raise _damaged(name, exc) from None
    finally:
        image.close()
    return mode, size


def to_8bit(image):
    """``image`` with 8 bits per channel: a 16-bit grayscale image scaled (``value >> 8``) to mode ``L``."""
    from PIL import Image  # Pillow: only where an image is decoded

    if image.mode not in SIXTEEN_BIT_MODES:
        return image
    values = np.asarray(image).astype(np.int64)
    return Image.fromarray((np.clip(values, 0, 65535) >> 8).astype(np.uint8), mode="L")


def pixels(image, channels: int, size: tuple[int, int] | None, name: str = "image") -> np.ndarray:
    """(height, width, channels) uint8 pixels of an opened image: 8-bit, resized to ``size`` ((width, height),
    None: as it is) and converted to gray (``channels`` 1) or RGB; ImageError naming ``name`` when it cannot
    be decoded in full."""
    try:
        return _pixels(image, channels, size)
    except Exception as exc:  # "image file is truncated", "broken data stream", a bad zlib stream
        raise _damaged(name, exc) from None


def _pixels(image, channels: int, size: tuple[int, int] | None) -> np.ndarray:
    from PIL import Image  # Pillow: only where an image is decoded

    image = to_8bit(image)
    if size is not None and image.size != tuple(size):
        image = image.resize(tuple(size), resample=Image.BILINEAR)
    mode = "L" if channels == 1 else "RGB"
    if image.mode != mode:
        image = image.convert(mode)
    array = np.asarray(image, dtype=np.uint8)
    return array.reshape(array.shape[0], array.shape[1], channels)


def decode(data: bytes, name: str, channels: int, size: tuple[int, int] | None, max_pixels: int | None) -> np.ndarray:
    """The image in ``data`` as (height, width, channels) uint8 (`pixels`); ImageError naming ``name``."""
    with open_image(data, name, max_pixels) as image:
        return pixels(image, channels, size, name)


def decode_batch(
    batch: dict, shape: tuple[int, int, int], resize: bool, max_pixels: int | None, prefix: str = ""
) -> dict:
    """Ray Data ``map_batches`` over ``read_binary_files(include_paths=True)`` rows: ``bytes`` -> ``image``
    (N, height, width, channels) uint8 of ``shape`` (C, H, W), resized to it when ``resize``; ``path`` kept.

    A file that cannot be decoded, or comes out at another size, is not raised here (Ray would hand the
    caller its traceback as text): its row gets zeros and the message, naming it, in ``error``, for
    the caller to raise. ``prefix`` makes the paths whole (``s3://``)."""
    return _decode_rows(list(batch["bytes"]), batch["path"], shape, resize, max_pixels, prefix)


def read_decode_batch(
    batch: dict, fs, shape: tuple[int, int, int], resize: bool, max_pixels: int | None, prefix: str = ""
) -> dict:
    """`decode_batch` over rows of ``path`` only: each file read from ``fs`` (a pyarrow filesystem) in the
    task that decodes it. A file that cannot be read gets its message, naming it, in ``error``."""
    release_memory()  # what this worker's last batch freed (`dataset.tensors.memory`)
    datas: list[bytes | str] = []
    for path in batch["path"]:
        try:
            with fs.open_input_stream(path) as handle:
                datas.append(handle.read())
        except OSError as exc:  # gone since the listing, unreadable
            datas.append(f"{prefix}{path}: cannot read it ({type(exc).__name__}: {exc})")
    return _decode_rows(datas, batch["path"], shape, resize, max_pixels, prefix)


def _decode_rows(datas: list, paths, shape: tuple[int, int, int], resize: bool, max_pixels: int | None, prefix: str) -> dict:
    """``datas`` (bytes, or a message when reading failed) decoded as `decode_batch` says."""
    channels, height, width = shape
    out = np.zeros((len(paths), height, width, channels), dtype=np.uint8)
    errors = []
    for i, (data, path) in enumerate(zip(datas, paths)):
        name = f"{prefix}{path}"
        if isinstance(data, str):
            errors.append(data)
            continue
        try:
            decoded = decode(data, name, channels, (width, height) if resize else None, max_pixels)
        except ImageError as exc:
            errors.append(str(exc))
            continue
        if decoded.shape != out.shape[1:]:
            errors.append(f"{name}: {decoded.shape[1]}x{decoded.shape[0]} pixels, the other images are {width}x{height}; "
                          "set transform.image_size")
            continue
        out[i] = decoded
        errors.append("")
    return {"image": out, "path": np.asarray(paths), "error": np.asarray(errors, dtype=object)}
