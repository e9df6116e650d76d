"""The planner's tables (Markdown) and pictures (PNG)."""

from __future__ import annotations

from pathlib import Path

MODE_COLORS = {"sequential": "#1f77b4", "intra": "#ff7f0e", "inter": "#2ca02c", "oppo": "#d62728"}
PAPER = {"overall": (1.8, 2.8), "intra": (1.2, 1.3), "inter": (1.6, 2.06), "utilization": (1.4, 2.1)}


def _pct(x: float) -> str:
    return f"{x * 100:+.0f}%"


def validation_markdown(comparisons: list) -> str:
    lines = ["| workload | mode | measured | predicted | error | predicted, this sigma held out | error "
             "| of the mean step: measured / predicted | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        held = getattr(c, "held_out", None)
        for m in c.measured:
            if m == "sequential":
                continue
            h = f"{held[m]:.2f}x | {_pct(held[m] / c.measured[m] - 1)}" if held else "- | -"
            mm, pm = c.measured_mean.get(m), c.predicted_mean.get(m)
            mean = f"{mm:.2f}x / {pm:.2f}x | {_pct(pm / mm - 1)}" if mm and pm else "- | -"
            lines.append(f"| {c.label} | {m} | {c.measured[m]:.2f}x | {c.predicted[m]:.2f}x | {_pct(c.error(m))} | {h} "
                         f"| {mean} |")
    return "\n".join(lines)


def step_time_markdown(comparisons: list) -> str:
    lines = ["| workload | sequential step, measured / predicted (s) | " + " | ".join(
        f"{m}, measured / predicted (s)" for m in ("intra", "inter", "oppo")) + " |", "|---|---|---|---|---|"]
    for c in comparisons:
        cells = [f"{c.measured_s[m]:.3f} / {c.predicted_s[m]:.3f}" if m in c.measured_s else "-"
                 for m in ("sequential", "intra", "inter", "oppo")]
        lines.append(f"| {c.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def projection_markdown(summary: dict[str, dict]) -> str:
    lines = ["| mode | step time, mean (s) | speedup | busy: actor GPUs / scorer GPUs / all | decode share of step | "
             "off-policy tokens |", "|---|---|---|---|---|---|"]
    for m, v in summary.items():
        u = v["utilization"]
        busy = f"{u['actor_devices']:.2f} / {u.get('scorer_devices', float('nan')):.2f} / {u['all_devices']:.2f}"
        lines.append(f"| {m} | {v['step_time_mean_s']:.1f} | {v['speedup']:.2f}x | {busy} | "
                     f"{v['decode_share_of_step']:.2f} | {v['offpolicy_token_frac']:.0%} |")
    return "\n".join(lines)


def scale_markdown(rows: list[dict], modes=("intra", "inter", "oppo")) -> str:
    sigmas = sorted({r["sigma"] for r in rows})
    gpus = sorted({r["gpus"] for r in rows})
    lines = ["| GPUs (actor+scorer) | B | " + " | ".join(f"sigma {s:g}: " + " / ".join(modes) for s in sigmas) + " |",
             "|---|---|" + "---|" * len(sigmas)]
    for n in gpus:
        rs = {r["sigma"]: r for r in rows if r["gpus"] == n}
        first = next(iter(rs.values()))
        cells = [" / ".join(f"{rs[s][f'{m}_speedup']:.2f}" for m in modes) for s in sigmas]
        lines.append(f"| {n} ({first['placement']}) | {first['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_validation(comparisons: list, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 5.2), dpi=130)
    xs = []
    markers = ["o", "s", "^", "D", "v", "P", "X"]
    for i, c in enumerate(comparisons):
        for m in c.measured:
            if m == "sequential":
                continue
            ax.scatter(c.measured[m], c.predicted[m], color=MODE_COLORS[m], marker=markers[i % len(markers)], s=46,
                       edgecolor="black", linewidth=0.5, zorder=3)
            xs += [c.measured[m], c.predicted[m]]
    lo, hi = min(xs + [1.0]) - 0.05, max(xs) + 0.08
    t = [lo, hi]
    ax.plot(t, t, color="black", lw=1)
    ax.fill_between(t, [v * 0.85 for v in t], [v * 1.15 for v in t], color="0.85", zorder=0, label="within 15%")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured speedup over sequential (2 vCPUs)")
    ax.set_ylabel("planner's predicted speedup")
    ax.set_title("Planner vs oppo bench on CPU (median step time)", fontsize=10)
    from matplotlib.artist import Artist
    from matplotlib.lines import Line2D

    handles: list[Artist] = [Line2D([], [], marker="o", ls="", color=MODE_COLORS[m], markeredgecolor="black", label=m)
               for m in ("intra", "inter", "oppo")]
    handles += [Line2D([], [], marker=markers[i % len(markers)], ls="", color="white", markeredgecolor="black",
                       label=c.label) for i, c in enumerate(comparisons)]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="0.85", label="within 15%"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", framealpha=0.9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_projection(scale_rows: list[dict], sigma_rows: list[dict], path: Path, title: str) -> Path:
    """Left: oppo's projected speedup vs cluster size, one line per tail sigma. Right: every
    mode's speedup vs sigma on the paper's 8 GPUs, with the paper's reported ranges."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11.5, 4.6), dpi=130)
    sigmas = sorted({r["sigma"] for r in scale_rows})
    cmap = plt.get_cmap("viridis")
    for i, s in enumerate(sigmas):
        rs = sorted((r for r in scale_rows if r["sigma"] == s), key=lambda r: r["gpus"])
        color = cmap(i / max(1, len(sigmas) - 1) * 0.85)
        ax1.plot([r["gpus"] for r in rs], [r["oppo_speedup"] for r in rs], "-o", color=color, ms=4,
                 label=f"oppo, sigma {s:g}")
        ax1.plot([r["gpus"] for r in rs], [r["inter_speedup"] for r in rs], "--", color=color, lw=1,
                 label=f"inter, sigma {s:g}")
    ax1.axhspan(*PAPER["overall"], color="#d62728", alpha=0.08, label="paper: OPPO 1.8x-2.8x (8 GPUs)")
    ax1.set_xscale("log", base=2)
    gp = sorted({r["gpus"] for r in scale_rows})
    ax1.set_xticks(gp)
    ax1.set_xticklabels([str(g) for g in gp])
    ax1.set_xlabel("GPUs (7 actor + 1 scorer per node; 16 sequences per actor GPU)")
    ax1.set_ylabel("projected step-time speedup over sequential")
    ax1.set_title("Weak scaling (Delta = B/14, max_lag 1)", fontsize=10)
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7, ncol=2, loc="upper left")
    rs = sorted(sigma_rows, key=lambda r: r["sigma"])
    for m in ("intra", "inter", "oppo"):
        ax2.plot([r["sigma"] for r in rs], [r[f"{m}_speedup"] for r in rs], "-o", ms=4, color=MODE_COLORS[m], label=m)
    if all("oppo_tuned_speedup" in r for r in rs):
        ax2.plot([r["sigma"] for r in rs], [r["oppo_tuned_speedup"] for r in rs], ":o", ms=3,
                 color=MODE_COLORS["oppo"], label=rs[0].get("tuned_label", "oppo, tuned"))
    x1 = max(r["sigma"] for r in rs)
    # the paper's reported ranges, as bars beside the curves (they are not functions of sigma)
    for i, (key, m, label) in enumerate((("intra", "intra", "intra\nonly"), ("inter", "inter", "inter\nonly"),
                                         ("overall", "oppo", "OPPO"))):
        x = x1 + 0.2 + 0.13 * i
        lo, hi = PAPER[key]
        ax2.plot([x, x], [lo, hi], lw=7, color=MODE_COLORS[m], alpha=0.45, solid_capstyle="butt")
        ax2.text(x, hi + 0.03, label, fontsize=6.5, ha="center", va="bottom", color=MODE_COLORS[m])
    ax2.text(x1 + 0.33, 0.95, "paper's\nreported\nranges", fontsize=6.5, ha="center", va="bottom", color="0.3")
    ax2.set_xlim(min(r["sigma"] for r in rs) - 0.1, x1 + 0.55)
    top = max([PAPER["overall"][1]] + [v for r in rs + scale_rows for k, v in r.items() if k.endswith("_speedup")])
    for ax in (ax1, ax2):  # one scale for both panels
        ax.set_ylim(0.9, top + 0.25)
    ax2.set_xticks([r["sigma"] for r in rs])
    ax2.set_xlabel("tail heaviness sigma (log-normal response lengths, median 128, cap 1024)")
    ax2.set_ylabel("projected step-time speedup over sequential")
    ax2.set_title("The paper's setting: 8 GPUs (7+1), B = 112, Delta 8, max_lag 1", fontsize=10)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
