#!/usr/bin/env python3
"""Plots of a scripts/bench size sweep: one-way latency and streaming bandwidth against
message size, per provider, one line per lane.

  bench/plot.py SWEEP.json OUTDIR     writes OUTDIR/latency-<provider>.png and
                                      OUTDIR/bandwidth-<provider>.png, prints their paths

SWEEP.json is what scripts/bench writes: {"title": str, "providers": {provider: {lane
label: {"lat": {size: usec}, "bw": {size: MB/s}}}}}. Needs matplotlib (Debian:
python3-matplotlib); scripts/bench runs this only where matplotlib imports.
"""

import json
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Same lane, same look in every plot.
STYLE = {
    "ours MTL": dict(color="tab:blue", marker="o"),
    "ours ob1": dict(color="tab:green", marker="s"),
    "C MTL": dict(color="tab:red", marker="^"),
    "btl/vader": dict(color="tab:gray", marker="D"),
    "raw fi_pp": dict(color="black", marker="x", linestyle="--"),
}


def human(n):
    n = int(n)
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def plot(provider, lanes, metric, ylabel, title, path):
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    sizes = set()
    for label, data in lanes.items():
        points = sorted((int(s), v) for s, v in data.get(metric, {}).items() if v and v > 0)
        if not points:
            continue
        sizes.update(s for s, _ in points)
        name = label
        if metric == "bw" and label == "raw fi_pp":
            name = "raw fi_pp (ping-pong: size / latency)"
        ax.plot([s for s, _ in points], [v for _, v in points], label=name,
                **STYLE.get(label, {}))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted(sizes)
    ax.set_xticks(ticks)
    ax.set_xticklabels([human(s) for s in ticks], rotation=45, ha="right")
    ax.set_xlabel("message size")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{provider}: {title}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        sweep = json.load(f)
    out = sys.argv[2]
    for provider, lanes in sweep["providers"].items():
        safe = re.sub(r"[^A-Za-z0-9]+", "_", provider).strip("_")
        for metric, ylabel, what in (("lat", "one-way latency (usec)", "latency"),
                                     ("bw", "bandwidth (MB/s)", "streaming bandwidth")):
            path = f"{out}/{'latency' if metric == 'lat' else 'bandwidth'}-{safe}.png"
            plot(provider, lanes, metric, ylabel, f"{what} ({sweep.get('title', '')})", path)
            print(path)


if __name__ == "__main__":
    main()
