"""The data path at size: image folders, listings, Parquet conversion, tiny images, full MNIST size, and the workloads the benchmarks make."""
