"""The benchmark rows as the Markdown table docs/performance.md and the README show: each figure beside its baseline, a
row that could not be measured saying why."""

from __future__ import annotations


def _served(r: dict, batch: str) -> str:
    """The served champion's figures at one batch size: sequential latency, then the concurrent clients' throughput."""
    seq, conc = r["served"][batch]["sequential"], r["served"][batch]["concurrent"]
    return (f"{batch.replace('_', ' ')}: p50 {seq['p50_ms']} ms, p99 {seq['p99_ms']} ms; {conc['clients']} clients "
            f"{conc['requests_per_s']} req/s ({conc['images_per_s']} img/s)")


def format_table(rows: list[dict]) -> str:
    lines = ["| benchmark | size | baseline | ours | ratio | goal |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["benchmark"] == "data path":
            lines.append(f"| data path | {r['rows']:,} rows | {r['baseline_s']} s ({r['baseline_rows_per_s']:,} rows/s) | "
                         f"{r['ours_s']} s ({r['ours_rows_per_s']:,} rows/s) | {r['speedup']}x faster | {r['goal']} |")
        elif r["benchmark"] == "conversion peak RSS":
            lines.append(f"| conversion peak RSS | {r['rows']:,} rows | | {r['peak_rss_mb']} MB, {r['rows_per_s']:,} rows/s | | {r['goal']} |")
        elif r["benchmark"] == "fixed overhead":
            parts = ", ".join(f"{k[:-2].replace('_', ' ')} {v} s" for k, v in r.items() if k.endswith("_s") and k != "total_s")
            group = ", ".join(f"{k[:-2].replace('_', ' ')} {v} s" for k, v in (r.get("worker_group_parts") or {}).items())
            lines.append(f"| fixed overhead | | | {r['total_s']} s ({parts}; worker group: {group}) | | {r['goal']} |")
        elif r["benchmark"].startswith("deployment path"):
            parts = ", ".join(f"{k[:-2].replace('_', ' ')} {v} s" for k, v in r["parts"].items())
            up = "server and Ray cluster" if r.get("ray_cluster") else "server"
            runs = f"median of {r['reused_runs']} run(s) reusing the data" if r["reused_runs"] else "one run on an empty root"
            first = f"; first run, empty root: {r['first_run']['to_first_step_s']} s" if r["reused_runs"] else ""
            lines.append(f"| deployment path: flow run start to first training step ({up} already up) | "
                         f"sample, 1 epoch, {runs} | | {r['to_first_step_s']} s ({parts}{first}) | | {r['goal']} |")
        elif r["benchmark"] == "training throughput (2 workers x 1 thread, DDP, global batch 128)":
            lines.append(f"| {r['benchmark']} | {r['train_rows']:,} training rows (sample), {r['epochs']} epoch(s), "
                         f"{r['workers']} workers | {r['baseline_images_per_s']} img/s (plain DDP) | {r['ours_images_per_s']} img/s | "
                         f"{r['ratio']}x ({r['ratio_to_plain_loop']}x of the plain loop's {r['plain_loop_images_per_s']} img/s) | "
                         f"{r['goal']} |")
        elif r["benchmark"] == "training throughput at full size (1 worker x 2 threads, batch 128)":
            lines.append(f"| {r['benchmark']} | {r['train_rows']:,} training rows (full-size mirror), {r['epochs']} epoch(s), "
                         f"{r['workers']} worker x {r['threads']} threads | {r['baseline_images_per_s']} img/s | "
                         f"{r['ours_images_per_s']} img/s | {r['ratio']}x | {r['goal']} |")
        elif r["benchmark"] == "full-size default flow, by stage":
            order = ["download", "to-parquet", "transform", "train", "evaluate", "promote", "cleanup"]
            stages = sorted(r["stages_s"].items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order))
            split = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in stages)
            epochs = ", ".join(f"{e} s" for e in r["epoch_s"])
            lines.append(f"| full-size default flow, by stage (`python -m flows.mnist`) | {r['rows']['train']:,} train / "
                         f"{r['rows']['val']:,} val / {r['rows']['test']:,} test rows (full-size mirror), {r['epochs']} epoch(s), "
                         f"{r['workers']} worker(s) | | {r['wall_s']} s wall ({split}; outside the stages "
                         f"{r['outside_stages_s']} s; epoch {epochs}); peak RSS driver "
                         f"{r['peak_rss_mb']['driver']:,} MB, Ray Train worker {r['peak_rss_mb']['train_worker']:,} MB | | "
                         f"{r['goal']} |")
        elif r["benchmark"].startswith("time to accuracy"):
            if r.get("skipped"):
                lines.append(f"| {r['benchmark']} | {r['device']} | | | | not run: {r['skipped']} |")
                continue

            def reached(seconds, epoch, history):
                return f"{seconds} s (epoch {epoch + 1})" if seconds is not None else f"not reached (best {max(history):.4f})"

            rows = "" if r["benchmark"] == "time to accuracy" else f"{r['train_rows']:,} training rows (full-size mirror), "
            where = f" on the device ({r['device']}, {r['precision']})" if "device" in r else ""
            lines.append(f"| time to {r['target']:.0%} validation accuracy{where} | {rows}{r['epochs']} epochs, {r['workers']} worker(s) | "
                         f"{reached(r['baseline_s'], r['baseline_epoch'], r['baseline_history'])} | "
                         f"{reached(r['ours_s'], r['ours_epoch'], r['ours_history'])} | "
                         f"{'' if r['ratio'] is None else str(r['ratio']) + 'x'} | {r['goal']} |")
        elif r["benchmark"].startswith("training throughput on the device"):
            if r.get("skipped"):
                lines.append(f"| {r['benchmark']} | {r['device']} | | | | not run: {r['skipped']} |")
                continue
            busy = r.get("gpu_busy_percent")
            busy = f"; GPU busy {busy['mean']}% (max {busy['max']}%)" if busy else ""
            lines.append(f"| {r['benchmark']} | {r['device']}, {r['train_rows']:,} training rows, {r['epochs']} epoch(s), "
                         f"batch {r['batch']}, {r['precision']} | {r['baseline_images_per_s']} img/s | "
                         f"{r['ours_images_per_s']} img/s{busy} | {r['ratio']}x | {r['goal']} |")
        elif r["benchmark"] == "tune stage, per trial":
            lines.append(f"| tune stage, per trial | 1 trial, {r['epochs']} epoch(s), {r['workers']} worker | "
                         f"{r['baseline_s']} s (training stage) | {r['ours_s']} s (tune stage) | "
                         f"{r['ratio']}x (+{r['overhead_per_trial_s']} s per trial) | {r['goal']} |")
        elif r["benchmark"] == "served champion":
            predict = ", ".join(f"{n} images {s} s ({r['baseline_images_per_s'][n]} img/s)" for n, s in r["baseline_s"].items())
            lines.append(f"| served champion (`python -m deployments.serve_model`) | {r['model']}, 28x28 digits, median of "
                         f"{r['rounds']} round(s) | `flows.predict`: {predict} | {_served(r, 'batch_1')}; {_served(r, 'batch_32')}; "
                         f"server start {r['server_start_s']} s | {r['ratio']}x img/s (batch {r['batch']}); a batch of "
                         f"{r['batch']} answered {r['latency_ratio']}x sooner | {r['goal']} |")
        else:
            lines.append(f"| {r['benchmark']} | | {r['baseline_images_per_s']} img/s | {r['ours_images_per_s']} img/s | "
                         f"{r['ratio']}x | {r['goal']} |")
    return "\n".join(lines)
