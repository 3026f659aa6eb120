"""The crossover chart of ``bench_vllm.py --only shaped``: TTFT against the link's measured
read rate, for recompute (no connector), ``always`` and ``auto``, medians with their ranges.

    python benchmarks/plot_shaped.py REPORT.json [OUT.png]   (default charts/vllm_shaped.png)

Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ARMS = (("recompute", "recompute (no connector)"), ("always", "always load"), ("auto", "auto"))


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__, file=sys.stderr)
        return 2
    report = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1]) if len(argv) == 2 else Path(__file__).parent / "charts" / "vllm_shaped.png"
    figures = report["figures"]
    rates = sorted(
        int(m.group(1))
        for name in figures
        if (m := re.fullmatch(r"shaped_(\d+)mbit_ttft_recompute_s", name))
    )
    if not rates:
        print(f"{argv[0]}: no shaped_<rate>mbit figures", file=sys.stderr)
        return 1
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    link = [figures[f"shaped_{r}mbit_link_read_mb_s"]["median"] for r in rates]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm, label in ARMS:
        med, lo, hi = [], [], []
        for r in rates:
            fig_ = figures[f"shaped_{r}mbit_ttft_{arm}_s"]
            med.append(fig_["median"])
            lo.append(fig_["median"] - fig_["min"])
            hi.append(fig_["max"] - fig_["median"])
        ax.errorbar(link, med, yerr=[lo, hi], marker="o", capsize=3, label=label)
    for r, x in zip(rates, link, strict=True):
        ax.annotate(
            f"{r} Mbit/s",
            (x, 0),
            textcoords="offset points",
            xytext=(0, 4),
            fontsize=7,
            ha="center",
        )
    ax.set_xscale("log")
    ax.set_xlabel("Mooncake read rate the link delivered (MB/s, measured)")
    ax.set_ylabel("TTFT of the stored prompt (s)")
    ax.set_title(
        "Load or recompute: real vLLM CPU engine,\nkvcore over a tc-shaped Mooncake link",
        fontsize=10,
    )
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
