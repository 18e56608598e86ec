"""The captured training step (issue 71), checked on a CPU: its eager form trains the same weights as the
eager step, bit for bit, reads nothing back from the device per step, and is chosen where a graph can hold it.

No GPU here: `training.worker.captured_step.CapturedStep` with ``capture=False`` runs the very code a CUDA graph
captures (learning rate and decay read from device tables by device counters, fixed gradient tensors, the
capturable AdamW's tensor learning rate), so what it computes is checked here; the replay itself needs a GPU
(`benchmarks.speed.gpu_step` measures it there, docs/performance.md).
"""

from __future__ import annotations

import pytest
import torch

from pipeline_config import TrainConfig
from tests.support.shards import Rows
from training.manifests import LoopConfig
from training.model.catalog import ModelSpec
from training.trainer import loop_config
from training.worker.captured_step import CapturedStep, use_captured_step
from training.worker.guard import preemption_cadence
from training.worker.loop import attach_step, start_attempt, train_epoch

RESNET = ModelSpec(name="resnet18", in_channels=1, num_classes=10)


def _attempt(cuda_graph: str, rows: int, batch: int = 8, ema_decay: float = 0.9, epochs: int = 3):
    cfg = TrainConfig(global_batch_size=batch, cuda_graph=cuda_graph, ema_decay=ema_decay, epochs=epochs)
    loop = LoopConfig.model_validate(loop_config(cfg, rows, torch.get_num_threads(), RESNET))
    attempt = start_attempt(loop, 1, torch.device("cpu"), prepare=lambda model: model)
    attach_step(attempt, 1)
    return attempt


@pytest.mark.parametrize("ema_decay", [0.9, 0.0])
def test_the_captured_steps_eager_form_trains_the_eager_steps_weights(ema_decay):
    """Two epochs of 44 rows at batch 8 (five full steps and a short one each): the same weights, moving average
    (BatchNorm's counters included), AdamW state, learning rates and epoch totals as `training.worker.loop.train_step`, bit for
    bit (with a float32 learning rate on the CPU they drifted 3e-5 apart in two steps: Adam magnifies early differences)."""
    eager, captured = (_attempt(choice, 44, ema_decay=ema_decay, epochs=2) for choice in ("off", "on"))
    assert eager.captured is None and isinstance(captured.captured, CapturedStep) and not captured.captured.capture
    for epoch in range(2):
        ours, theirs = train_epoch(captured, Rows(44, seed=epoch), epoch), train_epoch(eager, Rows(44, seed=epoch), epoch)
        for key in ("train_loss", "train_accuracy", "lr"):
            assert ours[key] == theirs[key], (epoch, key)
    for (name, a), b in zip(captured.model.state_dict().items(), eager.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    if ema_decay:
        assert captured.plan.ema_decay > 0  # the run's 12 steps leave the average on (at a low decay)
        assert int(captured.ema.n_averaged) == int(eager.ema.n_averaged) == 12
        for (name, a), b in zip(captured.ema.module.state_dict().items(), eager.ema.module.state_dict().values(), strict=True):
            assert torch.equal(a, b), name
    else:
        assert captured.ema is None and eager.ema is None
    ours_state, theirs_state = captured.optimizer.state_dict()["state"], eager.optimizer.state_dict()["state"]
    for index, state in theirs_state.items():
        assert float(ours_state[index]["step"]) == float(state["step"]) == 12
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours_state[index][key], state[key]), (index, key)


def test_the_learning_rate_and_decay_come_from_the_device_tables_at_the_runs_step():
    """A resumed epoch starts its learning rate at the run's step, as the eager step's ``Plan.lr`` does."""
    attempt = _attempt("on", 64)
    step = attempt.captured
    plan = attempt.plan
    step.begin_epoch(2 * attempt.steps_per_epoch + 3)  # epoch 2, resumed after 3 steps
    rows = Rows(8)
    batch = next(rows.iter_torch_batches(batch_size=8, device=torch.device("cpu")))
    step(batch["image"], batch["label"])
    assert float(step.lr) == pytest.approx(plan.lr(2 * attempt.steps_per_epoch + 3), rel=1e-6)
    assert int(step.step_no) == 2 * attempt.steps_per_epoch + 4


def test_an_epoch_of_captured_steps_reads_from_the_device_once(host_reads):
    """Nothing in a step reads a value back: the epoch's totals are read once at its end (and the average's count
    once an attempt, a CPU buffer). On a GPU each read would wait for the device."""
    reads = []
    for steps in (2, 6):
        attempt = _attempt("on", 8 * steps)
        host_reads.clear()
        train_epoch(attempt, Rows(8 * steps), epoch=0)
        reads.append(dict(host_reads))
    assert reads[0] == reads[1] == {"tolist": 1}


@pytest.mark.parametrize(
    ("choice", "device", "world", "precision", "expected"),
    [
        ("auto", "cuda", 1, "bf16", True),  # the default on one GPU
        ("auto", "cuda", 1, "fp32", True),
        ("auto", "cuda", 1, "fp16", False),  # the gradient scaler reads its inf check: eager
        ("auto", "cuda", 2, "bf16", False),  # DDP's all-reduce or FSDP's shards: eager
        ("auto", "cpu", 1, "fp32", False),  # a CPU gains nothing from a graph
        ("on", "cpu", 1, "fp32", True),  # its eager form, as these tests run it
        ("off", "cuda", 1, "bf16", False),
    ],
)
def test_the_captured_step_runs_where_a_graph_can_hold_the_step(choice, device, world, precision, expected):
    assert use_captured_step(choice, torch.device(device), world, precision) is expected


def test_the_preemption_check_runs_seconds_apart_at_the_same_steps_on_every_rank():
    assert preemption_cadence(10, 5.0, 0.5) == 10  # slow steps: never less often than every_steps
    assert preemption_cadence(10, 5.0, 0.0015) == 3334  # a captured GPU step: about 5 s apart
    assert preemption_cadence(10, 0.0, 0.0015) == 10  # preemption_check_s 0: steps alone
    assert preemption_cadence(0, 5.0, 0.0015) == 0  # never asked


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replaying a CUDA graph needs a GPU: run on the device check")
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_on_a_gpu_replayed_graphs_train_the_weights_their_eager_form_trains(precision):
    """The captured step replayed (full batches, and the short tail once it has its own graph) against the same code
    run eagerly on the GPU, deterministic kernels on both: the same learning rates, weights, average and totals."""
    torch.backends.cudnn.deterministic = True
    cuda = torch.device("cuda")
    sizes = [16] * 5 + [5] + [16] * 2 + [5] + [16] + [5] + [16] + [5]  # the tail's third and fourth are replays
    attempts = []
    for capture in (False, True):
        cfg = TrainConfig(global_batch_size=16, cuda_graph="on", ema_decay=0.9, precision=precision, epochs=1)
        loop = LoopConfig.model_validate(loop_config(cfg, 16 * 40, 2, RESNET))
        attempt = start_attempt(loop, 1, cuda, prepare=lambda model: model.to(cuda))
        attempt.captured = CapturedStep(attempt, capture=capture)
        attempt.captured.begin_epoch(0)
        generator = torch.Generator().manual_seed(7)
        for size in sizes:
            images = torch.randn(size, 1, 28, 28, generator=generator).to(cuda)
            labels = torch.randint(0, 10, (size,), generator=generator).to(cuda)
            attempt.captured(images, labels)
        torch.cuda.synchronize()
        attempts.append(attempt)
    eager, replayed = attempts
    assert sorted(replayed.captured.graphs) == [5, 16] and not eager.captured.graphs
    assert int(replayed.captured.step_no) == int(eager.captured.step_no) == len(sizes)
    assert float(replayed.captured.lr) == float(eager.captured.lr)
    worst = 0.0
    for ours, theirs in ((replayed.model, eager.model), (replayed.ema.module, eager.ema.module)):
        for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values(), strict=True):
            worst = max(worst, (a.double() - b.double()).abs().max().item())
            assert torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-5), name
    for a, b in zip(replayed.captured.totals(), eager.captured.totals(), strict=True):
        assert torch.allclose(a.double(), b.double(), rtol=1e-5), (a, b)
    print(f"[captured vs eager on {torch.cuda.get_device_name(0)}, {precision}] largest weight difference {worst:.3g}")
