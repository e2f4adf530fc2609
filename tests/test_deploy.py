"""deploy/: the Prometheus scrape job, alert rules and Grafana dashboard we ship name
only metrics a daemon serves (docs/reference/metrics.md, itself checked against a
running daemon's collector) and parse as their tools read them. Where ``promtool`` is
installed, it checks the rules and a live daemon's exposition too."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
NAME = re.compile(r"\b((?:ciuic|process|python)_[a-z_]+)\b")
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def served_metrics() -> set[str]:
    """Every series name a daemon serves: the reference's table (it names counters
    with _total and infos with _info already) with each histogram's series, and the
    process and platform collectors' families."""
    names = {"up"}
    rows = re.findall(
        r"^\| `([a-z_]+)` \| (\w+) \|", (REPO / "docs/reference/metrics.md").read_text(), re.M
    )
    assert len(rows) > 20
    for name, kind in rows:
        names.add(name)
        if kind == "histogram":
            names |= {name + s for s in HISTOGRAM_SERIES}
    names |= {"process_cpu_seconds_total", "process_resident_memory_bytes", "python_info"}
    return names


def expressions() -> list[tuple[str, str]]:
    rules = yaml.safe_load((DEPLOY / "prometheus/ciuic-alerts.yml").read_text())
    out = [(r["alert"], r["expr"]) for g in rules["groups"] for r in g["rules"]]
    dash = json.loads((DEPLOY / "grafana/ciuic-dashboard.json").read_text())
    out += [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]
    return out


def test_rules_and_dashboard_name_only_served_metrics() -> None:
    served = served_metrics()
    found = expressions()
    assert len(found) >= 15
    for where, expr in found:
        for name in NAME.findall(expr):
            assert name in served, f"{where}: {name} is not a metric a daemon serves"


def test_every_rule_has_a_severity_and_a_summary_and_the_scrape_job_loads_them() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus/ciuic-alerts.yml").read_text())
    for rule in (r for g in rules["groups"] for r in g["rules"]):
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule
        assert rule["annotations"]["summary"], rule
    scrape = yaml.safe_load((DEPLOY / "prometheus/scrape.yml").read_text())
    assert scrape["rule_files"] == ["ciuic-alerts.yml"]
    assert scrape["scrape_configs"][0]["job_name"] == "ciuic"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_rules() -> None:
    done = subprocess.run(
        ["promtool", "check", "rules", str(DEPLOY / "prometheus/ciuic-alerts.yml")],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
