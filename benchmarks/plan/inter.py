"""Why inter-step overlap alone does not pay on the CPU, and where it does (issue 22, item 8).

    python benchmarks/plan/inter.py [--pair SEQ_RUN INTER_RUN ...] [--out benchmarks/plan/inter]

1. For each pair of measured runs of one workload (``sequential`` and ``inter``), the difference
   of their mean step times split into its causes (``oppo.plan.inter.breakdown``). By default the
   committed tail sweep (``benchmarks/latest/tail/sigma_*``) and, when the held-out validation has
   run (``runs/plan-heldout``), its natural-length and long-tail pairs.
2. The planner's answer to "where does it pay": inter's speedup per tail sigma with the CPU's
   fitted costs, with a GPU-like decode (batch size nearly free), and with decoding dominant
   (``oppo.plan.inter.regime``); and the roofline projection of the OPPO paper's setting.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "src"))

from oppo.plan.calibrate import CpuProfile, fit, load_run_dir, load_tail_sweep  # noqa: E402
from oppo.plan.inter import breakdown, breakdown_markdown, regime, regime_markdown  # noqa: E402
from oppo.plan.project import paper_setting, project, summarize  # noqa: E402


def _machine_of(path: Path) -> str:
    for p in (path / "meta.json", path.parents[2] / "bench.md" if len(path.parents) > 2 else None):
        if p is None or not p.is_file():
            continue
        if p.name == "meta.json":
            return json.loads(p.read_text())["machine"]
        for line in p.read_text().splitlines():
            if line.startswith("Machine:"):
                return line[len("Machine:"):].strip() + " (load not recorded)"
    return "unknown"


def findings(out: dict) -> list[str]:
    """The summary at the top of inter.md, from the figures below it."""
    lines = ["## Findings", ""]
    for p in out["pairs"]:
        s, i = p["sequential"], p["inter"]
        lines.append(
            f"- {p['label']}: inter {p['speedup']:.2f}x. Decoding is {s['decode'] / s['step']:.0%} of the sequential "
            f"step (training {s['train'] / s['step']:.0%}, scoring {s['score'] / s['step']:.0%}), so even free "
            f"decoding would give at most {1 / (1 - s['decode'] / s['step']):.2f}x. Inter runs "
            f"{1 - i['decode_steps'] / s['decode_steps']:.0%} fewer decode steps, but "
            f"{i['due_wait_steps'] / max(1e-9, i['decode_steps']):.0%} of its decode steps wait for a carried sequence "
            f"that max_lag 1 makes due, each decode step costs {i['s_per_decode_step'] / s['s_per_decode_step'] - 1:+.0%} "
            f"({i['rows_per_decode_step']:.0f} rows instead of {s['rows_per_decode_step']:.0f}), and the old "
            f"log-probs of carried rows add {(i['experience'] - s['experience']) * 1e3:.0f} ms per step.")
    rows = out["regime"]["rows"]
    names = [k for k in rows[0] if k != "sigma"]
    rng = lambda n, k: (min(r[n][k] for r in rows), max(r[n][k] for r in rows))  # noqa: E731
    lines += ["",
              f"- The planner, same workload: with the CPU's fitted costs inter alone gives "
              f"{rng(names[0], 'inter')[0]:.2f}-{rng(names[0], 'inter')[1]:.2f}x over sigma 0.5-2; with a GPU-like "
              f"decode (an extra row nearly free) {rng(names[1], 'inter')[0]:.2f}-{rng(names[1], 'inter')[1]:.2f}x; "
              f"with decoding also the dominant stage {rng(names[2], 'inter')[0]:.2f}-{rng(names[2], 'inter')[1]:.2f}x, "
              f"and {rng(names[2], 'inter_lag2')[0]:.2f}-{rng(names[2], 'inter_lag2')[1]:.2f}x when a carried sequence "
              "may wait two steps (max_lag 2, Delta 16). The paper's 1.6-2.06x for inter alone is reached only "
              "there: long-tailed lengths, decoding most of the step, a batch size that costs nearly nothing per "
              "extra row, and carried sequences not forced due at the very next step.",
              "- What is fixable in oppo and what is not: the CPU regime (decoding a third of the step, a decode "
              "step's cost growing with its rows) is the machine's; the due waits are the max_lag 1 default "
              "(a setting, measured here at 2 in the planner only); the off-policy recompute of carried rows is "
              "the price of correct importance weights and is small (tens of ms)."]
    return lines


def readme_snippet(out: dict) -> list[str]:
    """A table for the README's speed section: measured inter on the CPU, and the planner's regimes."""
    rows = out["regime"]["rows"]
    names = [k for k in rows[0] if k != "sigma"]
    measured = {round(float(p["label"].split("sigma ")[1].split(" ")[0]), 2): p["speedup"]
                for p in out["pairs"] if "tail sweep, sigma" in p["label"]}
    lines = ["## For the README's speed section", "",
             "Inter-step overlap alone (B = 32, Delta 8; lengths log-normal, median 10, capped at 128). Measured: "
             "`benchmarks/latest` tail sweep, 2 vCPUs, 3 timed steps (indicative). Planned: the simulator with the "
             "costs fitted on that sweep (so the CPU column is in-sample), then a GPU-like decode, then decoding "
             "dominant (see above).", "",
             "| tail sigma | measured, CPU | planned, CPU | planned, GPU-like decode | planned, GPU-like decode and "
             "decoding dominant | same, max_lag 2 and Delta 16 |", "|---|---|---|---|---|---|"]
    for r in rows:
        m = measured.get(round(r["sigma"], 2))
        lines.append(f"| {r['sigma']:g} | {f'{m:.2f}x' if m else '-'} | {r[names[0]]['inter']:.2f}x | "
                     f"{r[names[1]]['inter']:.2f}x | {r[names[2]]['inter']:.2f}x | {r[names[2]]['inter_lag2']:.2f}x |")
    lines.append("")
    return lines


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", nargs=2, action="append", default=[], metavar=("SEQ_RUN", "INTER_RUN"),
                    help="Run directories (config.yaml, metrics.jsonl, trace.json, lengths.jsonl) of one workload.")
    ap.add_argument("--bench", default=str(ROOT / "benchmarks/latest"), help="A bench with a tail sweep.")
    ap.add_argument("--heldout", default=str(ROOT / "runs/plan-heldout"), help="The held-out validation's runs.")
    ap.add_argument("--out", default=str(HERE / "inter"))
    ap.add_argument("--steps", type=int, default=40, help="Simulated steps per regime cell.")
    a = ap.parse_args(argv)
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    started = time.time()
    sweep = load_tail_sweep(a.bench)
    pairs = []
    for sigma in sorted({r.sigma for r in sweep}):
        seq = next(r for r in sweep if r.sigma == sigma and r.mode == "sequential")
        inter = next((r for r in sweep if r.sigma == sigma and r.mode == "inter"), None)
        if inter is not None:
            pairs.append((f"{Path(a.bench).name} tail sweep, sigma {sigma:g} (forced lengths, B=32)", seq, inter))
    held = Path(a.heldout)
    for name in ("natural-B32", "tail-B32"):
        s, i = held / f"{name}-sequential-r0", held / f"{name}-inter-r0"
        if (s / "meta.json").is_file() and (i / "meta.json").is_file():
            pairs.append((f"held-out validation, {name}", load_run_dir(s), load_run_dir(i)))
    for s, i in a.pair:
        pairs.append((f"{s} vs {i}", load_run_dir(s), load_run_dir(i)))
    out: dict = {"command": "python benchmarks/plan/inter.py " + " ".join(argv), "pairs": []}
    md = ["# Where inter-step overlap's time goes, and where it pays", "",
          f"Command: `{out['command']}`. Pure analysis of committed traces plus the planner (no new "
          "measurement).", "", "## 1. Measured: inter vs sequential, step by step", "",
          "Counts (decode steps, rows, due waits, carried and stale rows) are the planner's replay of each run, "
          "which is exact on one device (the schedule depends on the lengths only); seconds are the runs' trace "
          "spans, mean per timed step (the first step left out). *Cost per decode step* prices inter's decode "
          "steps at the difference of the measured seconds per decode step; *fewer decode steps* and *waiting "
          "for due rows* at sequential's seconds per decode step.", ""]
    for label, seq, inter in pairs:
        bd = breakdown(seq, inter)
        machine = _machine_of(Path(inter.path))
        out["pairs"].append({"label": label, "machine": machine, **bd})
        md += [breakdown_markdown(label, bd), "", f"Machine: {machine}. Timed steps: {len(inter.metrics) - 1}.", ""]
    profile = CpuProfile(fit(sweep))
    say("regime sweep")
    rows = regime(profile, steps=a.steps)
    out["regime"] = {"costs": profile.costs["together"].to_dict(), "rows": rows}
    md += ["## 2. Where inter-step overlap alone pays (the planner)", "",
           "B = 32, Delta 8, max_lag 1 (and max_lag 2 with Delta 16), log-normal lengths median 10 capped at 128 "
           f"(the tail sweep's; sigma 0.75 is the representative shape as `oppo bench --quick` scales it), "
           f"{a.steps} simulated steps, speedup of the mean step time. Costs: fitted on the tail sweep's sequential "
           f"and inter traces ({profile.costs['together'].describe()}). *GPU-like decode*: a decode step of 32 rows "
           "costs what it costs on the CPU, each extra row 2% of that (on a GPU a decode step reads the weights "
           "once for every row). *Decoding dominant*: the other stages at a quarter of their CPU cost, so decoding "
           "is about three quarters of the sequential step, as on a GPU with long responses.", "",
           regime_markdown(rows, 32, 8), ""]
    say("roofline projection")
    proj = []
    for sigma in (0.5, 1.0, 1.5):
        summ = summarize(project(paper_setting("h200", sigma=sigma), modes=("sequential", "inter"), steps=30))
        proj.append({"sigma": sigma, "inter": summ["inter"]["speedup"],
                     "decode_share": summ["sequential"]["decode_share_of_step"]})
    out["roofline"] = proj
    md += ["Roofline projection of the OPPO paper's setting (7B actor and reward model on 8 H200s, 7+1, B = 112, "
           "Delta 8, max_lag 1, responses median 128 capped at 1024; assumptions in `plan.md`), inter alone:", "",
           "| sigma | inter speedup | decode share of the sequential step |", "|---|---|---|"]
    md += [f"| {r['sigma']:g} | {r['inter']:.2f}x | {r['decode_share']:.0%} |" for r in proj]
    md.append("")
    md += readme_snippet(out)
    md[2:2] = findings(out) + [""]
    out["seconds"] = time.time() - started
    Path(f"{a.out}.json").write_text(json.dumps(out, indent=1, default=str))
    Path(f"{a.out}.md").write_text("\n".join(md))
    say(f"wrote {a.out}.md, {a.out}.json ({out['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
