"""The MNIST training pipeline: the generic flow (flows/train.py) under MNIST's names.

    python -m flows.mnist                     # default preset: the quality run
    python -m flows.mnist --preset smoke      # a minutes-long check
    python -m flows.mnist --help              # every field, also settable as PIPELINE_<SECTION>__<FIELD>

The same stages, harness and parameters as ``python -m flows.train`` (``workload`` defaults to
mnist there too); what this module keeps is MNIST's own names, so existing deployments
(``mnist-resnet18/nightly``, ``mnist-resnet18/manual``), artifact keys and champions stay valid: the flow
``mnist-resnet18``, whose body is `flows.train.train_pipeline`'s (its runs' resume commands say
``python -m flows.mnist``). Its settings read ``PIPELINE_*`` as every entry point's do, and still the
``MNIST_*`` variables they read before, each named as deprecated when the command starts.
"""

from __future__ import annotations

from prefect import flow

from flows.train import train_pipeline
from pipeline_config import PipelineConfig
from pipeline_config.settings import PipelineSettings
from runner import hooks
from runner.harness import exit_now, run_cli
from runner.pipeline_run import flow_run_name
from runner.summary import RunSummary


@flow(name="mnist-resnet18", flow_run_name=flow_run_name, log_prints=True, on_failure=[hooks.report_failure])
def mnist_pipeline(config: PipelineConfig = PipelineConfig()) -> RunSummary:
    """Download MNIST, convert to Parquet, transform with Ray Data, train ResNet-18 with Ray Train, evaluate, promote, clean up."""
    return train_pipeline.fn(config)  # the training flow's stage list, run as this flow (deployments keep this name)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: parse settings, run the flow against a Prefect API, print a short summary."""
    return run_cli(argv, PipelineSettings, mnist_pipeline, "MNIST pipeline", "flows.mnist")


if __name__ == "__main__":
    exit_now(main())
