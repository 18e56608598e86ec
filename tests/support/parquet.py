"""Reading back what the Parquet conversion wrote."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def read_split(folder: Path) -> pa.Table:
    """Every Parquet file of one split folder as one table, in row-id order."""
    return pa.concat_tables(pq.read_table(p) for p in sorted(folder.glob("*.parquet"))).sort_by("row_id")
