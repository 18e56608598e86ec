"""Start-up rows: seconds from a run's start to its first optimizer step, stage by stage, and a small run's memory.

    python -m benchmarks.start.startup            # the CLI row, the memory row, the served row; JSON in benchmarks/results/startup.json
    python -m benchmarks.start.startup --quick    # one small run gives the CLI and memory rows; the served row on an empty root

Rows (`make bench` runs them too, through ``benchmarks.run``):

* *first step, CLI path*: a cold ``python -m flows.mnist`` (fresh ``HOME``, empty storage root, the
  bundled sample, the small CNN, 1 epoch, gate off) in a fresh process, from the command's start to
  the first optimizer step (``first_step_at`` in the run's ``history.jsonl``), split by what the
  terminal said and when (each line's arrival, stdout unbuffered): before the first stage (imports,
  checks, the temporary Prefect server and the local Ray, the flow run), each stage before training,
  the gaps between them (the driver's reports), the training worker group (train stage start ->
  the attempt's record in ``train_attempts.jsonl``), the first batch. Beside it, what importing the
  CLI's module costs by top-level package (``python -X importtime``);
* *first step, served path*: ``benchmarks.start.deployment_overhead`` against a Prefect server and a Ray
  cluster that are already up (what a served run meets), with each stage's seconds;
* *peak memory*: ``python -m flows.train`` on a folder of 2,000 28x28 PNGs (quick: 200), the small CNN,
  1 epoch: the peak of the PSS summed over the CLI process and every process below it (the Prefect
  server, Ray's GCS, raylet, dashboard and workers; ``benchmarks.data.pss.PssSampler``), how many
  processes there were, and where the memory sat at the peak by group (driver, Ray workers, Ray's
  own processes, the Prefect server).

Goals (issue 59, on a 2-core AMD EPYC Zen 3): first step within 30 s of a cold ``python -m flows.mnist``,
within 15 s of a served run's start with server and Ray up; a small run's peak within 3 GB PSS.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.data import pss, scale
from benchmarks.start import deployment_overhead

ROOT = Path(__file__).resolve().parents[2]  # the repository
HERE = Path(__file__).resolve().parents[1]  # benchmarks/
QUICK_MODEL = "training.model.catalog:small_cnn"
BEFORE_TRAINING = ("download", "to-parquet", "transform")
STAGE_LINE = re.compile(r"\[(\d+)/(\d+)\] ([a-z][a-z-]*) (\.\.\.|done in)")
MEMORY_IMAGES, QUICK_MEMORY_IMAGES, IMAGE_SIDE = 2_000, 200, 28


def stage_marks(lines: list[tuple[float, str]]) -> dict[str, dict[str, float]]:
    """``{stage: {"start": t, "end": t}}`` from (arrival time, terminal line) pairs: ``[1/7] download ...``
    starts a stage, ``[1/7] download done in 4.8s`` ends it. A stage said twice (a retry) keeps its first start."""
    marks: dict[str, dict[str, float]] = {}
    for at, line in lines:
        found = STAGE_LINE.search(line)
        if not found:
            continue
        stage, what = found.group(3), found.group(4)
        mark = marks.setdefault(stage, {})
        if what == "...":
            mark.setdefault("start", at)
        else:
            mark["end"] = at
    return marks


def first_step_parts(started: float, marks: dict[str, dict[str, float]], attempt_at: float, first_step_at: float) -> dict:
    """Seconds from ``started`` (the command's start) to ``first_step_at``, split: before the first stage, each
    stage before training, the gaps between stages, the training worker group, the first batch. The parts add up."""
    stages = [name for name in BEFORE_TRAINING if name in marks and "end" in marks[name]]
    first = marks[stages[0]]["start"] if stages else marks["train"]["start"]
    parts = {"before_first_stage_s": first - started}
    parts |= {f"{name}_s": marks[name]["end"] - marks[name]["start"] for name in stages}
    parts["between_stages_s"] = marks["train"]["start"] - first - sum(parts[f"{name}_s"] for name in stages)
    parts["worker_group_s"] = attempt_at - marks["train"]["start"]
    parts["first_batch_s"] = first_step_at - attempt_at
    return {"to_first_step_s": round(first_step_at - started, 2), "parts": {k: round(v, 2) for k, v in parts.items()}}


def parse_importtime(stderr: str) -> dict[str, float]:
    """``python -X importtime`` output -> seconds of each top-level package's import, largest first: the cumulative
    time on the line where the package was first imported (whatever imported it), so what it imports first counts in
    its figure too (prefect's includes pydantic's when prefect came first)."""
    tops: dict[str, float] = {}
    for line in stderr.splitlines():
        if not line.startswith("import time:") or line.count("|") != 2:
            continue
        _, cumulative, name = (part.strip() for part in line[len("import time:"):].split("|"))
        if cumulative.isdigit() and "." not in name and name not in tops:  # a package's first import, not the header
            tops[name] = int(cumulative) / 1e6
    return dict(sorted(((k, round(v, 3)) for k, v in tops.items()), key=lambda kv: -kv[1]))


def import_seconds(module: str, top: int = 8) -> dict:
    """What importing ``module`` costs in a fresh interpreter: wall seconds and the ``top`` packages' seconds."""
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=True)
    wall = time.perf_counter() - start
    packages = parse_importtime(run.stderr)
    return {"module": module, "wall_s": round(wall, 2), "packages_s": dict(list(packages.items())[:top])}


def group_of(kind: str) -> str:
    """A process kind (`benchmarks.data.pss.process_kind`) -> where its memory counts: driver, Ray workers,
    Ray's own processes, Prefect server, other."""
    if kind.startswith("driver"):
        return "driver"
    if kind.startswith("ray::"):
        return "Ray workers"
    if kind.startswith(("raylet", "ray ")):
        return "Ray's own (GCS, raylet, dashboard, agents)"
    if kind.startswith("prefect"):
        return "Prefect server"
    return "other"


def memory_groups(at_peak: dict[str, float], per_kind: dict[str, dict]) -> dict:
    """MB at the peak by `group_of` group, and the most processes each group had at once (summed over its kinds)."""
    groups: dict[str, dict] = {}
    for kind, mb in at_peak.items():
        group = groups.setdefault(group_of(kind), {"at_peak_mb": 0, "most_processes": 0})
        group["at_peak_mb"] += mb
    for kind, peaks in per_kind.items():
        group = groups.setdefault(group_of(kind), {"at_peak_mb": 0, "most_processes": 0})
        group["most_processes"] += peaks.get("most_processes", 0)
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]["at_peak_mb"]))


def cpu_seconds(stat: str) -> float:
    """User + system CPU seconds of a process from its ``/proc/<pid>/stat`` line (the command may hold spaces and parentheses)."""
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15 of stat


class RunSampler(pss.PssSampler):
    """`benchmarks.data.pss.PssSampler` that also keeps each process's CPU seconds as last seen, by kind: where the run's
    CPU time went (less disturbed than wall seconds on a shared machine)."""

    def __init__(self, root: int, poll_s: float = 0.25):
        super().__init__(root, poll_s)
        self.cpu: dict[int, tuple[str, float]] = {}
        self.torch: dict[int, str] = {}  # pid -> its kind when torch was seen loaded in it (libtorch mapped)

    def sample(self) -> None:
        super().sample()
        for pid in list(self.seen):
            try:
                seconds = cpu_seconds(Path(f"/proc/{pid}/stat").read_text())
                kind = pss.process_kind(pid, self.root)
                if pid not in self.torch and self.samples % 4 == 1 and "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text():
                    self.torch[pid] = kind
            except (OSError, ValueError):
                continue
            known = self.cpu.get(pid)
            if known is not None and kind in ("unknown", "gone"):  # an ending process (a zombie's command line is empty)
                kind = known[0]
            self.cpu[pid] = (kind, seconds)

    def result(self) -> dict:
        by_kind: dict[str, float] = {}
        for kind, seconds in self.cpu.values():
            by_kind[kind] = by_kind.get(kind, 0.0) + seconds
        cpu = dict(sorted(((k, round(v, 1)) for k, v in by_kind.items()), key=lambda kv: -kv[1]))
        with_torch: dict[str, int] = {}
        for kind in self.torch.values():
            with_torch[kind] = with_torch.get(kind, 0) + 1
        return super().result() | {"cpu_s": round(sum(by_kind.values()), 1), "cpu_s_by_kind": cpu, "processes_with_torch": with_torch}


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cli_run(work: Path, name: str, args: list[str]) -> dict:
    """``python <args>`` (a flow's CLI, ``--run-name name``) in a fresh process with its own HOME and storage root under
    ``work``: the first-step split, the stages' seconds and the memory of every process of the run."""
    home, storage = work / "home", work / "storage"
    home.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "RAY_ADDRESS"))}
    env |= {"HOME": str(home), "PYTHONUNBUFFERED": "1"}  # each terminal line arrives as it is said
    lines: list[tuple[float, str]] = []
    started = time.time()
    process = subprocess.Popen([sys.executable, *args, "--storage-root", str(storage), "--run-name", name], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def read() -> None:
        for line in process.stdout:
            lines.append((time.time(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    with RunSampler(process.pid) as memory:
        reader.start()
        code = process.wait()
    reader.join(10)
    wall = time.time() - started
    if code != 0:
        raise RuntimeError(f"{' '.join(args)} failed (exit {code}):\n" + "\n".join(line for _, line in lines[-40:]))
    run_dir = storage / "runs" / name
    summary = json.loads((run_dir / "summary.json").read_text())
    attempt_at = _read_jsonl(run_dir / "train_attempts.jsonl")[0]["time"]
    first_step_at = _read_jsonl(run_dir / "history.jsonl")[0]["first_step_at"]
    return {**first_step_parts(started, stage_marks(lines), attempt_at, first_step_at), "wall_s": round(wall, 1),
            "stages_s": {stage: info["seconds"] for stage, info in summary["stages"].items()},
            "data_reused": bool(summary["data"].get("download_skipped") and summary["data"].get("conversion_skipped")),
            "memory": memory.result()}


def measure_cli(work: Path, model: str = QUICK_MODEL) -> dict:
    """The CLI row: a cold ``python -m flows.mnist`` on the bundled sample, 1 epoch, to its first optimizer step."""
    args = ["-m", "flows.mnist", "--download.source", "sample", "--model.name", model, "--train.epochs", "1",
            "--evaluate.min-accuracy", "0"]
    run = cli_run(work / "cli", "startup-cli", args)
    return {"benchmark": "first step, CLI path (cold python -m flows.mnist)", "model": model, **run,
            "imports": import_seconds("flows.mnist"), "goal": "<= 30 s"}


def measure_memory(work: Path, images: int = MEMORY_IMAGES, model: str = QUICK_MODEL) -> dict:
    """The memory row: ``python -m flows.train`` on a folder of ``images`` PNGs, 1 epoch: peak PSS of all its processes."""
    folder = scale.make_folder(work / f"folder-{images}", images, side=IMAGE_SIDE)
    args = ["-m", "flows.train", "--download.source", "folder", "--download.path", str(folder), "--workload", "startup",
            "--model.name", model, "--train.epochs", "1", "--train.num-workers", "1", "--evaluate.min-accuracy", "0"]
    run = cli_run(work / "memory", "startup-memory", args)
    memory = run.pop("memory")
    return {"benchmark": "peak memory, small run (python -m flows.train)", "images": images, "side": IMAGE_SIDE, "model": model,
            "peak_pss_mb": memory["peak_pss_mb"], "peak_at_s": memory["peak_at_s"], "at_peak_mb": memory["at_peak_mb"],
            "groups": memory_groups(memory["at_peak_mb"], memory["per_kind"]), "per_kind": memory["per_kind"],
            "most_processes": sum(kind["most_processes"] for kind in memory["per_kind"].values()),
            "to_first_step_s": run["to_first_step_s"], "first_step_parts": run["parts"], "stages_s": run["stages_s"],
            "wall_s": run["wall_s"], "cpu_s": memory["cpu_s"], "cpu_s_by_kind": memory["cpu_s_by_kind"],
            "processes_with_torch": memory["processes_with_torch"], "goal": "<= 3,000 MB PSS"}


def measure_served(reused_runs: int = 3) -> dict:
    """The served row: flow run start to first step with a Prefect server and a Ray cluster already up."""
    row = deployment_overhead.measure(reused_runs=reused_runs, ray_cluster=True)
    return row | {"benchmark": "first step, served path (Prefect server and Ray cluster up)", "goal": "<= 15 s"}


def rows(work: Path, quick: bool = False) -> list[dict]:
    """The start-up rows (`benchmarks.run` calls this). Quick: one small folder run stands in for the CLI row too."""
    if quick:
        memory = measure_memory(work, QUICK_MEMORY_IMAGES)
        cli = {"benchmark": "first step, CLI path (quick: the memory row's python -m flows.train)", "to_first_step_s": memory["to_first_step_s"],
               "parts": memory["first_step_parts"], "stages_s": memory["stages_s"], "imports": import_seconds("flows.train"), "goal": "<= 30 s"}
        return [cli, memory]
    return [measure_cli(work), measure_memory(work), measure_served()]


def _seconds(parts: dict[str, float]) -> str:
    return ", ".join(f"{k[:-2].replace('_', ' ')} {v} s" for k, v in parts.items())


def format_row(r: dict) -> str:
    """One markdown table row (benchmark | size | baseline | ours | ratio | goal) for a start-up row."""
    if r["benchmark"].startswith("peak memory"):
        groups = ", ".join(f"{g} {v['at_peak_mb']:,} MB ({v['most_processes']} process(es) at most)" for g, v in r["groups"].items())
        return (f"| {r['benchmark']} | {r['images']:,} images {r['side']}x{r['side']}, 1 epoch | | {r['peak_pss_mb']:,} MB PSS at "
                f"{r['peak_at_s']} s ({groups}; {r['most_processes']} processes at most) | | {r['goal']} |")
    if r["benchmark"].startswith("first step, served"):
        stages = ", ".join(f"{k} {v} s" for k, v in r["first_run"]["stages_s"].items() if k in BEFORE_TRAINING)
        runs = f"median of {r['reused_runs']} run(s) reusing the data" if r["reused_runs"] else "one run on an empty root"
        return (f"| {r['benchmark']} | sample, 1 epoch, {runs} | | {r['to_first_step_s']} s ({_seconds(r['parts'])}; first run's "
                f"stages: {stages}) | | {r['goal']} |")
    imports = ", ".join(f"{k} {v} s" for k, v in r["imports"]["packages_s"].items())
    return (f"| {r['benchmark']} | 1 epoch | | {r['to_first_step_s']} s ({_seconds(r['parts'])}); importing "
            f"{r['imports']['module']}: {r['imports']['wall_s']} s ({imports}) | | {r['goal']} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small run for the CLI and memory rows, no served row")
    parser.add_argument("--only", choices=("cli", "memory", "served"), help="one row only")
    parser.add_argument("--out", default=str(HERE / "results" / "startup.json"), help="where to write the JSON")
    args = parser.parse_args(argv)
    from reporting import environment

    with tempfile.TemporaryDirectory(prefix="mnist-startup-", dir="/tmp") as tmp:
        work = Path(tmp)
        if args.only:
            out = [{"cli": measure_cli, "memory": measure_memory, "served": lambda _: measure_served()}[args.only](work)]
        else:
            out = rows(work, args.quick)
    result = {"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "environment": environment.describe(),
              "load_avg_1m_at_end": round(os.getloadavg()[0], 2), "rows": out}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(format_row(r) for r in out))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
