"""The commands serf's, consul's and tailscale's users reach for (``members``,
``monitor``, ``force-leave``, ``rtt``, ``reload``, ``runs``, ``store ls|rm``,
``completion``, ``run --log-level/--log-format``), each through the real CLI against
real daemons on loopback; and the parser tree's help, which every command and
argument must carry."""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ciuic_p2p.cli import build_parser
from ciuic_p2p.cli.completion import completions
from ciuic_p2p.daemon.run import build_config
from tests.daemon.fleet import Fleet, free_port_block
from tests.test_cli import answer_once_with, run_cli, short_dir, stale_socket, stated_exit_status

pytestmark = [pytest.mark.processes, pytest.mark.network]

NEW_COMMANDS = [
    ["members"], ["monitor", "--for-s", "1"], ["force-leave", "x"], ["rtt", "x"], ["reload"],
    ["runs"], ["store", "ls"], ["store", "rm", "x"],
]  # fmt: skip

__all__ = ["short_dir"]  # the fixture, imported for the tests here


def cli_json(fleet: Fleet, node: str, *args: str) -> dict[str, Any]:
    out = run_cli(*args, "--json", "--control", str(fleet.control(node)))
    assert out.returncode == 0, out.stderr
    answer: dict[str, Any] = json.loads(out.stdout)
    return answer


def start_three(fleet: Fleet) -> int:
    base = free_port_block(3)
    fleet.start("a", "--listen", f"127.0.0.1:{base}")
    fleet.wait(lambda: fleet.status("a") is not None, 60, "a up")
    for i, name in enumerate("bc", start=1):
        fleet.start(name, "--listen", f"127.0.0.1:{base + i}", "--join", f"127.0.0.1:{base}")
    fleet.wait(
        lambda: all((s := fleet.status(n)) is not None and s["alive"] == 3 for n in "abc"),
        60,
        "three joined",
    )
    return base


def test_members_rtt_store_and_force_leave_on_three_daemons(fleet: Fleet, tmp_path: Path) -> None:
    start_three(fleet)
    a = fleet.status("a") or {}
    members = cli_json(fleet, "a", "members")
    assert [m["self"] for m in members["members"]] == [True, False, False]
    assert members["members"][0]["peer"] == a["peer"] == members["peer"]
    assert {m["name"] for m in members["members"]} == {"a", "b", "c"}
    assert {m["state"] for m in members["members"]} == {"alive"}
    human = run_cli("members", "--control", str(fleet.control("a")))
    assert human.returncode == 0 and human.stdout.startswith("* a ")
    assert human.stdout.count("\n") == 3
    # `peers --json` keeps its shape: the others only, as before.
    peers = cli_json(fleet, "a", "peers")
    assert set(peers) == {"ok", "peer", "members"} and len(peers["members"]) == 2

    def probed() -> bool:
        rtt = cli_json(fleet, "a", "rtt", "b")
        return rtt["probes"] is not None and rtt["rtt_ms"] is not None

    fleet.wait(probed, 30, "a measured its RTT to b")
    rtt = cli_json(fleet, "a", "rtt", "b")
    assert rtt["to_name"] == "b" and rtt["from"] == a["peer"] and 0 < rtt["rtt_ms"] < 1000
    between = cli_json(fleet, "a", "rtt", "b", "c")
    assert between["from_name"] == "b" and between["to_name"] == "c"
    text = run_cli("rtt", "b", "--control", str(fleet.control("a")))
    assert text.returncode == 0 and "b (" in text.stdout and " ms" in text.stdout

    # b writes an object that a holds for it: a cannot remove b's object.
    blob = tmp_path / "blob"
    blob.write_bytes(b"x" * 5000)
    put = run_cli("store", "put", "shared", str(blob), "--control", str(fleet.control("b")))
    assert put.returncode == 0, put.stderr
    fleet.wait(
        lambda: any(h["name"] == "shared" for h in cli_json(fleet, "a", "store", "ls")["held"]),
        30,
        "a holds b's object",
    )
    held = cli_json(fleet, "a", "store", "ls")["held"]
    assert [(h["name"], h["own"], h["bytes"]) for h in held] == [("shared", False, 5000)]
    refused = run_cli("store", "rm", "shared", "--control", str(fleet.control("a")))
    assert refused.returncode == stated_exit_status("refused as a mistake") == 2
    assert refused.stderr.count("\n") == 1 and "another writer" in refused.stderr
    removed = cli_json(fleet, "b", "store", "rm", "shared")
    assert removed["removed"] == 1
    assert all(
        h["name"] != "shared" or not h["own"] for h in cli_json(fleet, "b", "store", "ls")["held"]
    )

    # force-leave: refused for a live member and an unknown one, done for a dead one.
    for who in ("b", "nobody"):
        out = run_cli("force-leave", who, "--control", str(fleet.control("a")))
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert "Traceback" not in out.stderr
    c_peer = (fleet.status("c") or {})["peer"]
    fleet.kill("c")

    def c_state() -> str:
        found = [m for m in cli_json(fleet, "a", "members")["members"] if m["peer"] == c_peer]
        return str(found[0]["state"]) if found else "gone"

    fleet.wait(lambda: c_state() == "dead", 30, "a marks c failed")
    forced = run_cli("force-leave", c_peer[:12], "--control", str(fleet.control("a")))
    assert forced.returncode == 0, forced.stderr
    assert "c (" in forced.stdout and "left" in forced.stdout
    assert c_state() == "left"


def read_lines(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """The process's stdout lines as they come (None at its end), read by a thread."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def wait_for_event(lines: queue.Queue[str | None], name: str, timeout_s: float) -> dict[str, Any]:
    seen: list[str] = []
    while True:
        line = lines.get(timeout=timeout_s)
        assert line is not None, f"the monitor ended before {name}; saw {seen}"
        event: dict[str, Any] = json.loads(line)
        seen.append(event["event"])
        if event["event"] == name:
            return event


def until_subscribed(fleet: Fleet, node: str, lines: queue.Queue[str | None]) -> str:
    """Reload ``node`` until its monitor shows the ``reloaded`` event (the monitor
    subscribes once it connected: an event before that is not its); that line."""
    for _ in range(60):
        assert run_cli("reload", "--control", str(fleet.control(node))).returncode == 0
        try:
            while (line := lines.get(timeout=0.5)) is not None:
                if "reloaded" in line:
                    return line
        except queue.Empty:
            continue
        raise AssertionError("the monitor ended")
    raise AssertionError("the monitor never showed a reload")


@contextlib.contextmanager
def monitor(fleet: Fleet, node: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """``ciuic-node monitor`` on ``node``, killed at the end if it still runs."""
    command = [sys.executable, "-m", "ciuic_p2p.cli", "monitor", "--control",
               str(fleet.control(node)), *args]  # fmt: skip
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_monitor_follows_joins_and_leaves_and_ends_with_ctrl_c_or_the_daemon(
    fleet: Fleet,
) -> None:
    base = free_port_block(2)
    fleet.start("a", "--listen", f"127.0.0.1:{base}", "--log-level", "warning")
    fleet.wait(lambda: fleet.status("a") is not None, 60, "a up")
    with monitor(fleet, "a", "--json") as follow:
        lines = read_lines(follow)
        reloaded = json.loads(until_subscribed(fleet, "a", lines))
        # At info, though the daemon writes only warnings to its log.
        assert reloaded["event"] == "reloaded" and reloaded["level"] == "info"
        fleet.start("b", "--listen", f"127.0.0.1:{base + 1}", "--join", f"127.0.0.1:{base}")
        joined = wait_for_event(lines, "member_alive", 60)
        assert joined["name"] == "b" and joined["logger"] == "ciuic.mesh"
        leave = run_cli("leave", "--control", str(fleet.control("b")))
        assert leave.returncode == 0, leave.stderr
        assert wait_for_event(lines, "member_left", 30)["name"] == "b"
        follow.send_signal(signal.SIGINT)  # Ctrl+C
        assert follow.wait(30) == 0
        assert follow.stderr is not None and "Traceback" not in follow.stderr.read()
    # A second one, human output: it ends by itself when the daemon stops.
    with monitor(fleet, "a") as human:
        line = until_subscribed(fleet, "a", read_lines(human))
        assert " info    reloaded " in line and "changed=" in line
        fleet.procs["a"].send_signal(signal.SIGTERM)
        assert human.wait(60) == 0
        assert human.stderr is not None and "the daemon stopped" in human.stderr.read()


def test_monitor_count_and_for_s_bound_it(fleet: Fleet) -> None:
    base = free_port_block(1)
    fleet.start("a", "--listen", f"127.0.0.1:{base}")
    fleet.wait(lambda: fleet.status("a") is not None, 60, "a up")
    control = str(fleet.control("a"))
    quiet = run_cli("monitor", "--for-s", "0.5", "--json", "--control", control)
    assert quiet.returncode == 0 and quiet.stderr == ""
    with monitor(fleet, "a", "--json", "--count", "2") as counted:
        for _ in range(60):  # each reload logs one event; the monitor may subscribe late
            if counted.poll() is not None:
                break
            run_cli("reload", "--control", control)
        assert counted.wait(30) == 0
        assert counted.stdout is not None
        events = [json.loads(line) for line in counted.stdout.read().splitlines()]
        assert len(events) == 2 and any(e["event"] == "reloaded" for e in events)
    for bad in (["--count", "0"], ["--for-s", "-1"]):
        out = run_cli("monitor", *bad, "--control", control)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr


def test_reload_answers_what_changed_as_sighup_does_and_runs_lists_none(
    fleet: Fleet, tmp_path: Path
) -> None:
    config = tmp_path / "node.toml"
    config.write_text('[log]\nlevel = "info"\n')
    base = free_port_block(1)
    fleet.start("a", "--listen", f"127.0.0.1:{base}", "--config", str(config))
    fleet.wait(lambda: fleet.status("a") is not None, 60, "a up")
    first = cli_json(fleet, "a", "reload")
    assert first["reloads"] == 1 and first["changed"] == [] and first["needs_restart"] == []
    config.write_text('[log]\nlevel = "debug"\n\n[codec]\ndensity = 0.02\n')
    second = cli_json(fleet, "a", "reload")
    assert second["reloads"] == 2 and second["changed"] == ["codec.density", "log.level"]
    assert second["needs_restart"] == ["codec.density"]
    fleet.procs["a"].send_signal(signal.SIGHUP)  # the same path, the same count
    fleet.wait(lambda: (fleet.status("a") or {})["service"]["reloads"] == 3, 30, "SIGHUP")
    text = run_cli("reload", "--control", str(fleet.control("a")))
    # Still pending: a setting that needs a restart is compared with the running one.
    assert text.returncode == 0 and text.stdout.startswith("reload 4: changed codec.density")
    assert "needs a restart to apply: codec.density" in text.stdout
    config.write_text("[log]\nlevel = 5\n")
    broken = cli_json(fleet, "a", "reload")
    assert broken["reloads"] == 4 and "log.level" in broken["error"]

    runs = cli_json(fleet, "a", "runs")
    assert runs["runs"] == [] and runs["serves_trainer"] is True
    text = run_cli("runs", "--control", str(fleet.control("a")))
    assert text.returncode == 0 and "no training runs" in text.stdout


def test_store_ls_and_rm_of_this_nodes_own_object(fleet: Fleet, tmp_path: Path) -> None:
    base = free_port_block(1)
    fleet.start("a", "--listen", f"127.0.0.1:{base}")
    fleet.wait(lambda: fleet.status("a") is not None, 60, "a up")
    control = str(fleet.control("a"))
    assert "no objects" in run_cli("store", "ls", "--control", control).stdout
    blob = tmp_path / "blob"
    blob.write_bytes(b"y" * 1234)
    assert (
        run_cli("store", "put", "mine", str(blob), "--local", "--control", control).returncode == 0
    )
    held = cli_json(fleet, "a", "store", "ls")
    assert [(h["name"], h["version"], h["bytes"], h["own"]) for h in held["held"]] == [
        ("mine", 1, 1234, True)
    ]
    text = run_cli("store", "ls", "--control", control)
    assert "mine" in text.stdout and " self " in text.stdout and "1234 bytes" in text.stdout
    gone = run_cli("store", "rm", "mine", "--control", control)
    assert gone.returncode == 0 and "1 version(s)" in gone.stdout
    again = run_cli("store", "rm", "mine", "--control", control)
    assert again.returncode == 2 and again.stderr.count("\n") == 1
    assert "no object 'mine'" in again.stderr


def test_run_takes_log_level_and_format_over_the_config(tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text('[log]\nlevel = "error"\nformat = "console"\n')
    parser = build_parser()
    plain = build_config(parser.parse_args(["run", "--config", str(config)]))
    assert (plain.log.level, plain.log.format) == ("error", "console")
    flagged = build_config(
        parser.parse_args(
            ["run", "--config", str(config), "--log-level", "debug", "--log-format", "json"]
        )
    )
    assert (flagged.log.level, flagged.log.format) == ("debug", "json")
    assert run_cli("run", "--log-level", "loud").returncode == 2


def test_the_missing_key_hint_is_a_command_that_works_as_printed(tmp_path: Path) -> None:
    out = run_cli("run", "--state-dir", str(tmp_path), "--listen", "127.0.0.1:0")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    hint = out.stderr.split("`")[1]
    assert hint.startswith("ciuic-node keygen --out ")
    made = run_cli(*shlex.split(hint)[1:])
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "node.key").exists()


def walk(
    parser: argparse.ArgumentParser, path: str
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from walk(child, f"{path} {name}")


def test_every_command_has_a_description_and_every_argument_help() -> None:
    missing = []
    for path, parser in walk(build_parser(), "ciuic-node"):
        if not parser.description:
            missing.append(f"{path}: no description")
        for action in parser._actions:
            if not action.help:  # argparse.SUPPRESS is a help: hidden on purpose
                missing.append(f"{path}: {action.dest} has no help")
    assert missing == []


def test_completion_scripts_parse_and_name_every_command(tmp_path: Path) -> None:
    bash = run_cli("completion", "bash")
    assert bash.returncode == 0
    script = tmp_path / "ciuic-node.bash"
    script.write_text(bash.stdout)
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    for path, _ in walk(build_parser(), "ciuic-node"):
        assert f'["{path}"]=' in bash.stdout, path
    table = completions(build_parser())
    assert "members" in table.words["ciuic-node"] and "rm" in table.words["ciuic-node store"]
    assert table.choices["ciuic-node run --log-level"] == ["debug", "info", "warning", "error"]
    # Completing as bash would, in a shell that sourced the script.
    probe = (
        f"source {shlex.quote(str(script))}; COMP_WORDS=(ciuic-node store r); COMP_CWORD=2;"
        ' _ciuic_node; echo "${COMPREPLY[@]}"'
    )
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=False)
    assert done.stdout.split() == ["rm"], done.stderr
    zsh = run_cli("completion", "zsh")
    assert zsh.returncode == 0 and "bashcompinit" in zsh.stdout
    assert run_cli("completion", "fish").returncode == 2


@pytest.mark.parametrize("command", NEW_COMMANDS, ids=" ".join)
@pytest.mark.parametrize("where", ["no socket", "stale socket"])
def test_new_commands_exit_as_the_reference_says_without_a_daemon(
    short_dir: Path, command: list[str], where: str
) -> None:
    if where == "stale socket":
        stale_socket(short_dir)
    target = (
        "/nonexistent/control.sock" if where == "no socket" else str(short_dir / "control.sock")
    )
    out = run_cli(*command, "--control", target)
    assert out.returncode == stated_exit_status("cannot be reached"), (command, out.stderr)
    assert out.stderr.startswith("ciuic-node: error:") and out.stderr.count("\n") == 1


@pytest.mark.parametrize("user_error", [True, False])
def test_a_refused_request_exits_2_and_a_failed_one_1(short_dir: Path, user_error: bool) -> None:
    path = short_dir / "control.sock"
    server = answer_once_with(path, {"ok": False, "error": "not so", "user_error": user_error})
    out = run_cli("force-leave", "x", "--control", str(path))
    server.join(timeout=60)
    case = "refused as a mistake" if user_error else "answered with an error"
    assert out.returncode == stated_exit_status(case) == (2 if user_error else 1)
    assert out.stderr == "ciuic-node: error: not so\n"


@pytest.mark.parametrize(
    "command",
    [["members"], ["monitor"], ["force-leave"], ["rtt"], ["reload"], ["runs"], ["store", "ls"],
     ["store", "rm"], ["completion"]],
    ids=" ".join,
)  # fmt: skip
def test_every_new_command_answers_help(command: list[str]) -> None:
    out = run_cli(*command, "--help")
    assert out.returncode == 0 and out.stdout.startswith(f"usage: ciuic-node {' '.join(command)}")
