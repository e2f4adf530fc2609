"""deploy/: the Prometheus scrape job, alert rules and Grafana dashboard we ship name
only metrics a daemon serves (docs/reference/metrics.md, itself checked against a
running daemon's collector) and parse as their tools read them. ``promtool`` checks
every rules file, the scrape job and a live scrape of a daemon with a trainer attached:
where it is not installed those tests skip, except in CI (``CI`` set: .ci/run installs
Debian's ``prometheus`` package), where they fail."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ciuic_p2p.config import load_layered
from ciuic_p2p.train.attach import attach
from tests.daemon.fleet import Fleet, free_port_block

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


def rules_files() -> list[Path]:
    """Every Prometheus rules file under deploy/ (YAML with top-level ``groups``)."""
    found = [
        p
        for p in sorted(DEPLOY.rglob("*.y*ml"))
        if isinstance(doc := yaml.safe_load(p.read_text()), dict) and "groups" in doc
    ]
    assert DEPLOY / "prometheus/ciuic-alerts.yml" in found
    return found


def expressions() -> list[tuple[str, str]]:
    out = []
    for path in rules_files():
        rules = yaml.safe_load(path.read_text())
        out += [
            (r.get("alert") or r["record"], r["expr"]) for g in rules["groups"] for r in g["rules"]
        ]
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


def promtool() -> str:
    """promtool's path; skips the test where it is not installed, fails it in CI."""
    found = shutil.which("promtool")
    if found is None:
        why = "promtool is not installed (Debian: apt-get install prometheus)"
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"{why}; .ci/run installs it, CI must run these checks")
        pytest.skip(why)
    return found


def check(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """``promtool check ARGS``; its output printed (pytest -s shows it)."""
    done = subprocess.run(
        [promtool(), "check", *args],
        input=stdin,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    print(f"promtool check {args[0]}: exit {done.returncode}\n{done.stdout}{done.stderr}")
    return done


@pytest.mark.parametrize("path", rules_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_promtool_accepts_the_rules(path: Path) -> None:
    done = check("rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_accepts_the_scrape_job_and_the_rules_it_loads() -> None:
    done = check("config", str(DEPLOY / "prometheus/scrape.yml"))
    assert done.returncode == 0, done.stdout + done.stderr


TRAINED_STEPS = 30


@pytest.mark.processes
def test_promtool_accepts_a_live_scrape_of_a_daemon_with_a_trainer(tmp_path: Path) -> None:
    """A `ciuic-node run` daemon, a real trainer (a tiny model in this process) attached
    for a few dozen steps; its /metrics, trainer families included, passes promtool's
    lint (names, HELP and TYPE, counters' _total)."""
    promtool()  # before starting anything
    fleet = Fleet(tmp_path / "fleet")
    fleet.start("a", "--listen", f"127.0.0.1:{free_port_block(1)}")
    try:

        def web_url() -> str | None:
            status = fleet.status("a")
            url = (status or {}).get("web", {}).get("url")
            return url if isinstance(url, str) else None

        fleet.wait(lambda: web_url() is not None, 60, "daemon and its web endpoint up")
        metrics_url = f"{web_url()}metrics"  # open to local users: no token

        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sync = attach(
            model,
            opt,
            run="promtool",
            socket_path=fleet.root / "a" / "trainer.sock",
            config=load_layered(None, {}),
            checkpoint_dir="",
            handle_sigterm=False,
        )
        live = scraped = ""

        def scrape() -> tuple[str, dict[str, float]]:
            with urllib.request.urlopen(metrics_url, timeout=10) as response:
                assert response.status == 200
                text = response.read().decode()
            return text, {
                s.name: s.value
                for f in text_string_to_metric_families(text)
                if f.name.startswith("ciuic_trainer_")
                for s in f.samples
            }

        def rate_reported() -> bool:
            """A live trainer's rate (an ended trainer has none): scraped before finish."""
            nonlocal live
            live, samples = scrape()
            return "ciuic_trainer_steps_per_second" in samples

        def trainer_reported() -> bool:
            """The trainer's own last step seen and its figures (hook_s...) reported,
            as they are after finish()."""
            nonlocal scraped
            scraped, samples = scrape()
            return (
                samples.get("ciuic_trainer_step") == TRAINED_STEPS
                and "ciuic_trainer_hook_seconds_total" in samples
                and "ciuic_trainer_loss" in samples
            )

        try:
            for _ in range(TRAINED_STEPS):
                loss = model(torch.randn(8, 4)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sync.step(loss=loss)  # carried to the daemon: ciuic_trainer_loss
                # Each step's update its own send: a loop this fast outruns a busy
                # encoder, whose steps merge into the next send (the hook never
                # waits), and a daemon that saw one step published has no rate.
                assert sync.encoder.idle.wait(30)
            fleet.wait(rate_reported, 30, "the trainer's rate in /metrics")
            assert sync.finish(30)
        finally:
            sync.close()
        fleet.wait(trainer_reported, 30, "the trainer's figures in /metrics")
    finally:
        fleet.stop_all()

    assert "ciuic_trainer_steps_per_second{" in live
    done = check("metrics", stdin=live)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout
    trainer = {
        f.name: f
        for f in text_string_to_metric_families(scraped)
        if f.name.startswith("ciuic_trainer_")
    }
    for name in (
        "step",
        "encode_seconds",
        "decode_seconds",
        "wait_seconds",
        "hook_seconds",
        "chunks_clipped",
        "chunks_weight_raised",
        "origins_set_aside",
        "loss",
    ):
        family = trainer.get("ciuic_trainer_" + name)
        assert family is not None and family.samples, f"ciuic_trainer_{name} not in the scrape"
        assert all(s.labels["run"] == "promtool" for s in family.samples), name

    families = list(text_string_to_metric_families(scraped))
    print(f"scraped {len(families)} families, {len(trainer)} of them ciuic_trainer_*")
    done = check("metrics", stdin=scraped)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (done.stdout + done.stderr).strip()  # no lint complaint either
