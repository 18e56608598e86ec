"""The metrics' consumers, checked against `reporting.metrics.CATALOG`: the Grafana dashboard
(deployments/grafana/pipeline.json), the Prometheus config and its alerting rules (deployments/prometheus/) and the
table in docs/operations.md ("Metrics (Prometheus)").

Fast, no Ray: every query names only metrics the pipeline exports (as Ray names them: ``ray_<name>``, a histogram's
``_bucket``/``_sum``/``_count``) or ``up``, sums Ray's per-process labels away inside an aggregation, and every metric
is shown and documented. With Debian's Prometheus (``needs("prometheus")``) its ``promtool`` parses every query, checks
the config and the rules, and runs the rules' unit tests (deployments/prometheus/alerts_test.yml): Prometheus's own
parser and rule engine, no server.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from reporting.metrics import CATALOG, EXPORTED_PREFIX

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deployments" / "grafana" / "pipeline.json"
PROMETHEUS = ROOT / "deployments" / "prometheus"
OPERATIONS = ROOT / "docs" / "operations.md"

AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
                "quantile", "absent", "absent_over_time"}  # the last two keep only the labels an `=` matcher names
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool",
            "atan2", "inf", "nan"}
LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
# What a query may keep after summing away Ray's per-process labels (WorkerId, SessionName, NodeAddress, ...).
KEPT_LABELS = {label for _, _, labels in CATALOG.values() for label in labels} | {"le", "job"}
TOKEN = re.compile(r'\s+|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`|[0-9][0-9A-Za-z.]*|[A-Za-z_:][A-Za-z0-9_:]*'
                   r'|=~|!~|!=|==|>=|<=|[-+*/%^(){}\[\],=<>@]')


def exported(name: str) -> set[str]:
    """What Ray exports for `CATALOG`'s ``name``: ``ray_<name>``, a histogram's ``_bucket``/``_sum``/``_count``."""
    full = EXPORTED_PREFIX + name
    return {f"{full}_{suffix}" for suffix in ("bucket", "sum", "count")} if CATALOG[name][0] == "histogram" else {full}


def exported_names() -> set[str]:
    return set().union(*(exported(name) for name in CATALOG))


def without_grafana_variables(expr: str) -> str:
    """The query as Grafana sends it: a time variable becomes a duration, a template variable a regex."""
    return re.sub(r"\$\{?\w+\}?", ".*", re.sub(r"\$__\w+", "5m", expr))


def tokens(expr: str) -> list[str]:
    found, at = [], 0
    while at < len(expr):
        match = TOKEN.match(expr, at)
        assert match, f"unexpected {expr[at:at + 20]!r} in {expr!r}"
        if not match.group().isspace():
            found.append(match.group())
        at = match.end()
    return found


def analyse(expr: str) -> tuple[list[str], list[str]]:
    """``expr``'s metric names, and what is wrong with it: unbalanced brackets, a metric outside every aggregation,
    an aggregation that keeps a per-process label. A small lexer, not a parser: promtool parses (below)."""
    metrics, problems = [], []
    stack: list[str] = []  # open brackets: "(" plain, "agg(" an aggregation's body, "labels(" a label list, "[", "{"
    pending_aggregation = False  # an aggregation's name seen, its body's "(" not yet
    label_list_of: str | None = None  # "by"/"without"/... seen, its "(" not yet
    words = tokens(expr)
    for index, word in enumerate(words):
        following = words[index + 1] if index + 1 < len(words) else ""
        if word in "([{":
            if word == "(" and label_list_of:
                stack.append(f"labels:{label_list_of}(")
                label_list_of = None
            elif word == "(" and pending_aggregation:
                stack.append("agg(")
                pending_aggregation = False
            else:
                stack.append(word)
        elif word in ")]}":
            opened = stack.pop() if stack else ""
            if opened[-1:] != {")": "(", "]": "[", "}": "{"}[word]:
                problems.append(f"unbalanced {word!r}")
                return metrics, problems
        elif re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", word):
            inside = stack[-1] if stack else ""
            if inside == "{" or inside == "[":
                continue  # a label name, or a duration's unit
            if inside.startswith("labels:"):
                kind = inside[len("labels:"):-1]
                if kind == "by" and word not in KEPT_LABELS:
                    problems.append(f"by ({word}) keeps a per-process label")
                continue
            if word in LABEL_LISTS:
                label_list_of = word
            elif word in AGGREGATIONS and following in ("(", "by", "without"):  # an aggregation's body follows
                pending_aggregation = True
            elif word in KEYWORDS or following == "(":
                continue  # an operator, or a function's name
            else:
                metrics.append(word)
                if word != "up" and "agg(" not in stack:
                    problems.append(f"{word} is not summed (Ray's per-process labels stay)")
    without_lists = [index for index, word in enumerate(words) if word == "without"]
    for index in without_lists:  # `without (...)` must drop Ray's worker at least
        closing = words.index(")", index)
        if "WorkerId" not in words[index + 2:closing]:
            problems.append("without (...) keeps WorkerId")
    if stack:
        problems.append(f"unclosed {stack[-1][-1]!r}")
    return metrics, problems


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries() -> dict[str, str]:
    """Every panel's queries, by ``<panel title>/<refId>``."""
    panels = dashboard()["panels"]
    return {f"{panel['title']}/{target['refId']}": target["expr"] for panel in panels for target in panel["targets"]}


def alert_queries() -> dict[str, str]:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    return {rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}


def test_the_dashboard_is_one_grafana_dashboard_with_unique_panels_each_with_a_query_on_the_chosen_data_source():
    board = dashboard()
    assert board["schemaVersion"] >= 36 and board["uid"] and board["title"]
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["workload"]["query"]["query"] == "label_values(ray_pipeline_train_loss, workload)"
    assert variables["model"]["query"]["query"].startswith("label_values(ray_pipeline_train_loss")
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)), ids
    for panel in board["panels"]:
        assert panel["targets"], f"{panel['title']}: no query"
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"}, panel["title"]
        for target in [panel, *panel["targets"]]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        assert all(target["expr"].strip() for target in panel["targets"]), panel["title"]


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_query_names_only_exported_metrics_and_sums_rays_per_process_labels_away(source):
    queries = dashboard_queries() if source == "dashboard" else alert_queries()
    known = exported_names() | {"up"}
    for where, expr in queries.items():
        metrics, problems = analyse(without_grafana_variables(expr))
        assert metrics, f"{where}: no metric in {expr!r}"
        assert not problems, f"{where}: {problems} in {expr!r}"
        unknown = sorted(set(metrics) - known)
        assert not unknown, f"{where}: {unknown} are not exported (reporting.metrics.CATALOG)"


def test_the_checks_catch_what_they_are_for():
    """The lexer itself: a per-process series, a kept WorkerId, an unknown bracket, a label or function not a metric."""
    assert analyse('max by (workload) (ray_pipeline_train_loss{workload=~".*"})') == (["ray_pipeline_train_loss"], [])
    assert analyse("ray_pipeline_epoch")[1] == ["ray_pipeline_epoch is not summed (Ray's per-process labels stay)"]
    assert analyse("sum by (workload, WorkerId) (x_total)")[1] == ["by (WorkerId) keeps a per-process label"]
    assert analyse("sum without (SessionName) (ray_pipeline_runs_total)")[1] == ["without (...) keeps WorkerId"]
    assert analyse("sum(rate(ray_pipeline_runs_total[5m])")[1] == ["unclosed '('"]
    assert analyse("sum(ray_pipeline_runs_total[5m)])")[1] == ["unbalanced ')'"]
    assert analyse('histogram_quantile(0.5, sum by (le) (increase(x_bucket[1h] offset 1d)))') == (["x_bucket"], [])
    assert analyse('up{job="ray"} == 0') == (["up"], [])


def test_every_metric_is_on_the_dashboard():
    shown = {name for expr in dashboard_queries().values() for name in analyse(without_grafana_variables(expr))[0]}
    missing = [name for name in CATALOG if not shown & exported(name)]
    assert not missing, f"not on the dashboard: {missing}"


def test_every_metric_is_in_the_operations_table_with_its_kind_and_labels():
    text = OPERATIONS.read_text()
    assert "## Metrics (Prometheus)" in text
    section = text.split("## Metrics (Prometheus)", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells and cells[0].startswith("`ray_"):
            rows[cells[0].strip("`")] = cells
    for name, (kind, _, labels) in CATALOG.items():
        row = rows.get(EXPORTED_PREFIX + name)
        assert row, f"{EXPORTED_PREFIX + name} is not in docs/operations.md's table"
        assert row[1] == kind, f"{name}: documented as {row[1]}, is a {kind}"
        assert set(re.findall(r"`(\w+)`", row[2])) == set(labels), f"{name}: documented labels {row[2]}, has {labels}"
    assert set(rows) == {EXPORTED_PREFIX + name for name in CATALOG}, "the table lists a metric CATALOG does not have"


def promtool(*args: str, cwd: Path = PROMETHEUS) -> str:
    assert shutil.which("promtool"), "promtool is not on PATH (Debian's prometheus package brings it)"
    done = subprocess.run(["promtool", *args], check=False, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


@pytest.mark.needs("prometheus")
def test_promtool_accepts_the_config_and_the_alerting_rules():
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml")
    assert "SUCCESS: 6 rules found" in promtool("check", "rules", "alerts.yml")


@pytest.mark.needs("prometheus")
def test_the_alerts_fire_as_their_unit_tests_say_in_prometheus_rule_engine():
    """alerts_test.yml: a failed gate is seen from a run's first increment (which increase() misses) and kept an hour;
    no promotion in 7 days fires per workload that ran, and once when nothing ran at all."""
    assert "SUCCESS" in promtool("test", "rules", "alerts_test.yml")


@pytest.mark.needs("prometheus")
def test_promtool_parses_every_dashboard_query(tmp_path):
    """Each query, as Grafana sends it, as a recording rule: `promtool check rules` parses it as Prometheus does."""
    queries = dashboard_queries()
    rules = [{"record": f"dashboard:query_{index}", "expr": without_grafana_variables(expr)}
             for index, expr in enumerate(queries.values())]
    (tmp_path / "queries.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert f"SUCCESS: {len(rules)} rules found" in promtool("check", "rules", "queries.yml", cwd=tmp_path)
