"""Training and scoring a model; no Prefect, no stages.

    model           the ResNet-18 and its checkpoint files (model.pt, optimizer.pt, extra_state.pt,
                    _checksums.json), loading and verifying them
    loop            the per-worker Ray Train loop: sharded epochs, validation, checkpoints,
                    mid-epoch resumption, the hang guard (what Ray ships to each worker)
    trainer         the TorchTrainer around the loop: resources, run folder, result, retry rules
    single_process  the same loop in one process, without Ray Train
    inference       scoring a split with a checkpoint through a pool of model actors, and metrics
    faults          test-only fault injection (off unless a test sets its environment variables)
"""
