"""The GPU path, checked on a CPU (issue 46): the resource plan for 0, 1, 2 and 8 GPUs, a refusal the
cluster cannot hold (exit 2, no resume line), a training step that never waits for the device, the
precision (bf16 autocast runs on a CPU too) and where it is recorded, and the device choices.

No GPU here: the plans take the cluster's counts as numbers, the device choices are pure functions,
and the host reads a GPU step would wait on are counted on the CPU, where they are the same calls.
"""

from __future__ import annotations

import copy

import pytest
import torch
from prefect.states import Failed
from torch.optim.swa_utils import AveragedModel

from pipeline_config import TrainConfig, TuneConfig
from pipeline_config.settings import TrainSettings
from runner import stopping
from runner.harness import checked_settings, close_cli
from runner.summary import outcome_of
from storage_io import read_lines
from tests.support.shards import Rows
from training.checkpoint.files import EXTRA_STATE_FILE
from training.checkpoint.in_attempt import checkpoint_extra, load_checkpoint
from training.checkpoint.model_files import load_state, save_checkpoint_files
from training.checkpoint.records import record_attempt
from training.inference import actor_gpus
from training.manifests import LoopConfig, Position
from training.model.catalog import ModelSpec
from training.resources import GPU_WORKER_CPUS, DoesNotFit, plan_cluster
from training.trainer import last_compute, loop_config
from training.trial_configs import plan_trials
from training.worker.device import autocast, pick_device, resolve_precision
from training.worker.loop import start_attempt, train_epoch, validate
from training.worker.recipe import ema_decay_at, make_ema

SMALL = ModelSpec(name="training.model.catalog:small_cnn", in_channels=1, num_classes=10)


# The resource plan: (cluster CPUs, GPUs, train.num_workers) -> (GPU?, workers, CPUs a worker, torch threads).
@pytest.mark.parametrize(
    ("cpus", "gpus", "asked", "expected"),
    [
        (2, 0, 2, (False, 2, 0.5, 1)),  # the smoke preset on 2 CPUs: as before
        (16, 0, 1, (False, 1, 15.0, 16)),  # CPUs only: one worker uses every core
        (16, 1, 1, (True, 1, 2.0, 2)),  # one GPU: the worker takes 2 CPUs, Ray Data the other 14 (was 15 and 16 threads)
        (2, 1, 1, (True, 1, 1.0, 2)),  # a small GPU machine: the worker leaves data_cpus free
        (16, 2, 2, (True, 2, 2.0, 2)),
        (16, 8, 8, (True, 8, 1.875, 2)),  # 8 GPUs on 16 CPUs: 15 CPUs shared, at most 2 each
        (64, 8, 2, (True, 2, 2.0, 2)),  # fewer workers than GPUs: as asked
    ],
)
def test_the_plan_for_0_1_2_and_8_gpus(cpus, gpus, asked, expected):
    plan = plan_cluster(TrainConfig(num_workers=asked), cpus, gpus)
    assert (plan.use_gpu, plan.workers, plan.cpus_per_worker, plan.threads) == expected
    assert plan.note is None
    assert plan.cpus_per_worker * plan.workers <= cpus - 1  # train.data_cpus stay free for Ray Data


def test_auto_with_fewer_gpus_than_workers_trains_one_worker_a_gpu_and_says_so_in_one_line():
    smoke = TrainConfig(num_workers=2)  # --preset smoke on a one-GPU machine stopped before any stage
    plan = plan_cluster(smoke, 16, 1)
    assert (plan.use_gpu, plan.workers, plan.cpus_per_worker, plan.threads) == (True, 1, 2.0, GPU_WORKER_CPUS)
    assert plan.note == (
        "train.use_gpu=auto: 1 GPU for train.num_workers=2, so 1 worker trains, one a GPU "
        "(train.use_gpu=never trains 2 on CPUs)"
    )
    assert plan.config_for(smoke).num_workers == 1 and plan.config_for(smoke).min_workers is None
    assert plan_cluster(TrainConfig(num_workers=8), 16, 2).note.startswith("train.use_gpu=auto: 2 GPUs for train.num_workers=8, so 2 workers")
    elastic = TrainConfig(num_workers=4, min_workers=3)
    assert plan_cluster(elastic, 16, 2).config_for(elastic).model_dump(include={"num_workers", "min_workers"}) == {
        "num_workers": 2, "min_workers": 2,
    }
    never = plan_cluster(TrainConfig(num_workers=2, use_gpu="never"), 16, 8)  # GPUs there, CPUs asked for
    assert (never.use_gpu, never.workers, never.cpus_per_worker, never.threads, never.note) == (False, 2, 7.5, 8, None)


@pytest.mark.parametrize(
    ("cfg", "cpus", "gpus", "names"),
    [
        (TrainConfig(num_workers=2, use_gpu="always"), 16, 1, "train.num_workers=2 needs 2 GPUs with train.use_gpu=always"),
        (TrainConfig(use_gpu="always"), 16, 0, "train.num_workers=1 needs 1 GPUs with train.use_gpu=always; the cluster has 0"),
        (TrainConfig(strategy="fsdp", ema_decay=0), 16, 0, "train.strategy=fsdp needs GPUs"),
        (TrainConfig(num_workers=2), 1, 0, "too few for train.num_workers=2 plus train.data_cpus=1"),
    ],
)
def test_what_the_cluster_cannot_hold_is_refused_naming_the_field(cfg, cpus, gpus, names):
    with pytest.raises(DoesNotFit, match=names):
        plan_cluster(cfg, cpus, gpus)


def test_a_refusal_found_once_ray_is_up_exits_2_without_a_resume_line(tmp_path, capsys):
    """What the flow's pre-flight check raises reaches the CLI through the flow's failed state."""
    settings, config, _ = checked_settings(["--storage-root", str(tmp_path), "--train.use-gpu", "always"], TrainSettings)
    try:
        plan_cluster(config.train, 16, 0)
    except DoesNotFit as exc:
        summary, failed = outcome_of(Failed(data=exc))  # the flow failed before any stage: no summary
    code = close_cli(summary, failed, config, settings, None, stopping.StopRequest(), 3.0, [], "flows.train")
    out = capsys.readouterr()
    assert code == 2
    assert out.err.startswith("invalid configuration:\ntrain.num_workers=1 needs 1 GPUs with train.use_gpu=always")
    assert "resume" not in out.err + out.out and "FAILED" not in out.err + out.out


def test_a_search_on_one_gpu_runs_the_trials_one_gpu_holds():
    plan = plan_trials(TrainConfig(num_workers=1), TuneConfig(), cluster_cpus=16, cluster_gpus=1)
    assert (plan.concurrent, plan.use_gpu, plan.cpus_per_worker, plan.torch_threads) == (1, True, 2.0, 2)
    assert plan_trials(TrainConfig(num_workers=1), TuneConfig(), 16, 8).concurrent == 8
    assert plan_trials(TrainConfig(num_workers=1), TuneConfig(), 16, 0).concurrent == 14  # CPUs only: as before
    with pytest.raises(DoesNotFit, match="2 trial.s. of train.num_workers=1 need 2 GPUs; the cluster has 1"):
        plan_trials(TrainConfig(num_workers=1), TuneConfig(max_concurrent_trials=2), 16, 1)


# A step that never waits for the device (`host_reads`, tests/conftest.py, counts what would wait for it).
def _attempt(precision: str = "auto", rows: int = 64, batch: int = 8):
    cfg = TrainConfig(global_batch_size=batch, precision=precision)
    loop = LoopConfig.model_validate(loop_config(cfg, rows, torch.get_num_threads(), SMALL))  # keep the process's threads
    return start_attempt(loop, 1, torch.device("cpu"), prepare=lambda model: model)


def test_an_epoch_reads_from_the_device_once_whatever_its_steps(host_reads):
    """Loss and correct predictions add up on the device; the epoch's totals and validation's are read once each."""
    reads = []
    for steps in (1, 6):
        attempt = _attempt(rows=8 * steps)
        first = copy.deepcopy(attempt.model).train()  # the weights the first step's loss is taken with
        batch = next(Rows(8).iter_torch_batches(batch_size=8, device=torch.device("cpu")))
        with torch.no_grad():
            logits = first(batch["image"])
            loss, correct = attempt.criterion(logits, batch["label"]), (logits.argmax(1) == batch["label"]).sum()
        host_reads.clear()
        metrics = train_epoch(attempt, Rows(8 * steps), epoch=0)
        metrics |= validate(attempt, Rows(24, seed=1))
        reads.append(dict(host_reads))
        if steps == 1:  # the totals are the step's, as when each was read at once
            assert metrics["train_loss"] == pytest.approx(loss.item(), rel=1e-6)
            assert metrics["train_accuracy"] == correct.item() / 8
        assert metrics["images_per_s"] > 0 and 0 < metrics["train_loss"] < 10 and 0 <= metrics["val_accuracy"] <= 1
    # One read of the epoch's totals and one of validation's; the weight average's count (a CPU buffer) once an attempt.
    assert reads[0] == reads[1] == {"tolist": 2, "__int__": 1}


def test_the_weight_average_reads_its_count_once_and_is_averagedmodels(host_reads):
    """Bit for bit what AveragedModel with the recipe's decay gave, a restore included (n_averaged is the count),
    reading the count once a build, not once a step."""
    torch.manual_seed(0)
    model = ModelSpec(name="resnet18", in_channels=1, num_classes=10).build()
    ours = make_ema(model, 0.9)

    def average(averaged, current, updates):  # the recipe's multi_avg_fn before (one int(updates) a step)
        d = ema_decay_at(0.9, int(updates))
        if torch.is_floating_point(averaged[0]):
            torch._foreach_lerp_(averaged, current, 1.0 - d)
        else:
            for a, c in zip(averaged, current, strict=True):
                a.copy_(a * d + c * (1.0 - d))

    theirs = AveragedModel(model, multi_avg_fn=average, use_buffers=True)
    reads = 0
    for step in range(6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
            model.bn1.running_mean.add_(1.0)
            model.bn1.num_batches_tracked.add_(3)
        host_reads.clear()
        ours.update_parameters(model)
        reads += sum(host_reads.values())
        theirs.update_parameters(model)
        if step == 2:  # a restore: load_checkpoint sets the count on a fresh average
            restored = make_ema(model, 0.9)
            restored.module.load_state_dict(ours.module.state_dict())
            restored.n_averaged.fill_(int(ours.n_averaged))
            ours = restored
    assert reads == 2  # the count, once after the build and once after the restore
    assert int(ours.n_averaged) == int(theirs.n_averaged) == 6
    for (name, a), b in zip(ours.module.state_dict().items(), theirs.module.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


# Precision: train.precision, resolved per device and recorded.
def test_precision_auto_is_fp32_on_a_cpu_and_bf16_on_a_gpu_that_has_it():
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert resolve_precision("auto", torch.device("cuda", 0), bf16_supported=True) == "bf16"
    assert resolve_precision("auto", torch.device("cuda", 0), bf16_supported=False) == "fp32"
    assert resolve_precision("fp16", torch.device("cpu")) == "fp16"
    assert TrainConfig().precision == "auto" and _attempt().precision == "fp32" and _attempt().scaler is None


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)])
def test_a_step_runs_in_the_precision_asked_and_the_checkpoint_records_it(tmp_path, precision, dtype):
    attempt = _attempt(precision, rows=8)
    assert attempt.precision == precision and (attempt.scaler is not None) == (precision == "fp16")
    seen = []
    attempt.model.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    before = [p.detach().clone() for p in attempt.model.parameters()]
    metrics = train_epoch(attempt, Rows(8), epoch=0)
    assert seen == [dtype]  # the logits of the one step, under autocast
    assert all(p.dtype == torch.float32 for p in attempt.model.parameters())  # the weights stay fp32
    assert any(not torch.equal(a, b) for a, b in zip(before, attempt.model.parameters()))  # the step was taken
    extra = checkpoint_extra(metrics, attempt.model, 0, attempt.ema, model_spec=attempt.cfg.model, precision=attempt.precision)
    save_checkpoint_files(tmp_path, attempt.weights(), attempt.optimizer, extra)
    assert load_state(tmp_path, EXTRA_STATE_FILE)["precision"] == precision
    if precision == "fp16":  # the gradient scaler's state goes with it, and comes back on resume
        attempt.scaler.update(new_scale=1024.0)
        extra = checkpoint_extra(metrics, attempt.model, 0, attempt.ema, model_spec=attempt.cfg.model, precision=precision,
                                 scaler=attempt.scaler)
        save_checkpoint_files(tmp_path, attempt.weights(), attempt.optimizer, extra)
        resumed = _attempt(precision, rows=8)
        assert resumed.scaler.get_scale() != 1024.0
        load_checkpoint(tmp_path, resumed.model, resumed.optimizer, resumed.ema, resumed.scaler)
        assert resumed.scaler.get_scale() == 1024.0
        assert resumed.scaler.state_dict() == attempt.scaler.state_dict()
    else:
        assert "grad_scaler" not in load_state(tmp_path, EXTRA_STATE_FILE)
    record_attempt(str(tmp_path / "train_attempts.jsonl"), Position(), 1, device="cpu", precision=attempt.precision)
    assert last_compute(read_lines(str(tmp_path / "train_attempts.jsonl"))) == {"device": "cpu", "precision": precision}
    assert last_compute([{"start_epoch": 0}]) == {}  # an attempt recorded before either was


def test_fp32_adds_no_autocast():
    with autocast("fp32", torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
    with autocast("bf16", torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu")


# Where single mode, evaluation and predict run.
def test_the_device_is_the_first_gpu_when_there_is_one():
    assert pick_device("auto", 0) == torch.device("cpu")
    assert pick_device("auto", 1) == pick_device("always", 8) == torch.device("cuda", 0)
    assert pick_device("never", 8) == torch.device("cpu")
    with pytest.raises(ValueError, match="train.use_gpu=always: this process sees no GPU"):
        pick_device("always", 0)


def test_model_actors_share_the_gpus():
    assert actor_gpus(0, 2) == 0.0
    assert actor_gpus(1, 2) == 0.5  # both actors on the one GPU
    assert actor_gpus(1, 3) == 0.333
    assert actor_gpus(8, 2) == 1.0
    assert actor_gpus(0.5, 1) == 0.0  # no whole GPU


# The host's work per step: on a GPU it, not the arithmetic, sets a small model's pace (docs/performance.md, "On a GPU").
class CountedRows(Rows):
    """`Rows` that records the batch size each ``iter_torch_batches`` call asked for."""

    asked: list[int]

    def iter_torch_batches(self, *, batch_size: int, device: torch.device, pin_memory: bool = False):
        self.asked = [*getattr(self, "asked", []), batch_size]
        return super().iter_torch_batches(batch_size=batch_size, device=device, pin_memory=pin_memory)


def _row_ids(batches) -> list[list[int]]:
    return [batch["row_id"].tolist() for batch in batches]


def test_the_loop_takes_whole_steps_from_ray_data_and_cuts_them_in_the_same_order():
    """Fewer, larger batches from Ray Data (each costs the host about 2 ms on a GPU), the steps exactly as before."""
    from training.worker.feeding import FEED_BYTES, FEED_ROWS, batches, feed_rows

    assert feed_rows(64, (1, 28, 28)) == 512 and feed_rows(512, (1, 28, 28)) == 512 and feed_rows(1000, None) == 1000
    assert feed_rows(64, (3, 224, 224)) == 64  # 38 MB of images a step already: one step at a time
    assert feed_rows(64, (3, 128, 128)) * 3 * 128 * 128 * 4 <= FEED_BYTES and FEED_ROWS == 512
    attempt = _attempt(rows=1000, batch=64)
    shard = CountedRows(1000)
    steps = _row_ids(batches(attempt, shard))
    assert shard.asked == [512]
    assert steps == _row_ids(Rows(1000).iter_torch_batches(batch_size=64, device=torch.device("cpu")))
    assert [len(s) for s in steps] == [64] * 15 + [40]


@pytest.mark.parametrize("rows", [9, 65, 1])
def test_a_last_batch_of_one_image_joins_the_step_before_and_every_row_trains_once(rows):
    """ResNet-18 on 28x28 ends in a 1x1 block: a training step of one image fails in BatchNorm ("Expected more than
    1 value per channel"). The loop folds such a tail into the step before (alone in its epoch, it is left out);
    validation, in eval mode, scores every row."""
    from training.worker.feeding import batches

    cfg = TrainConfig(global_batch_size=8)
    resnet = ModelSpec(name="resnet18", in_channels=1, num_classes=10)
    attempt = start_attempt(LoopConfig.model_validate(loop_config(cfg, rows, 1, resnet)), 1, torch.device("cpu"),
                            prepare=lambda model: model)
    trained = _row_ids(batches(attempt, Rows(rows), training=True))
    expected = [] if rows == 1 else [list(range(rows))[i:i + 8] for i in range(0, rows - 1, 8)]
    if expected:
        expected[-1].append(rows - 1)  # the one-image tail joined the last full step
    assert trained == expected
    metrics = train_epoch(attempt, Rows(rows), epoch=0)
    assert metrics["train_accuracy"] >= 0 and (metrics["images_per_s"] > 0) == (rows > 1)
    scored = validate(attempt, Rows(rows, seed=1))
    assert 0 <= scored["val_accuracy"] <= 1
    assert _row_ids(batches(attempt, Rows(rows))) == [list(range(rows))[i:i + 8] for i in range(0, rows, 8)]


def test_the_weight_average_updates_with_the_same_few_operations_whatever_the_depth():
    """One update is a handful of grouped (``_foreach``) calls from Python: ResNet-50 costs the host what ResNet-18
    does. (Counted as calls into torch's Python API; on a CPU a ``_foreach`` op loops over its tensors in C++, on a
    GPU it launches a few fused kernels.)"""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    calls = {}
    for name in ("resnet18", "resnet50"):
        model = ModelSpec(name=name, in_channels=1, num_classes=10).build()
        ema = make_ema(model, 0.9)
        ema.update_parameters(model)  # the first update copies
        with Count() as count:
            ema.update_parameters(model)
        calls[name] = count.calls
    assert calls["resnet18"] == calls["resnet50"] <= 8, calls
