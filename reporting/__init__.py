"""What a run shows people: pictures and Prefect artifacts, training progress, the environment.

    reports      digit grids, training curves, confusion matrices, the Prefect artifacts built
                 from them, and the training stage's progress callback
    environment  versions and hardware, for the environment report and the benchmarks
    logs         the stage logger (the Prefect run's logger, or a plain one outside a run)
"""
