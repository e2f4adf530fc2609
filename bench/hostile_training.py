"""bench/hostile.py's training section: one member against three honest trainers.

Three honest daemons (a, b, c), each with a digits trainer in the per-step rule at
bench/training.py's step budget (150 steps, the demo's config: density 0.01, INT8,
send every 2 steps, staleness bound 64; compute padded to ``--train-step-s``), and a
member: a fourth daemon of the cluster (m, a valid certificate) whose trainer is
tests/hostile/trainer_liar.py, attacking from its first step. Each row runs beside the
same run without the member (daemon and trainer), same seed, and the honest trainers
are compared at the same (final) step:

- ``flip_x1_claim``: the honest updates it was delivered, sign-flipped, each chunk
  claiming ``replicas = 1``, at fresh step numbers just ahead of the run, twice per
  step; ``flip_x1``: the same stating the replicas it sees; ``flip_x5``: x5 with the
  claim; ``push_x10``: one fixed random direction at 10x the honest updates' norm;
- ``forged_state_absurd`` / ``forged_state_plausible``: once the run is under way the
  member fetches an honest replica's ``state/<run>``, replaces the parameters with
  noise and every per-origin floor with 10^12, and has the store hold it at version
  10^6 / at the run's step + 5, while it takes part as a replica of the run (its
  updates the mean of the honest ones, its state the forged one); then a joiner
  (daemon j) attaches; ``forged_state_sneaky``: noise at the honest values' scale,
  no floors, at the run's step + 5 (only other replicas' samples tell it apart).
  ``joiner_took_forged_state``: the joiner restored the
  member's state (its writer), started past the run's window, or its first
  evaluation is the forged model's.

Printed per row: ``honest_loss_over_clean_max`` (the largest, over the honest nodes,
of a node's final eval loss over the same node's in the clean run: the same rank draws
the same batches), ``honest_accuracy_drop_max`` (the largest drop of a node's accuracy
from its clean twin's), the same against the clean run's mean
(``worst_loss_over_clean_mean``, ``worst_accuracy_below_clean_mean``),
``honest_trainer_crashes``, and what the honest hooks counted (``refused``,
``clipped``, ``weight_raised``, ``set_aside``, ``agreement_by_origin``)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ciuic_p2p.core.store.statefile import pack_state, read_header
from ciuic_p2p.daemon.control import request
from ciuic_p2p.lab.cluster import LocalCluster
from ciuic_p2p.lab.demo import DEMO_CONFIG

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the attackers live with the hostile tests
HONEST = ["a", "b", "c"]
CONFIG = DEMO_CONFIG.format(density=0.01, send_interval=2, max_interval=16, bound=64)
STEPS = 150
"""bench/training.py's step budget for digits."""
STORE_CONFIG = """
[store]
replicas = 3
fetch_timeout_s = 15.0
"""
HEADLINE = (
    "honest_loss_over_clean_max",
    "honest_accuracy_drop_max",
    "honest_trainer_crashes",
    "joiner_took_forged_state",
    "store_objects_replaced",
    "relay_delivery_p90_over_clean",
)
"""The section's figures bench/hostile.py prints at its top level."""
LIMITS = {"honest_loss_over_clean_max": 1.10, "honest_accuracy_drop_max": 0.025}


ECHO = ["--attack", "flip", "--scale", "-0.3333", "--claim", "0"]


@dataclass(frozen=True)
class Attack:
    name: str
    liar: list[str]
    """trainer_liar's arguments."""
    forged_version: str = ""
    """"absurd", "plausible" or "sneaky": forge the run's state and start a joiner."""


ATTACKS = [
    Attack("flip_x1_claim", ["--attack", "flip", "--scale", "1", "--claim", "1"]),
    Attack("flip_x1", ["--attack", "flip", "--scale", "1", "--claim", "0"]),
    Attack("flip_x5", ["--attack", "flip", "--scale", "5", "--claim", "1"]),
    Attack("push_x10", ["--attack", "push", "--scale", "10", "--claim", "1"]),
    # Here the member trains as an honest replica would (it republishes the mean of the
    # honest updates it sees), so that the row measures the forgery, not a replica
    # that brings nothing (which slows the run by its 1/N share).
    Attack("forged_state_absurd", [*ECHO], "absurd"),
    Attack("forged_state_plausible", [*ECHO], "plausible"),
    Attack("forged_state_sneaky", [*ECHO], "sneaky"),
]


class _Lines:
    """A trainer's JSON lines, read on a thread of their own."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.lines: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with contextlib.suppress(ValueError):
                obj = json.loads(raw)
                if isinstance(obj, dict):
                    self.lines.append(obj)

    def step(self) -> int:
        steps = [int(o["step"]) for o in self.lines if o.get("event") == "progress"]
        return max(steps, default=0)

    def event(self, name: str) -> dict[str, Any] | None:
        return next((o for o in self.lines if o.get("event") == name), None)


def _trainer_args(run: str, seed: int, steps: int, step_s: float) -> list[str]:
    return [
        "--task", "digits", "--steps", str(steps), "--seed", str(seed), "--world", "3",
        "--run", run, "--evals", "3", "--step-s", repr(step_s),
    ]  # fmt: skip


def _forge(cluster: LocalCluster, run: str, version: str, out: Path) -> dict[str, Any]:
    """The member's forgery, with its own daemon's store: an honest state of the run
    fetched, noise parameters and floors of 10^12 put at a far or a plausible version."""
    from ciuic_p2p.core.replica.messages import run_id_of  # noqa: PLC0415

    name = "state/" + run_id_of(run).hex()
    got_path = out / "honest-state.bin"
    status = {n: cluster.status()[n] for n in HONEST}
    peers = {n: str(s["peer"]) for n, s in status.items() if s}
    answer: dict[str, Any] = {}
    for writer in HONEST:  # the first honest replica whose state is stored
        answer = request(
            cluster.control("m"),
            {"cmd": "store_get", "name": name, "path": str(got_path), "writer": peers[writer]},
            timeout_s=60,
        )
        if answer.get("ok"):
            break
    if not answer.get("ok"):
        return {"forged": False, "error": answer.get("error")}
    data = got_path.read_bytes()
    header, start = read_header(data)
    entries = [e for e in header["tensors"] if str(e[0]).startswith("bucket/")]
    if version == "sneaky":  # noise of the honest values' scale, each bucket's own
        scales = [
            float(torch.frombuffer(bytearray(data[start + e[3] : start + e[3] + e[4]]),
                                   dtype=torch.float32).std())
            for e in entries
        ]  # fmt: skip
    else:
        scales = [1e3] * len(entries)
    buckets = [torch.randn(int(math.prod(e[2]))) * s for e, s in zip(entries, scales, strict=True)]
    at = 10**6 if version == "absurd" else int(answer["version"]) + 5
    # "sneaky": no floors at all, which no floor check can object to.
    floors = {} if version == "sneaky" else dict.fromkeys(peers.values(), 10**12)
    forged, _ = pack_state(int(str(header["layout"]), 16), buckets, None, {"applied": floors})
    path = out / "forged-state.bin"
    path.write_bytes(bytes(forged))
    put = request(
        cluster.control("m"),
        {"cmd": "store_put", "name": name, "path": str(path), "version": at},
        timeout_s=60,
    )
    return {"forged": bool(put.get("ok")), "version": at, "held_by": len(put.get("held_by", []))}


def run_once(
    workdir: Path, attack: Attack | None, seed: int, steps: int, step_s: float
) -> dict[str, Any]:
    """One run: the honest trainers' results (and the member's, the joiner's)."""
    names = [
        *HONEST,
        *(["m"] if attack else []),
        *(["j"] if attack and attack.forged_version else []),
    ]
    run = f"hostile-train-{seed}-{time.time_ns()}"
    out = workdir / "out"
    row: dict[str, Any] = {}
    with LocalCluster(None, names, workdir, CONFIG) as cluster:
        cluster.start()
        liar = None
        if attack:
            cmd = [
                sys.executable, "-m", "tests.hostile.trainer_liar",
                "--socket", str(cluster.trainer_socket("m")), "--run", run,
                "--config", str(cluster.config_path), "--seed", str(seed),
                "--tick-s", repr(step_s), "--duration-s", repr(steps * step_s * 4 + 120),
                "--out", str(workdir / "liar.json"), *attack.liar,
            ]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
            with (workdir / "liar.log").open("ab") as log:
                liar = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                    start_new_session=True,
                )  # fmt: skip
            cluster.trainers.append(liar)
        honest = [
            _Lines(cluster.spawn_trainer(n, rank, _trainer_args(run, seed, steps, step_s), out))
            for rank, n in enumerate(HONEST)
        ]
        joiner = None
        deadline = time.monotonic() + steps * step_s * 6 + 180
        if attack and attack.forged_version:
            while min(h.step() for h in honest) < steps // 3 and time.monotonic() < deadline:
                if any(h.proc.poll() not in (None, 0) for h in honest):
                    break
                time.sleep(0.2)
            row["forgery"] = _forge(cluster, run, attack.forged_version, workdir)
            args = [*_trainer_args(run, seed + 100, steps, step_s), "--min-replicas", "3"]
            joiner = _Lines(cluster.spawn_trainer("j", 3, args, out))
        for h in [*honest, *([joiner] if joiner else [])]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                h.proc.wait(max(1.0, deadline - time.monotonic()))
        codes = [h.proc.poll() for h in honest]
        row["honest_trainer_crashes"] = sum(1 for c in codes if c != 0)
        crashes = {}
        for rank, code in enumerate(codes):
            if code != 0:
                text = (out / f"trainer-{rank}.log").read_text(errors="replace").strip()
                crashes[HONEST[rank]] = {
                    "exit": code,
                    "last": text.splitlines()[-1:] if text else [],
                }
        if crashes:
            row["crashes"] = crashes
        results = []
        for rank in range(len(HONEST)):
            path = out / f"result-{rank}.json"
            if path.exists():
                results.append(json.loads(path.read_text()))
        row["honest"] = [
            {
                "node": HONEST[r["rank"]],
                "eval_loss": r["eval_loss"],
                "accuracy": r["accuracy"],
                "steps": r["steps"],
                **{
                    k: r.get("sync", {}).get(k)
                    for k in (
                        "refused",
                        "clipped",
                        "weight_raised",
                        "set_aside",
                        "agreement_by_origin",
                    )
                },
            }
            for r in results
        ]
        if joiner is not None:
            attached = joiner.event("attached") or {}
            restored = attached.get("restored") or {}
            member_peer = str((cluster.status().get("m") or {}).get("peer", ""))
            jpath = out / "result-3.json"
            jres = json.loads(jpath.read_text()) if jpath.exists() else {}
            row["joiner"] = {
                "source": restored.get("source"),
                "writer": restored.get("writer"),
                "start_step": attached.get("start_step"),
                "refused": len(restored.get("refused", [])),
                "refused_reasons": [r.get("reason") for r in restored.get("refused", [])],
                "vouched": restored.get("vouched"),
                "accuracy": jres.get("accuracy"),
                "exit": joiner.proc.poll(),
            }
            row["joiner_took_forged_state"] = bool(
                restored.get("writer") == member_peer
                or int(attached.get("start_step") or 0) > steps * 4
                or (jres.get("accuracy") is not None and jres["accuracy"] < 0.5)
            )
        if liar is not None:
            liar.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                liar.wait(10)
            try:
                row["member"] = json.loads((workdir / "liar.json").read_text())
            except (OSError, ValueError):
                text = (workdir / "liar.log").read_text(errors="replace")
                raise RuntimeError(f"the member's trainer failed: {text[-1500:]}") from None
    return row


def store_replacement(workdir: Path, seed: int = 0) -> dict[str, Any]:
    """An honest writer's ``model/weights`` (version 1, held by the store's replicas)
    against a member that puts the same name at version 10^12 and asks for it to be
    held, while an honest node keeps a ``--local`` version 1 of its own. Then every
    honest node's ``store get`` (by the writer, and plain): ``store_objects_replaced``
    counts the gets by the writer that returned other bytes, and the plain gets that
    returned the member's bytes."""
    rng = random.Random(seed)
    honest_bytes, forged_bytes, local_bytes = (
        rng.randbytes(70_000),
        rng.randbytes(70_000),
        rng.randbytes(5_000),
    )
    row: dict[str, Any] = {}
    with LocalCluster(None, [*HONEST, "m"], workdir, STORE_CONFIG) as cluster:
        cluster.start()
        for name, data in (
            ("honest", honest_bytes),
            ("forged", forged_bytes),
            ("local", local_bytes),
        ):
            (workdir / name).write_bytes(data)

        def store_put(node: str, path: str, version: int, local: bool = False) -> dict[str, Any]:
            body = {"cmd": "store_put", "name": "model/weights", "path": str(workdir / path),
                    "version": version, **({"local": True} if local else {})}  # fmt: skip
            return request(cluster.control(node), body, timeout_s=60)

        put = store_put("a", "honest", 1)
        forged = store_put("m", "forged", 10**12)
        own = store_put("b", "local", 1, local=True)
        row["writer_held_by"] = len(put.get("held_by", []))
        row["member_held_by"] = len(forged.get("held_by", []))
        row["member_put"] = forged.get("error") or "ok"
        row["own_local_put"] = own.get("error") or "ok"
        replaced = 0
        gets: dict[str, Any] = {}
        for n in HONEST:
            path = workdir / f"got-{n}"
            by_writer = request(
                cluster.control(n),
                {"cmd": "store_get", "name": "model/weights", "path": str(path), "writer": "a"},
                timeout_s=60,
            )
            got = path.read_bytes() if by_writer.get("ok") else b""
            replaced += got != honest_bytes
            plain = request(
                cluster.control(n),
                {"cmd": "store_get", "name": "model/weights", "path": str(path)},
                timeout_s=60,
            )
            plain_bytes = path.read_bytes() if plain.get("ok") else b""
            replaced += plain_bytes == forged_bytes
            gets[n] = {
                "by_writer": "honest" if got == honest_bytes else by_writer.get("error", "other"),
                "plain": {
                    honest_bytes: "writer's",
                    local_bytes: "own local",
                    forged_bytes: "member's",
                }.get(plain_bytes, plain.get("error", "other")),
                "plain_version": plain.get("version"),
            }
        row["gets"] = gets
        row["store_objects_replaced"] = replaced
    return row


def false_links(seed: int = 5) -> dict[str, Any]:
    """The member publishes its links at 1% of their RTT and forwards nothing, on the
    simulator's 11-city WAN (bench/relaytrust.py's run); p90 delivery over clean."""
    from tests.mesh.relayattack import relay_run  # noqa: PLC0415

    runs = {
        name: relay_run(attack, seed=seed)
        for name, attack in (("clean", False), ("attacked", True))
    }
    return {
        "clean": runs["clean"].summary(),
        "attacked": runs["attacked"].summary(),
        "relay_delivery_p90_over_clean": round(runs["attacked"].p(0.9) / runs["clean"].p(0.9), 3),
    }


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def compare(clean: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """The row's figures against the clean run's."""
    clean_loss = _mean([h["eval_loss"] for h in clean["honest"]])
    clean_acc = _mean([h["accuracy"] for h in clean["honest"]])
    losses = [h["eval_loss"] for h in row["honest"]]
    accs = [h["accuracy"] for h in row["honest"]]
    missing = len(HONEST) - len(row["honest"])
    worst_loss = max(losses) if losses and not missing else float("inf")
    worst_acc = min(accs) if accs and not missing else 0.0
    # Node by node: the same rank draws the same batches in both runs.
    clean_by = {h["node"]: h for h in clean["honest"]}
    ratios = [h["eval_loss"] / clean_by[h["node"]]["eval_loss"] for h in row["honest"]]
    drops = [clean_by[h["node"]]["accuracy"] - h["accuracy"] for h in row["honest"]]
    finite = not missing and all(math.isfinite(r) for r in ratios)
    mean_ratio = worst_loss / clean_loss if math.isfinite(worst_loss) else None
    return {
        "honest_loss_over_clean_max": round(max(ratios), 4) if finite else None,
        "honest_accuracy_drop_max": round(max(drops), 4) if finite else round(clean_acc, 4),
        "worst_loss_over_clean_mean": None if mean_ratio is None else round(mean_ratio, 4),
        "worst_accuracy_below_clean_mean": round(clean_acc - worst_acc, 4),
        "clean_loss": round(clean_loss, 4),
        "clean_accuracy": round(clean_acc, 4),
    }


def training_section(
    attacks: list[str] | None,
    seed: int = 0,
    steps: int = STEPS,
    step_s: float = 0.1,
    keep: Path | None = None,
) -> dict[str, Any]:
    """Every attack (or those named) beside one clean run; the section's JSON."""
    chosen = [a for a in ATTACKS if attacks is None or a.name in attacks]
    t0 = time.monotonic()
    extra: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        tmp = keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ciuic-ht-")))
        if attacks is None or "store_replacement" in attacks:
            extra["store_replacement"] = store_replacement(Path(tmp) / "store", seed)
            extra["store_objects_replaced"] = extra["store_replacement"]["store_objects_replaced"]
        if attacks is None or "false_links" in attacks:
            extra["false_links"] = false_links()
            extra["relay_delivery_p90_over_clean"] = extra["false_links"][
                "relay_delivery_p90_over_clean"
            ]
        if not chosen:
            return {**extra, "seconds": round(time.monotonic() - t0, 1)}
        clean = run_once(Path(tmp) / "clean", None, seed, steps, step_s)
        rows: dict[str, Any] = {}
        for attack in chosen:
            row = run_once(Path(tmp) / attack.name, attack, seed, steps, step_s)
            rows[attack.name] = {**compare(clean, row), **row}
            print(
                f"  training {attack.name}: {json.dumps(rows[attack.name])[:300]}", file=sys.stderr
            )
    worst = {
        "honest_loss_over_clean_max": max(
            (r["honest_loss_over_clean_max"] or float("inf") for r in rows.values()), default=None
        ),
        "honest_accuracy_drop_max": max(
            (r["honest_accuracy_drop_max"] for r in rows.values()), default=None
        ),
        "honest_trainer_crashes": sum(r["honest_trainer_crashes"] for r in rows.values()),
        "joiner_took_forged_state": any(
            r.get("joiner_took_forged_state", False) for r in rows.values()
        ),
    }
    return {
        "task": "digits",
        "mode": "step",
        "steps": steps,
        "seed": seed,
        "step_s": step_s,
        "targets": LIMITS,
        "clean": clean,
        "rows": rows,
        **worst,
        **extra,
        "seconds": round(time.monotonic() - t0, 1),
    }


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="attacks, comma-separated")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", type=Path, help="keep the runs' logs and state here")
    ap.add_argument("--json", action="store_true", help="accepted: the printout is JSON")
    a = ap.parse_args()
    only = a.only.split(",") if a.only else None
    print(json.dumps(training_section(only, a.seed, a.steps, a.step_s, a.keep)))
