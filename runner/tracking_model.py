"""A promoted version as an MLflow model: the ``model/`` artifact of its tracked run, which the registered model's
version points at (`runner.tracking.Tracker`), so ``mlflow models serve -m models:/<name>@champion`` serves it.

The model is an MLflow pyfunc (`training.mlflow_pyfunc.ChampionPyfunc`) with

- one artifact, ``version``: our registry's version folder as it is (model.pt, its ``_checksums.json``, the model card,
  the pictures), so the weights MLflow serves are the ones our registry checked, and the card's transform (mean, std,
  image shape) and classes travel with them;
- the code it needs (the model's own file `PYFUNC`, and ``code/``: the packages `PACKAGES`, without caches): the same reading and scoring as
  ``flows.predict`` and the served champion;
- a signature: a table of one binary ``image`` column (PNG or JPEG bytes) in; ``class``, ``index``, ``probability``
  and ``probabilities`` (one per class, in the card's order) out; in its metadata the classes and the
  ``preprocessing`` the pyfunc applies (mean, std, image shape);
- the versions of what it imports (`REQUIREMENTS`) installed where it was written (the lock's, in this project's
  venv), for MLflow's environment managers.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from importlib.metadata import version as installed
from pathlib import Path

from training.champion.registry_files import CARD_FILE, card_data

ROOT = Path(__file__).resolve().parents[1]
PYFUNC = ROOT / "training" / "mlflow_pyfunc.py"  # the model, as MLflow's "model from code"
PACKAGES = ("training", "dataset", "pipeline_config", "storage_io")  # what training.serving imports of this project
REQUIREMENTS = ("torch", "torchvision", "numpy", "pandas", "pyarrow", "pillow", "pydantic", "pydantic-settings", "mlflow")
RAY_EXTRA = "data"  # dataset.tensors imports ray.data


def write_mlflow_model(version_folder: Path, out: Path) -> None:
    """The MLflow model of the registry version in ``version_folder`` (a local copy), written to ``out`` (a new folder)."""
    import mlflow.pyfunc  # MLflow: only when a promoted run is tracked
    from mlflow.models import ModelSignature  # MLflow: only when a promoted run is tracked
    from mlflow.types.schema import Array, ColSpec, Schema  # MLflow: only when a promoted run is tracked

    card = json.loads((version_folder / CARD_FILE).read_text())
    data = card_data(card)
    signature = ModelSignature(
        inputs=Schema([ColSpec("binary", "image")]),
        outputs=Schema([ColSpec("string", "class"), ColSpec("long", "index"), ColSpec("double", "probability"),
                        ColSpec(Array("double"), "probabilities")]),
    )
    metadata = {"registry_model": card["model"], "registry_version": card["version"], "classes": list(data["classes"]),
                "preprocessing": {"mean": card["data"].get("mean"), "std": card["data"].get("std"), "image": list(data["shape"])}}
    requirements = [f"{name}=={installed(name)}" for name in REQUIREMENTS] + [f"ray[{RAY_EXTRA}]=={installed('ray')}"]
    with tempfile.TemporaryDirectory(prefix="mlflow-code-") as code:
        packages = [str(shutil.copytree(ROOT / name, Path(code) / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")))
                    for name in PACKAGES]
        mlflow.pyfunc.save_model(str(out), python_model=str(PYFUNC), artifacts={"version": str(version_folder)},
                                 code_paths=packages, signature=signature, pip_requirements=requirements, metadata=metadata)
