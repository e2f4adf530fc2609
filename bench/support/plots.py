"""PNG plots of bench/compare.py's JSON (matplotlib, from ``make bench-deps``): one per
workload found in it. docs/benchmarks.md shows these files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROUND = ["gloo", "hivemind_none", "hivemind_fp16", "hivemind_u8", "ciuic_1pct", "ciuic_01pct"]
TRAIN = ["ddp", "hivemind", "ciuic", "ciuic_10pct"]
COLORS = {"gloo": "tab:red", "ddp": "tab:red", "hivemind": "tab:green", "ciuic": "tab:blue"}


def _color(name: str) -> str:
    if name == "ciuic_10pct":
        return "tab:cyan"
    return next((c for k, c in COLORS.items() if name.startswith(k)), "tab:gray")


def write_all(result: dict[str, Any], folder: Path) -> list[Path]:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    rounds = [n for n in ROUND if f"{n}_round_s" in result]
    if rounds:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        colors = [_color(n) for n in rounds]
        ax1.barh(rounds, [result[f"{n}_round_s"] for n in rounds], color=colors)
        ax1.set_xlabel("seconds per round (all 4 peers hold the result)")
        ax2.barh(rounds, [result[f"{n}_round_bytes"] / 1e6 for n in rounds], color=colors)
        ax2.set_xscale("log")
        ax2.set_xlabel("MB sent by all peers per round (log)")
        ax2.set_yticklabels([])
        fig.suptitle(f"Workload 1: one round of a {result['elements']:,}-element update, loopback")
        fig.tight_layout()
        written.append(_save(fig, folder / "compare-round.png", plt))

    counts = result.get("train_peers", [])
    trained = [n for n in TRAIN if any(f"{n}_{c}p_loss" in result for c in counts)]
    if trained and counts:
        fig, axes = plt.subplots(1, 3, figsize=(13, 4))
        width = 0.8 / len(trained)
        for i, name in enumerate(trained):
            xs = [j + i * width for j in range(len(counts))]
            for ax, key in zip(axes, ("loss", "samples_per_s", "bytes_per_sample"), strict=True):
                ys = [result.get(f"{name}_{c}p_{key}") or 0.0 for c in counts]
                ax.bar(xs, ys, width, label=name, color=_color(name))
        for ax, label in zip(
            axes,
            ("final eval loss", "samples per second", "bytes sent per sample (log)"),
            strict=True,
        ):
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(counts))])
            ax.set_xticklabels([f"{c} peers" for c in counts])
            ax.set_title(label)
        axes[2].set_yscale("log")
        axes[0].legend()
        fig.suptitle(f"Workload 2: digits MLP, {result['train_steps']} global steps, loopback")
        fig.tight_layout()
        written.append(_save(fig, folder / "compare-train.png", plt))

    scenarios = sorted({k.split("_")[1] for k in result if k.startswith("wan_") and
                        k.endswith("_async_s_per_step")})  # fmt: skip
    if scenarios:
        systems = [("ciuic async", "async_s_per_step", "tab:blue"),
                   ("ciuic dense sync", "dense_s_per_step", "tab:purple"),
                   ("gloo ring (model)", "gloo_model_s_per_step", "tab:red"),
                   ("hivemind (model)", "hivemind_model_s_per_step", "tab:green")]  # fmt: skip
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(systems)
        for i, (label, key, color) in enumerate(systems):
            xs = [j + i * width for j in range(len(scenarios))]
            ax.bar(xs, [result[f"wan_{s}_{key}"] for s in scenarios], width, label=label,
                   color=color, hatch="//" if "model" in label else None)  # fmt: skip
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(scenarios))])
        ax.set_xticklabels(scenarios)
        ax.set_ylabel("seconds per training step")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.set_title("Workload 3: emulated WAN, 4 nodes, digits (hatched: modelled)")
        fig.tight_layout()
        written.append(_save(fig, folder / "compare-wan.png", plt))
    return written


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
