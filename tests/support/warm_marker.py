"""Imported by the warm-up test in Ray workers: each importing process leaves a file named by its pid."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

MARKERS = Path(tempfile.gettempdir()) / "mnist-warm-markers"

MARKERS.mkdir(exist_ok=True)
(MARKERS / str(os.getpid())).touch()
