"""One version of a registered model, loaded and checked, answering with class probabilities: what a serving replica
holds (`deployments.serve_model`), without Ray Serve, so it is tested and used on its own.

`Scorer` reads the version as ``flows.predict`` does: the pointer or the version named, its model card, model.pt
checked against its recorded checksum (`training.champion.lookup.resolve`), the architecture the card names
(``module:function`` models held to ``PIPELINE_MODEL_MODULES`` when ``deployed``), the weights loaded with
``weights_only`` (`training.checkpoint.model_files`), then one forward pass on blank images of the card's shape
(`Scorer.trial`): a version that fails any of these is refused before it answers anything. The images to score are
read by the model's run's data source (`dataset.sources.interface.Source.read_inputs`, the same checks as
``flows.predict``), normalized as evaluation normalizes them (`dataset.tensors.batches.prepare_batch`) and scored by the
evaluation's `training.inference.Predictor` (TTA as the card's run had it), so a served answer is ``flows.predict``'s.
"""

from __future__ import annotations

import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from dataset.tensors.batches import prepare_batch
from storage_io import exists, join, read_json
from training.champion import lookup
from training.champion.card_scoring import CardScoring, card_scoring
from training.champion.registry_files import CARD_FILE, card_problem, verify_weights
from training.inference import Predictor

# The most classes an answer lists for one image, most probable first.
TOP_CLASSES = 5


class Scorer:
    """``model``'s version ``version`` (None: the champion) under the storage root ``root``, loaded and checked.

    ValueError (RegistryDamaged, a ValueError, for a damaged registry) naming what is wrong, before any request."""

    def __init__(self, root: str, model: str, version: int | None = None, threads: int = 1, deployed: bool = False):
        version, folder, card = lookup.resolve(root, model, version)  # model.pt against its checksum
        self._load(model, version, folder, card, threads, deployed)

    @classmethod
    def from_folder(cls, folder: str, threads: int = 1) -> Scorer:
        """One version's folder on its own, outside its registry (model.pt, its ``_checksums.json``, the model card: what an
        MLflow model of it holds, `runner.tracking_model`), checked as a registry's version is; ValueError naming it."""
        card = read_json(join(folder, CARD_FILE)) if exists(join(folder, CARD_FILE)) else None
        version = card.get("version") if isinstance(card, dict) else None
        problem = card_problem(card, version) if card is not None else "missing"
        if problem or not isinstance(card.get("model"), str):
            raise ValueError(f"{join(folder, CARD_FILE)}: {problem or 'names no model'}")
        verify_weights(folder)
        scorer = cls.__new__(cls)
        scorer._load(card["model"], version, folder, card, threads, deployed=False)
        return scorer

    def _load(self, model: str, version: int, folder: str, card: dict, threads: int, deployed: bool) -> None:
        self.model, self.version, self.folder, self.card = model, version, folder, card
        self.scoring: CardScoring = card_scoring(self.card, self.folder, 1, 256, deployed=deployed)
        try:
            self.predictor = Predictor(self.folder, threads, self.scoring.evaluate.tta, self.scoring.model.model_dump())
        except Exception as exc:  # weights that do not load into the card's architecture, whatever torch raised
            raise ValueError(f"{model} v{self.version} ({self.folder}): its weights do not load ({type(exc).__name__}: {exc})") from None
        self.trial()
        self.since = datetime.now(timezone.utc).isoformat(timespec="seconds")

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.scoring.data["shape"])

    @property
    def classes(self) -> list[str]:
        return list(self.scoring.data["classes"])

    def trial(self) -> None:
        """One forward pass on two blank images of the card's shape; ValueError naming the version when it does not run or
        does not answer one probability per class."""
        try:
            probabilities = self.predictor.probabilities(np.zeros((2, *self.shape), dtype=np.float32))
        except Exception as exc:  # a model that cannot run on its own card's images: refused, whatever it raised
            raise ValueError(f"{self.model} v{self.version} ({self.folder}): does not run on {self.shape} images ({exc})") from None
        if probabilities.shape != (2, len(self.classes)):
            raise ValueError(f"{self.model} v{self.version} ({self.folder}): answers {probabilities.shape[1:]} scores, "
                             f"its card names {len(self.classes)} classes")

    def read(self, files: list[tuple[str, bytes]]) -> pa.Table:
        """The images in ``files`` ((name, bytes): PNG, JPEG, IDX or Parquet files) as ``flows.predict`` reads a folder of
        them; ValueError naming the file that is not what it claims, too large, or of another shape."""
        with tempfile.TemporaryDirectory(prefix="serve-") as folder:
            for name, data in files:
                (Path(folder) / Path(name).name).write_bytes(data)
            try:
                return self.scoring.read_inputs(folder)
            except ValueError as exc:  # named as the request sent it, not by the folder it was read from here
                raise ValueError(str(exc).replace(f"{folder}/", "").replace(folder, "the request")) from None

    def prepared(self, table: pa.Table) -> np.ndarray:
        """The images of ``table`` (the dataset schema) as the model takes them, (N, C, H, W) float32, normalized as
        evaluation normalizes them."""
        transform = self.scoring.transform
        return prepare_batch(table, transform.mean, transform.std, shape=self.shape)["image"]

    def probabilities(self, table: pa.Table) -> np.ndarray:
        """(N, classes) class probabilities of the rows of ``table``."""
        return self.predictor.probabilities(self.prepared(table))

    def answer(self, probabilities: np.ndarray) -> list[dict[str, Any]]:
        """Each image's answer: its class (the most probable) and up to `TOP_CLASSES` classes with their probabilities."""
        answers = []
        for row in probabilities:
            top = np.argsort(-row)[:TOP_CLASSES]
            answers.append({"class": self.classes[int(top[0])], "index": int(top[0]), "probability": round(float(row[top[0]]), 6),
                            "top": [{"class": self.classes[int(i)], "probability": round(float(row[i]), 6)} for i in top]})
        return answers

    def describe(self) -> dict[str, Any]:
        """Which version answers, since when, and what it was trained on (``GET /model``)."""
        return {"model": self.model, "version": self.version, "since": self.since, "run": self.card.get("run_name"),
                "test_accuracy": (self.card.get("metrics") or {}).get("test_accuracy"), "classes": self.classes,
                "image": {"channels": self.shape[0], "height": self.shape[1], "width": self.shape[2]},
                "image_size": self.scoring.data.get("image_size")}
