"""How a model card says its model scores images: the run's transform with the card's normalization, its evaluation
settings with the caller's actor pool, the architecture (held to PIPELINE_MODEL_MODULES for a deployment's run), the
columns its run read."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
from pydantic import ValidationError

from dataset.sources.interface import Source, source_for
from pipeline_config import DownloadConfig, EvaluateConfig, TransformConfig
from storage_io import join
from training.champion import registry_files
from training.model import trust
from training.model.catalog import ModelSpec


class CardScoring(NamedTuple):
    """How a model card says its model scores images, as `training.inference.predict_table` takes it."""

    transform: TransformConfig  # the run's, normalized with the card's mean and std
    evaluate: EvaluateConfig  # the run's (``tta``), with this command's actor pool and batch size
    model: ModelSpec  # the architecture model.pt holds
    data: dict[str, Any]  # `training.champion.registry_files.card_data`: shape, classes, mean, std, image_size
    source: Source  # the model's run's data source, which reads the images to score (`card_source`)

    def read_inputs(self, folder: str | Path) -> pa.Table:
        """The images in ``folder`` to score with this model, as its run's data source reads them
        (`dataset.sources.interface.Source.read_inputs`) at the card's shape, classes and size."""
        return self.source.read_inputs(str(folder), self.data["shape"], self.data["classes"], self.data["image_size"])


def card_scoring(card: dict, folder: str, num_actors: int, batch_rows: int, deployed: bool = False) -> CardScoring:
    """The card's scoring configuration; RegistryDamaged naming the card in ``folder`` when it does not validate.

    ``deployed``: a run started through a deployment (``score/on-promotion``), whose parameters chose the
    card: its architecture, a ``module:function``, is imported only from the modules ``PIPELINE_MODEL_MODULES``
    allows (`training.model.trust.check_allowed`, on the name: nothing is imported); ValueError naming the
    card and the setting. The command line trusts its user, as ``flows.train``'s does.
    """
    run_config = card.get("config") if isinstance(card.get("config"), dict) else {}
    try:
        transform = TransformConfig.model_validate(run_config.get("transform") or {})
        evaluate = EvaluateConfig.model_validate(run_config.get("evaluate") or {}).model_copy(
            update={"num_actors": num_actors, "batch_rows": batch_rows}
        )
        model_spec = registry_files.card_model(card)
        data = registry_files.card_data(card)
        transform = transform.model_copy(update={"mean": data["mean"], "std": data["std"]})
    except (ValidationError, KeyError, TypeError, ValueError) as exc:
        raise registry_files.RegistryDamaged([f"{join(folder, registry_files.CARD_FILE)}: damaged: its config does not validate ({exc})"]) from None
    try:  # before any model is built: the scoring below builds it, in this process or on a Ray worker
        trust.check_allowed(model_spec.name, deployed=deployed)
    except ValueError as exc:
        named = f"{card.get('model')} v{card.get('version')}" if card.get("model") else join(folder, registry_files.CARD_FILE)
        raise ValueError(f"the model card of {named} ({folder}) names its architecture; {exc}") from None
    return CardScoring(transform, evaluate, model_spec, data, card_source(run_config))


def card_source(run_config: dict) -> Source:
    """The data source of the model's run: its ``download`` section as the card records it. A section that no longer
    validates (a card of an older release, a source no longer registered) reads as the default source with the
    Parquet columns the run read (``download.image_column`` and ``label_column``; a card without them: ``image`` and
    ``label``)."""
    download = run_config.get("download") if isinstance(run_config.get("download"), dict) else {}
    try:
        return source_for(DownloadConfig.model_validate(download))
    except ValueError:  # pydantic's ValidationError, or a source whose module is gone
        defaults = DownloadConfig.model_fields
        columns = {field: value if isinstance(value := download.get(field), str) and value else defaults[field].default
                   for field in ("image_column", "label_column")}
        return source_for(DownloadConfig(**columns))
