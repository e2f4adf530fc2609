"""Turning trainers' results into figures: the summary of a run, consensus distance,
time to a target loss, and the demo's PNG plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from ciuic_p2p.core.replica.rule import consensus_distance


def time_to_target(curve: list[list[float]], target: float) -> float | None:
    """Seconds (training time, evaluations excluded) until the evaluation loss first
    reached ``target``; None if it never did."""
    for t, _step, loss, *_ in curve:
        if loss <= target:
            return float(t)
    return None


def final_consensus(out: Path, world: int) -> float:
    params = [torch.load(out / f"params-{rank}.pt") for rank in range(world)]
    return consensus_distance(params)


def summarize(results: list[dict[str, Any]], target: float | None = None) -> dict[str, Any]:
    """Means over the nodes of one run."""
    mean = statistics.fmean
    out: dict[str, Any] = {
        "eval_loss": mean(r["eval_loss"] for r in results),
        "accuracy": mean(r["accuracy"] for r in results),
        "wall_s": max(r["wall_s"] for r in results),
        "bytes_per_step": mean(r["bytes_per_step"] for r in results),
        "udp_bytes_sent": mean(r["udp_bytes_sent"] for r in results),
        "wait_fraction": mean(r["wait_fraction"] for r in results),
        "step_ms": mean(r["step_ms"] for r in results),
        "steps": results[0]["steps"],
    }
    syncs = [r["sync"] for r in results if "sync" in r]
    if syncs:
        out["staleness_p50"] = max(s["staleness_p50"] for s in syncs)
        out["staleness_p99"] = max(s["staleness_p99"] for s in syncs)
        out["staleness_bound"] = syncs[0]["staleness_bound"]
        out["blocked_fraction"] = mean(
            s["wait_s"] / r["wall_s"] for s, r in zip(syncs, results, strict=True)
        )
        out["hook_ms_per_step"] = mean(1000 * s["hook_s"] / s["step"] for s in syncs)
        out["merged_steps"] = sum(s["merged_steps"] for s in syncs)
        out["refused"] = sum(sum(s["refused"].values()) for s in syncs)
        out["exactly_once"] = all(  # applied here, or held by the state restored here
            s["applied_by_origin"].get(o, 0) + s.get("held_by_state_by_origin", {}).get(o, 0) == n
            for s in syncs
            for o, n in s["sent_by_origin"].items()
        )
    if target is not None:
        times = [time_to_target(r["curve"], target) for r in results]
        out["time_to_target_s"] = None if None in times else mean(t or 0.0 for t in times)
    return out


COLORS = {
    "async": "tab:blue",
    "step": "tab:blue",
    "outer": "tab:green",
    "diloco": "tab:orange",
    "ddp": "tab:red",
    "dense": "tab:red",
    "single": "tab:gray",
    "torchft": "tab:purple",
}
LABELS = {
    "async": "ciuic async sparse",
    "dense": "dense sync all-reduce",
    "single": "one node alone",
}


def plot(
    runs: dict[str, list[dict[str, Any]]],
    path: Path,
    title: str,
    labels: dict[str, str] | None = None,
) -> Path | None:
    """Loss against time and against bytes sent, one line per node and run; None when
    matplotlib is missing (``pip install 'ciuic-p2p[demo]'``)."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    colors = COLORS
    labels = {**LABELS, **(labels or {})}
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, results in runs.items():
        for i, r in enumerate(results):
            curve = r["curve"]
            if not curve:
                continue
            if mode != "single":  # before the first byte there is no point on a log axis
                curve = [c for c in curve if c[4] > 0] or curve
            t = [max(c[0], 1e-3) for c in curve]
            loss = [c[2] for c in curve]
            sent = [max(c[4], 1) / 1e6 for c in curve]
            label = labels.get(mode, mode) if i == 0 else None
            ax_t.plot(t, loss, color=colors.get(mode), alpha=0.8, lw=1.2, label=label)
            if mode != "single":
                ax_b.plot(sent, loss, color=colors.get(mode), alpha=0.8, lw=1.2, label=label)
    ax_t.set_xlabel("training time (s, log)")
    ax_t.set_xscale("log")
    ax_b.set_xlabel("bytes sent per node (MB, log)")
    ax_b.set_xscale("log")
    for ax in (ax_t, ax_b):
        ax.set_ylabel("evaluation loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
