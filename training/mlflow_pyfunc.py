"""A registry version as an MLflow pyfunc model: images in, each one's class and probabilities out, as the served
champion answers (`training.serving.Scorer`). `runner.tracking_model` writes it into a tracked run's ``model/``, which
becomes the registered model's version, so ``mlflow models serve -m models:/<name>@champion`` serves our champion.

Its input is a table with one ``image`` column of PNG or JPEG bytes (base64 in MLflow's JSON requests); the images are
read with ``flows.predict``'s checks (a file that is no image or of another size than the model takes: ValueError naming
it) and normalized as evaluation normalizes them, by the model card's transform, which travels inside the model.

This file is MLflow's "model from code": MLflow copies it into the model and runs it to get the model (its last line,
`mlflow.models.set_model`), so no pickled object is stored. Nothing imports it as a module.
"""

from __future__ import annotations

import mlflow.models
import mlflow.pyfunc
import numpy as np
import pandas as pd

JPEG = b"\xff\xd8\xff"


class ChampionPyfunc(mlflow.pyfunc.PythonModel):
    """The version folder in the MLflow model's artifact ``version``, loaded and checked once (`Scorer.from_folder`)."""

    def load_context(self, context) -> None:
        from training.serving import Scorer  # the model's code, from the MLflow model's code/ where it is served

        self.scorer = Scorer.from_folder(context.artifacts["version"])

    # No annotations on predict's arguments: MLflow 3 would take them as the model's input schema, and the signature
    # written with the model says it (one binary column).
    def predict(self, context, model_input, params=None) -> pd.DataFrame:
        images = model_input["image"] if isinstance(model_input, pd.DataFrame) else model_input
        files = [(f"image-{i:05d}.{'jpg' if bytes(data)[:3] == JPEG else 'png'}", bytes(data)) for i, data in enumerate(images)]
        probabilities = self.scorer.probabilities(self.scorer.read(files))
        best = probabilities.argmax(axis=1)
        classes = self.scorer.classes
        return pd.DataFrame({"class": [classes[int(i)] for i in best], "index": best.astype(np.int64),
                             "probability": probabilities[np.arange(len(best)), best].astype(np.float64),
                             "probabilities": [row.astype(np.float64).tolist() for row in probabilities]})


mlflow.models.set_model(ChampionPyfunc())  # MLflow's models-from-code contract (above): the model this file defines
