"""The dataset, from the IDX files to the tensors training reads; no Prefect, no stages.

    sources    where the IDX files come from (official mirrors, a mirror URL, the bundled sample),
               fetched with retries and verified
    idx        MNIST's IDX files, read and checked as they stream
    parquet    the Parquet layout of a converted dataset, the conversion, its manifest
    transform  the vectorized transform and the Ray Data datasets built from the Parquet splits
"""
