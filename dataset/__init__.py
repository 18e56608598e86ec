"""The dataset, from the IDX files to the tensors training reads; no Prefect, no stages.

    source     the Source interface every stage asks about the run's data, and the module of each
               download.source: idx_source (MNIST's IDX files), folder_source (a labelled image
               folder: folder, folder_convert), parquet_source (Parquet files: parquet_files)
    sources    where the IDX files come from (official mirrors, a mirror URL, the bundled sample),
               fetched with retries and verified
    idx        MNIST's IDX files, read and checked as they stream
    parquet    the Parquet layout of a converted dataset, the conversion, its manifest
    transform  the vectorized transform and the Ray Data datasets built from the Parquet splits
"""
