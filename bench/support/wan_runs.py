"""bench/compare.py's workload 3: ciuic-p2p against its own dense synchronous mode on
the emulated WAN, and what DDP (gloo) and hivemind would take there, *modelled*.

The measured part is bench/training.py (digits, 4 nodes farthest apart, async sparse
gossip and dense fp32 ring all-reduce through the same daemons, the same emulated
links: RTTs from the scenario's matrix, rates times ``RATE_SCALE``). gloo and
hivemind speak TCP, which the user-space emulator does not carry, so their time per
step is a lower-bound model from the same links:

- DDP/gloo ring all-reduce of S bytes of fp32 gradients among P peers:
  ``compute + 2(P-1) x (hop RTT / 2 + S / P / hop rate)``, on the ring's slowest hop
  (the least-RTT ring, as the dense mode's), no TCP slow start, no loss recovery;
- hivemind.Optimizer, one averaging round per global step: a butterfly all-reduce,
  ``compute + 2 x largest RTT + 2 (P-1)/P x S / slowest rate``, plus its progress
  reports and matchmaking through the DHT counted as one more largest RTT (its
  ``matchmaking_time`` floor, 15 s by default and 1 s in workload 2, is left out).

``compute`` is the async run's measured step time. The model ignores the CPU the
peers' own stacks need, so it flatters them; it is a model, not a measurement.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ciuic_p2p.data import WAN_DIR
from ciuic_p2p.emulator.scenarios import load_scenario

BENCH = Path(__file__).resolve().parents[1]
RATE_SCALE = 0.1  # bench/training.py's default: links at a tenth of the measured rates
SCENARIOS = {
    "cities11": ["--rtt", str(WAN_DIR / "rtt_cloudping_11cities.csv"),
                 "--bandwidth", str(WAN_DIR / "bandwidth_11cities.csv")],
    "multicloud8": ["--rtt", str(WAN_DIR / "rtt_multicloud_8regions.csv"), "--bandwidth", ""],
}  # fmt: skip
NODES = 4


def model_step_s(
    scenario_toml: Path, regions: list[str], gradient_bytes: int, compute_s: float
) -> dict[str, float]:
    """Modelled seconds per global step for gloo's ring and hivemind's butterfly."""
    sc = load_scenario(scenario_toml).subset(regions)
    p = len(regions)

    def rate(a: str, b: str) -> float:
        r = sc.params(a, b).rate_bps
        return (r if r else 1e9) * RATE_SCALE / 8  # bytes per second

    first, rest = regions[0], regions[1:]
    ring = min(
        ([first, *perm] for perm in itertools.permutations(rest)),
        key=lambda order: sum(sc.rtt_s(a, b) for a, b in itertools.pairwise([*order, first])),
    )
    hops = list(itertools.pairwise([*ring, ring[0]]))
    hop_s = max(sc.rtt_s(a, b) / 2 + gradient_bytes / p / rate(a, b) for a, b in hops)
    pairs = [(a, b) for a in regions for b in regions if a != b]
    rtt_max = max(sc.rtt_s(a, b) for a, b in pairs)
    rate_min = min(rate(a, b) for a, b in pairs)
    return {
        "gloo_step_s": compute_s + 2 * (p - 1) * hop_s,
        "hivemind_step_s": compute_s + 3 * rtt_max + 2 * (p - 1) / p * gradient_bytes / rate_min,
        "largest_rtt_s": rtt_max,
        "slowest_rate_mbps": rate_min * 8 / 1e6,
    }


def run_scenario(name: str, seeds: int, steps: int, work: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, str(BENCH / "training.py"), "--json", "--nodes", str(NODES),
        "--task", "digits", "--seeds", str(seeds), "--steps", str(steps), "--skip-single",
        "--rate-scale", str(RATE_SCALE), "--out", str(work), *SCENARIOS[name],
    ]  # fmt: skip
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"bench/training.py on {name} exited {proc.returncode}: "
                           f"{proc.stderr[-2000:]}")  # fmt: skip
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def workload_wan(scenarios: list[str], seeds: int, steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {"wan_rate_scale": RATE_SCALE, "wan_model": __doc__.split("\n\n")[2]}
    from ciuic_p2p.lab.tasks import DigitsTask  # noqa: PLC0415

    params = sum(p.numel() for p in DigitsTask().model().parameters())
    gradient_bytes = 4 * params
    print(f"\nWAN (emulated, rates x {RATE_SCALE}), digits, {NODES} nodes; gloo and "
          "hivemind: modelled lower bounds")  # fmt: skip
    print(f"{'scenario':<12} {'system':<16} {'s/step':>8} {'loss':>7} {'B/step':>10}")
    for name in scenarios:
        with tempfile.TemporaryDirectory(prefix=f"compare-wan-{name}-") as tmp:
            r = run_scenario(name, seeds, steps, Path(tmp))
            model = model_step_s(
                Path(tmp) / "scenario.toml", r["regions"], gradient_bytes, r["step_ms"] / 1000
            )
        steps = int(r["steps"])
        row = {
            "regions": r["regions"],
            "steps": steps,
            "async_s_per_step": r["async_wall_s"] / steps,
            "dense_s_per_step": r["dense_wall_s"] / steps,
            "async_eval_loss": r["async_eval_loss"],
            "dense_eval_loss": r["dense_eval_loss"],
            "async_bytes_per_step": r["async_bytes_per_step"],
            "dense_bytes_per_step": r["dense_bytes_per_step"],
            "async_wait_fraction": r["async_wait_fraction"],
            "gloo_model_s_per_step": model["gloo_step_s"],
            "hivemind_model_s_per_step": model["hivemind_step_s"],
            "largest_rtt_s": model["largest_rtt_s"],
            "slowest_rate_mbps": model["slowest_rate_mbps"],
        }
        for key, value in row.items():
            out[f"wan_{name}_{key}"] = value
        a, d = "async", "dense"
        for system, s_step, loss, bps in (
            ("ciuic async", row[f"{a}_s_per_step"], r[f"{a}_eval_loss"], r[f"{a}_bytes_per_step"]),
            ("ciuic dense", row[f"{d}_s_per_step"], r[f"{d}_eval_loss"], r[f"{d}_bytes_per_step"]),
            ("gloo (model)", model["gloo_step_s"], None, None),
            ("hivemind (model)", model["hivemind_step_s"], None, None),
        ):
            loss_s = "" if loss is None else f"{loss:.4f}"
            bps_s = "" if bps is None else f"{bps:.0f}"
            print(f"{name:<12} {system:<16} {s_step:>8.3f} {loss_s:>7} {bps_s:>10}", flush=True)
    return out
