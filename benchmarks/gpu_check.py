"""The first command to run when a GPU is lent: everything open, in one call of at most eight minutes.

    PYTHONPATH=src bash benchmarks/gpu_check.sh             (device run: timeout_s 480; results in $OUT/gpu_check)
    SMOKE=1 PYTHONPATH=src bash benchmarks/gpu_check.sh     (the CPU smoke: tiny sizes, every part; CI runs it)
    ONLY="attention bench" ... / SKIP="gpu_tests" ...       (a rerun of some parts)

A lent GPU gives 15 minutes in all, machine start included, and 10 at most per command. This call
fits 480 s with every build included: each part runs under its own ``timeout`` (coreutils, which
kills the part's whole process group), the timeouts sum to at most :data:`BUDGET_S` (460 s), a part
never runs past what is left of it, and each part's output is written as soon as it ends (its log
appended to ``parts.log``, its result files copied flat beside it, the summary table rewritten), so a
part that runs out of time loses nothing before it. At the end it prints the summary table and the
results, and exits 1 when a part failed (rc not 0, or its result check found a problem).

The parts, in order (:data:`PARTS`):

a. ``versions``: torch, CUDA, cuDNN, transformers, the device and whether torch puts cuDNN first;
b. ``attention``: ``benchmarks/attention_check.py``, no trainer: cuDNN, memory-efficient, the
   grouped-K/V decode path and the varlen path (where ``oppo.kernels.varlen`` exists) at the learner's shapes
   and a decode case: first-call and steady ms, error against the math path, finite gradients at a
   width 64 mod 128 (``attention.md``, ``attention.json``);
c. ``gpu_tests``: ``pytest -m gpu`` (the scorer slots' CUDA graphs, masked rows, decode graphs, bf16
   paths, ``tests/test_gpu.py`` and the files it names);
d. ``bench``: ``gpu_bench.py`` at 1B + 125M, B = 64, oppo first and then sequential, 6 steps each
   (the first untimed; the 1B NaN appeared after the third update), then every step's metrics
   checked finite and counted (at least 5 a mode) from the runs' ``metrics.jsonl`` (``bench.md``,
   ``bench.json``);
e. ``profile``: ``gpu_profile.py --mode oppo --no-ab``: one profiled oppo step (the scorer slots and
   their graphs visible), reusing the bench's models (``profile.md``, ``profile.json``).

``SMOKE=1`` runs every part on the CPU with tiny sizes (the GPU tests collected and skipped: "skipped:
no CUDA"), so a typo or a NaN placeholder costs CI seconds, not the GPU's minutes;
``tests/test_gpu_session.py`` runs it. ``benchmarks/gpu_session.sh`` stays for a longer loan.
This script imports no torch: its parts do, each in a process of its own.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 460
"""The parts' timeouts together: 20 s under the 480 s of the call, for this script and the table."""
MODES = ("oppo", "sequential")
"""The bench's modes, in this order (the figure the goals are about first)."""

def versions() -> None:
    """Part (a): the versions and the device (``--versions``, in a process of its own)."""
    import platform
    from importlib.metadata import version

    import torch

    from oppo.kernels import attention

    print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
          "| cuDNN", torch.backends.cudnn.version(), "| transformers", version("transformers"), flush=True)
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(0)
        mib = torch.cuda.get_device_properties(0).total_memory // 2**20
        print("device", torch.cuda.get_device_name(0), f"sm_{cap[0]}{cap[1]}, {mib} MiB")
        why = attention.cudnn_refusal(torch.backends.cudnn.version(), cap, torch.version.cuda)
        print("torch puts cuDNN SDPA first:", why is None, "" if why is None else f"({why})")
    else:
        print("device: no CUDA (cpu)")


@dataclass
class Part:
    """One part: its command (``SMOKE`` or not), timeout, files copied to the output, result check."""

    name: str
    timeout_s: int
    command: Callable[[bool, Path], list[str]]
    files: tuple[str, ...] = ()
    check: Callable[[bool, Path], list[str]] | None = None
    """Problems found in the part's results (``smoke``, ``work``): any fails the part."""
    note: Callable[[bool], str] = field(default=lambda smoke: "")


def _bench_problems(smoke: bool, work: Path, min_steps: int | None = None) -> list[str]:
    """Every step of every bench mode finite (``metrics.jsonl`` writes a non-finite metric as null),
    and at least ``min_steps`` steps a mode (5 on the GPU, 2 in the smoke)."""
    need = min_steps or (2 if smoke else 5)
    bad = []
    for mode in MODES:
        path = work / "bench" / "runs" / mode / "metrics.jsonl"
        if not path.is_file():
            bad.append(f"{mode}: no {path.name}")
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if len(rows) < need:
            bad.append(f"{mode}: {len(rows)} steps, fewer than {need}")
        for r in rows:
            nulls = sorted(k for k, v in r.items() if v is None or (isinstance(v, float) and not math.isfinite(v)))
            if nulls:
                bad.append(f"{mode} step {r.get('step')}: non-finite {', '.join(nulls[:6])}")
    return bad


def _profile_problems(smoke: bool, work: Path) -> list[str]:
    """The profile written, its figures finite, its step windows there."""
    path = work / "profile" / "profile.json"
    if not path.is_file():
        return ["no profile.json"]
    def refuse(c):
        raise ValueError(c)
    try:
        prof = json.loads(path.read_text(), parse_constant=refuse)
    except ValueError as e:
        return [f"profile.json holds a non-finite number ({e})"]
    windows = prof.get("baseline", {}).get("windows", {})
    return [] if "step" in windows else [f"profile.json: no step window ({sorted(windows)})"]


SMOKE_SETTINGS = ["placement.local.scorer_process=false", "ppo.shape_buckets=on"]
"""The smoke's settings: every role in one process, and the bucketed road a GPU takes by default (auto
resolves buckets off on the CPU): bucketed rows, scorer slots (docs/gpu-shapes.md)."""


def _sizes(smoke: bool) -> list[str]:
    return ["--device", "cpu", "--tiny"] if smoke else ["--policy-size", "1b", "--reward-size", "125m"]


def _py() -> str:
    return os.environ.get("PYTHON") or sys.executable


PARTS = (
    Part("versions", 30, lambda smoke, work: [_py(), "benchmarks/gpu_check.py", "--versions"]),
    Part("attention", 60, lambda smoke, work: [
        _py(), "benchmarks/attention_check.py", "--out", str(work / "attention"),
        *(["--device", "cpu", "--tiny"] if smoke else [])], files=("attention/attention.md", "attention/attention.json")),
    Part("gpu_tests", 60, lambda smoke, work: [
        _py(), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py",
        *([] if smoke else ["tests/test_masked_rows.py", "tests/test_fastdecode.py", "tests/test_shapes.py",
                            "tests/test_attention.py"])],
         note=lambda smoke: "skipped: no CUDA (collected and skipped)" if smoke else ""),
    Part("bench", 195, lambda smoke, work: [
        _py(), "benchmarks/gpu_bench.py", *_sizes(smoke), "--batch", "8" if smoke else "64",
        "--steps", "2" if smoke else "6", "--modes", ",".join(MODES), "--no-short-row",
        "--budget-min", "3" if smoke else "3.05", "--out", str(work / "bench"), "--models", str(work / "models"),
        *(SMOKE_SETTINGS if smoke else [])],
         files=("bench/bench.md", "bench/bench.json"), check=_bench_problems),
    Part("profile", 115, lambda smoke, work: [
        _py(), "benchmarks/gpu_profile.py", *_sizes(smoke), "--mode", "oppo", "--no-ab",
        *(["--batch", "4"] if smoke else []), "--out", str(work / "profile"), "--work", str(work / "profile_work"),
        "--models", str(work / "models"), *(SMOKE_SETTINGS if smoke else [])],
         files=("profile/profile.md", "profile/profile.json"), check=_profile_problems),
)
assert sum(p.timeout_s for p in PARTS) <= BUDGET_S


@dataclass
class Row:
    name: str
    status: str
    seconds: float
    detail: str = ""


def run(out: Path, work: Path, smoke: bool, only: set[str], skip: set[str], say=print) -> int:
    """Every part in order (module docstring); returns the exit status (1 when a part failed)."""
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    log = out / "parts.log"
    log.write_text("")
    rows: list[Row] = []
    started = time.time()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONUNBUFFERED": "1"}
    if smoke:
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # one thread each, as the tiny runs set
    for key in [k for k in env if k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))]:
        env.pop(key)  # (the gpu_tests part runs pytest: not as a caller's xdist worker)
    failed = False
    for part in PARTS:
        if (only and part.name not in only) or part.name in skip:
            rows.append(Row(part.name, "skipped (ONLY/SKIP)", 0.0))
            _summary(out, rows, smoke, started)
            continue
        left = BUDGET_S - (time.time() - started)
        limit = int(min(part.timeout_s, left))
        if limit < 5:
            rows.append(Row(part.name, "failed: no time left", 0.0))
            failed = True
            _summary(out, rows, smoke, started)
            continue
        cmd = part.command(smoke, work)
        t0 = time.time()
        with log.open("a") as f:
            f.write(f"===== {part.name} (timeout {limit} s): {' '.join(cmd)}\n")
            f.flush()
            rc = subprocess.run(["timeout", "-k", "5", str(limit), *cmd], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT).returncode
        seconds = time.time() - t0
        problems = [] if rc != 0 or part.check is None else part.check(smoke, work)
        for rel in part.files:
            src = work / rel
            if src.is_file():
                shutil.copy(src, out / src.name)
        status = ("ok" if rc == 0 and not problems else
                  f"failed: timed out after {limit} s" if rc in (124, 137) else
                  f"failed: rc {rc}" if rc else "failed: " + "; ".join(problems[:4]))
        if status == "ok" and part.note(smoke):
            status = f"ok, {part.note(smoke)}"
        failed |= not status.startswith("ok")
        rows.append(Row(part.name, status, seconds, " ".join(cmd[1:])))
        with log.open("a") as f:
            f.write(f"===== {part.name}: {status}, {seconds:.0f} s\n" + "".join(f"  {p}\n" for p in problems))
        _summary(out, rows, smoke, started)
        say(f"gpu_check: {part.name}: {status} ({seconds:.0f} s)")
    text = _summary(out, rows, smoke, started)
    say(text)
    for name in ("attention.md", "bench.md", "profile.md"):
        if (out / name).is_file():
            say("\n".join((out / name).read_text().splitlines()[:60]))
    say(text.splitlines()[-1])
    return 1 if failed else 0


def _summary(out: Path, rows: list[Row], smoke: bool, started: float) -> str:
    """The one summary table, rewritten after every part (``summary.md``)."""
    versions = ""
    log = out / "parts.log"
    if log.is_file():
        m = re.search(r"^python .*$\n(?:^device .*$\n)?(?:^torch puts .*$\n)?", log.read_text(), re.M)
        versions = m.group(0).strip() if m else ""
    lines = [f"# gpu_check{' (SMOKE: CPU, tiny sizes)' if smoke else ''}, {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
             "", versions, "", "| part | status | seconds | command |", "|---|---|---|---|"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.0f} | `{r.detail}` |" for r in rows]
    bad = [r.name for r in rows if not r.status.startswith(("ok", "skipped"))]
    lines += ["", f"gpu_check: {len(rows)} parts in {time.time() - started:.0f} s; "
                  + (f"FAILED: {', '.join(bad)}" if bad else "every part ok")]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="Results (default $OUT/gpu_check, else /tmp/gpu_check).")
    p.add_argument("--work", default=None, help="Models and runs (default $WORK, else /tmp/gpu_check_work).")
    p.add_argument("--smoke", action="store_true", default=bool(os.environ.get("SMOKE")), help="As SMOKE=1.")
    p.add_argument("--versions", action="store_true", help="Part (a) alone: print the versions and the device.")
    args = p.parse_args(argv)
    if args.versions:
        versions()
        return 0
    out = Path(args.out or os.path.join(os.environ.get("OUT") or "/tmp", "gpu_check"))
    work = Path(args.work or os.environ.get("WORK") or "/tmp/gpu_check_work")
    only = set(os.environ.get("ONLY", "").split())
    skip = set(os.environ.get("SKIP", "").split())
    unknown = (only | skip) - {p.name for p in PARTS}
    if unknown:
        raise SystemExit(f"gpu_check: ONLY/SKIP name no part {sorted(unknown)}; the parts: "
                         f"{', '.join(p.name for p in PARTS)}")
    return run(out, work, args.smoke, only, skip, say=lambda s: print(s, flush=True))


if __name__ == "__main__":
    raise SystemExit(main())
