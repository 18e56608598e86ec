"""Issue 60: every flow that promotes sends the promotion event, the watcher keeps a listing only once its
event was accepted, scoring imports only allowed model modules, and "nothing new" compares contents.

Real parts: a real ``prefect server start`` on 127.0.0.1 (the session's shared server; its events read
back over the REST API) and a closed port on 127.0.0.1 as a Prefect API that cannot be reached, real
image folders and listings on a real storage root, a real model registry with real ResNet-18 weights.
What cannot run here is said where it is replaced: a whole search (minutes, the slow tier) is replaced
by its stages' recorded outputs, so that only the flow's own code between the stages runs.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from dataset.formats import watching
from flows.watch import describe, look
from reporting import events
from tests.support.images import write_image_folder
from tests.support.prefect_server import free_port, using_api, wait_for


def server_events(server, name: str) -> list[dict]:
    """The events called ``name`` that the server holds, oldest first."""
    body = {"filter": {"event": {"name": [name]}, "order": "ASC"}, "limit": 50}
    return server.post("/events/filter", body)["events"]


def arrived(server, name: str, event_id: str, timeout_s: float = 30) -> dict:
    """The event ``event_id`` once the server has it (events are written by the server's own services)."""
    found = wait_for(lambda: [e for e in server_events(server, name) if e["id"] == event_id], timeout_s, f"{name} {event_id}")
    return found[0]


# --- 2. the watcher: a listing is kept only once Prefect accepted its event -----------------------------------


def test_the_watcher_keeps_a_listing_only_once_prefect_accepted_its_event(tmp_path, shared_server):
    folder = write_image_folder(tmp_path / "uploads", {"train": 2, "test": 1})
    root = str(tmp_path / "root")
    kept = Path(watching.state_path(root, str(folder)))

    closed = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there: the API cannot be reached
    with using_api(closed):
        refused = look(str(folder), "uploads", root)
    line = describe(refused)
    assert refused["event"] is None and refused["added"] == 9, refused
    assert f"{events.DATA_LANDED} not sent: " in line and "will retry on the next look" in line, line
    assert f"sent {events.DATA_LANDED}" not in line.replace("not sent", ""), line
    assert not kept.exists()  # the change is still news: the next look sees it again

    with using_api(shared_server.api):
        sent = look(str(folder), "uploads", root)
    assert sent["event"] and sent["added"] == 9 and describe(sent).endswith(f"; sent {events.DATA_LANDED}"), sent
    event = arrived(shared_server, events.DATA_LANDED, sent["event"])
    assert event["payload"]["path"] == str(folder) and event["payload"]["added"] == 9
    assert kept.is_file()  # accepted: now the listing is the last look's

    with using_api(shared_server.api):
        quiet = look(str(folder), "uploads", root)
    assert quiet["event"] is None and not (quiet["added"] or quiet["removed"] or quiet["changed"]), quiet


# --- 2. the search's train_best promotes, so it sends the promotion event --------------------------------------


def test_the_searchs_winner_promoted_sends_the_promotion_event(tmp_path, shared_server, run_tree, monkeypatch):
    """flows.tune's body with ``tune.train_best``, its stages run by the real `StageRecorder` with every stage's own
    hooks (`flows.stages`): its promotion sends ``pipeline.model.promoted`` as the training flow's does, to a real
    Prefect server. A real search takes minutes (the slow tier): the stages' Ray tasks are replaced by their recorded
    outputs (`Recorded.run_task`) and the run context by one that only hands the body that recorder (`Recorded`'s
    run, no checks and no Ray), so the flow's stage list and everything each stage does around its task run."""
    from dataset.tensors.spec import TransformSpec
    from flows import tune
    from pipeline_config import TransformConfig, TunePipelineConfig
    from runner.stages import StageRecorder
    from tasks.promote import PromotionOutcome
    from training.champion.registry import Promotion

    layout, raw, dataset, trained, evaluation = run_tree
    config = TunePipelineConfig.model_validate({"storage_root": layout.root, "tune": {"train_best": True}})
    model = config.registry_name
    dataset = dataset.model_copy(update={"rows": {"train": 640, "val": 10, "test": 10}})  # the rows training is planned by
    spec = TransformSpec.model_construct(dataset=dataset, config=TransformConfig(), checks={}, manifest="m")
    sampled = {"learning_rate": 0.01, "weight_decay": 0.0001, "global_batch_size": 64, "label_smoothing": 0.0, "augmentation": 1.0}
    promotion = Promotion(model=model, promoted=True, reason="better", version=3, champion_before=2, champion_accuracy=0.5)
    searched = SimpleNamespace(best=SimpleNamespace(config=sampled), summary=lambda: {"trials": 4})
    outputs = {
        "download": raw, "to-parquet": dataset, "transform": spec, "tune": searched,
        "train": trained, "evaluate": evaluation, "promote": PromotionOutcome(promotion=promotion), "cleanup": None,
    }

    class Recorded(StageRecorder):
        def run_task(self, stage, parameters):
            return outputs[stage.name]

    before = {e["id"] for e in server_events(shared_server, events.PROMOTED)}
    recorder = Recorded(None, layout, config, {}, tune.stage_plan(config), "flows.tune")

    class RecordedRun:  # what `PipelineRun` hands the flow's body, without its checks and without Ray
        def __init__(self, *args):
            self.layout, self.result = layout, None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.result = recorder.summary()
            return False

        def __call__(self, stage, **parameters):
            return recorder(stage, **parameters)

    monkeypatch.setattr(tune, "PipelineRun", RecordedRun)
    with using_api(shared_server.api):
        tune.mnist_tune.fn(config)
    assert list(recorder.stages) == ["download", "to-parquet", "transform", "tune", "train", "evaluate", "promote", "cleanup"]
    assert recorder.completed() and recorder.summary().tuning == {"trials": 4}

    def new() -> list[dict]:
        return [e for e in server_events(shared_server, events.PROMOTED) if e["id"] not in before
                and e["payload"].get("run") == layout.run_name]

    (event,) = wait_for(new, 30, f"the search's {events.PROMOTED} event")
    assert event["resource"]["prefect.resource.id"] == f"pipeline.model.{model}"
    assert event["payload"] | {"storage_root": None} == {
        "model": model, "version": 3, "test_accuracy": evaluation.accuracy, "run": layout.run_name, "replaced_version": 2,
        "replaced_accuracy": 0.5, "storage_root": None,
    }


# --- 3. scoring started from a deployment imports only allowed model modules -------------------------------------


def test_score_on_promotion_refuses_a_card_naming_a_module_that_is_not_allowed_before_importing_it(tmp_path, monkeypatch):
    """``score/on-promotion`` takes ``model`` and ``storage_root`` as run parameters: whoever starts it picks the
    model card, and the card's architecture is code. In a deployment's flow run it is held to
    ``PIPELINE_MODEL_MODULES`` before any model is built; nothing of the refused module runs."""
    import sys
    import uuid

    from prefect.client.schemas.objects import FlowRun
    from prefect.context import FlowRunContext

    from flows.score import score_with_champion
    from storage_io import StorageLayout
    from tests.support.cli import ROOT
    from tests.support.registry import candidate, make_dataset
    from training.champion import lookup, registry
    from training.champion.card_scoring import card_scoring
    from training.model.trust import MODULES_ENV

    marker = tmp_path / "team_scorers-was-imported"
    (tmp_path / "team_scorers.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('top-level code ran')\n"
        "def build(in_channels, num_classes):\n    raise RuntimeError('built')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(MODULES_ENV, raising=False)
    root = str(tmp_path / "root")
    layout = StorageLayout.create(root, "setup")
    planted = candidate(layout, "planted", 0.99, make_dataset(layout, "mnist-abc")).model_copy(
        update={"model": {"name": "team_scorers:build", "in_channels": 1, "num_classes": 10}}
    )
    assert registry.promote(layout, "planted-model", planted).promoted

    deployed = FlowRunContext.model_construct(flow_run=FlowRun(flow_id=uuid.uuid4(), deployment_id=uuid.uuid4()))
    with deployed, pytest.raises(ValueError, match=rf"planted-model v1.*'team_scorers:build'.*{MODULES_ENV}.*nothing was imported"):
        score_with_champion.fn(model="planted-model", images=str(ROOT / "data" / "mnist-sample"), storage_root=root)
    assert not marker.exists() and "team_scorers" not in sys.modules  # its top level never ran
    assert not (tmp_path / "root" / "predictions").exists()

    version, folder, card = lookup.resolve(root, "planted-model")
    card_scoring(card, folder, 1, 250)  # the command line (flows.predict) trusts its user, as flows.train's does
    monkeypatch.setenv(MODULES_ENV, "team_scorers")
    assert card_scoring(card, folder, 1, 250, deployed=True).model.name == "team_scorers:build"  # allowed by the operator
    assert not marker.exists()  # still nothing imported: the check reads the name only


# --- 4. nothing new: model.weights by content, and the last trained run remembered -----------------------------

MODEL = "mnist-resnet18"


def nightly(root: str, **changes):
    """The nightly preset's configuration on ``root`` with the bundled sample."""
    from pipeline_config import PipelineConfig, load_preset

    values = load_preset("nightly") | {"storage_root": root, "download": {"source": "sample"}}
    for section, fields in changes.items():
        values[section] = values.get(section, {}) | fields
    return PipelineConfig.model_validate(values).model_dump(mode="json")


def champion(layout, run: str, dataset: str, config: dict, weights: dict | None = None, model: str = MODEL, seed: int = 0,
             accuracy: float = 0.9):
    from tests.support.registry import candidate
    from training.champion import registry

    promoted = candidate(layout, run, accuracy, dataset, seed=seed).model_copy(update={"config": config, "weights": weights})
    assert registry.promote(layout, model, promoted).promoted


def test_nothing_new_compares_what_model_weights_holds_not_its_name(tmp_path):
    import shutil

    from storage_io import StorageLayout, sha256_file
    from tests.support.registry import make_checkpoint, make_dataset
    from training.champion import lookup, unchanged

    root = str(tmp_path / "root")
    layout = StorageLayout.create(root, "setup")
    dataset = make_dataset(layout, "mnist-abc")
    start = Path(make_checkpoint(str(tmp_path / "start"), seed=1)) / "model.pt"
    record = {"source": str(start), "file": str(start), "sha256": sha256_file(str(start))}
    config = nightly(root, model={"weights": str(start)})
    champion(layout, "champion-run", dataset, config, record)
    assert unchanged.compare(root, MODEL, dataset, True, config).unchanged

    moved = tmp_path / "elsewhere" / "same.pt"  # the same bytes under another name: nothing new
    moved.parent.mkdir()
    shutil.copy(start, moved)
    assert unchanged.compare(root, MODEL, dataset, True, nightly(root, model={"weights": str(moved)})).unchanged

    make_checkpoint(str(tmp_path / "start"), seed=2)  # the same name, other weights: something new
    verdict = unchanged.compare(root, MODEL, dataset, True, config)
    assert not verdict.unchanged and verdict.reason == f"model.weights differ from {MODEL} v1's", verdict.reason
    start.unlink()
    assert not unchanged.compare(root, MODEL, dataset, True, config).unchanged  # gone: not "nothing new" either

    # A registry name: the champion it names is what counts, so a new champion of it is something new.
    champion(layout, "base-run", dataset, {"train": {"epochs": 1}}, model="base-resnet18", seed=3)

    _, folder, _ = lookup.resolve(root, "base-resnet18")
    named = nightly(root, model={"weights": "base-resnet18"})
    base = {"source": "base-resnet18", "file": f"{folder}/model.pt", "sha256": sha256_file(f"{folder}/model.pt")}
    champion(layout, "champion-2", dataset, named, base, seed=4, accuracy=0.95)
    assert unchanged.compare(root, MODEL, dataset, True, named).unchanged
    champion(layout, "base-run-2", dataset, {"train": {"epochs": 1}}, model="base-resnet18", seed=5, accuracy=0.95)  # base v2
    verdict = unchanged.compare(root, MODEL, dataset, True, named)
    assert not verdict.unchanged and verdict.reason == f"model.weights differ from {MODEL} v2's", verdict.reason


def test_a_run_not_promoted_is_remembered_so_its_data_is_not_trained_again_until_something_changes(tmp_path, shared_server):
    """The promote stage (the real `tasks.promote.promote_model`, whose run failed its gate: no Ray needed; its
    run-comparison report goes to the shared Prefect server) remembers what the run trained on; the next night
    with nothing changed since is nothing new."""
    from dataset.formats.parquet import ParquetDataset
    from dataset.tensors.spec import TransformSpec
    from pipeline_config import EvaluateConfig, PromoteConfig, TransformConfig
    from storage_io import StorageLayout
    from tasks.manifests import Evaluation
    from tasks.promote import promote_model
    from tests.support.registry import make_checkpoint, make_dataset
    from training.champion import unchanged
    from training.checkpoint.files import SEEDS_MODEL
    from training.manifests import CheckpointInfo, TrainedModel

    root = str(tmp_path / "root")
    setup = StorageLayout.create(root, "setup")
    old, new = make_dataset(setup, "mnist-old"), make_dataset(setup, "mnist-new")
    config = nightly(root)
    champion(setup, "champion-run", old, config)

    first = unchanged.compare(root, MODEL, new, True, config)
    assert not first.unchanged and first.reason == f"the data differs from {MODEL} v1's"  # new data: night 1 trains

    night = StorageLayout.create(root, "night-1")
    checkpoint = make_checkpoint(f"{night.run_dir}/checkpoint_000000")
    trained = TrainedModel(run_dir=night.run_dir, model=SEEDS_MODEL, best_checkpoint=checkpoint, best_val_accuracy=0.5,
                           checkpoints=[CheckpointInfo(path=checkpoint, epoch=0, val_accuracy=0.5)], history=[],
                           num_workers=1, cpus_per_worker=1.0)
    evaluation = Evaluation(checkpoint=checkpoint, accuracy=0.5, precision=[0.5] * 10, recall=[0.5] * 10,
                            confusion=[[1] * 10 for _ in range(10)], rows=100, metrics_path=f"{night.run_dir}/m.json",
                            predictions_path="p", passed_gate=False, min_accuracy=0.9)
    spec = TransformSpec.model_construct(dataset=ParquetDataset(directory=new, fingerprint="new", rows={}),
                                         config=TransformConfig(), checks={}, manifest="m")
    with using_api(shared_server.api):
        promotion = promote_model(evaluation, trained, spec, EvaluateConfig(), night, PromoteConfig(), config, None, MODEL)
    assert not promotion.promoted

    again = unchanged.compare(root, MODEL, new, True, config)  # night 2: nothing changed since night 1
    assert again.unchanged, again.reason
    assert again.reason.startswith("data, model and recipe are those of run night-1, trained last (not promoted: gate failed"), again.reason
    assert again.payload()["changed_since_champion"] is True and again.payload()["nothing_new"] is True
    assert not unchanged.compare(root, MODEL, new, True, nightly(root, train={"epochs": 5})).unchanged  # the recipe changed
    assert not unchanged.compare(root, MODEL, make_dataset(setup, "mnist-newer"), True, config).unchanged  # the data changed
    assert not unchanged.compare(root, MODEL, new, False, config).unchanged  # its dataset is gone
    assert unchanged.compare(root, MODEL, old, True, config).unchanged  # the champion's data: nothing new, as before
