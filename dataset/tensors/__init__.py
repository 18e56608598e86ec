"""From Parquet rows to the tensors training reads: the Ray Data transform, augmentation, held splits."""
