"""`oppo bench` and `oppo report` on tiny models: the files users read are written and hold
the figures the issue asks for."""

import json
import math

import pytest

from oppo.bench import summarize
from oppo.cli import main
from oppo.trace import Span


@pytest.mark.slow
def test_bench_writes_json_markdown_and_pictures(tiny_models, tiny_prompts, tmp_path):
    out = tmp_path / "b"
    rc = main(["bench", "--steps", "2", "--out", str(out), "--tail", "0.5", "--tail-steps", "2",
               "--tail-modes", "sequential,oppo",  # (the whole sweep: test_bench_quick_on_the_builtin_task)
               f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
               f"data.prompts={tiny_prompts}", "ppo.batch_size=4", "ppo.minibatch_size=4",
               "ppo.micro_batch_size=4", "generation.max_new_tokens=12", "overlap.delta_max=2"])
    assert rc == 0
    res = json.loads((out / "bench.json").read_text())
    assert res["machine"]
    assert set(res["modes"]) == {"sequential", "intra", "inter", "oppo", "pipeline"}
    # the headline is the representative (long-tailed) workload; the task's own lengths are the second row
    assert [r["workload"].split(", ")[-1].split()[0] for r in res["stage_profile"]] == ["representative", "its"]
    assert res["workload_lengths"]["p99_over_p50"] >= 4
    for mode, v in res["modes"].items():
        assert v["step_time_median_s"] > 0
        assert {"actor", "scorer", "learner"} <= set(v["busy_fraction"])
        assert all(0.0 <= f <= 1.0 + 1e-9 for f in v["busy_fraction"].values())
    assert res["speedup"]["sequential"] == pytest.approx(1.0)
    assert len(res["tail_sweep"]) == 1 and "oppo" in res["tail_sweep"][0]["speedup"]
    assert "| oppo |" in (out / "bench.md").read_text()
    for png in ("timeline.png", "response_lengths.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the headline runs' lengths were forced: timing only, no reward curve (issue 22 item 3)
    assert not (out / "reward_vs_step.png").exists() and "Timing only" in (out / "bench.md").read_text()
    rc = main(["report", str(out / "natural" / "sequential"), "--out", str(tmp_path / "rep")])
    assert rc == 0 and (tmp_path / "rep" / "reward_vs_step.png").is_file()


def test_summarize_busy_fraction_and_speedup():
    # two modes, one measured step each (warmup=0). sequential: actor 0-2, scorer 2-3, learner 3-4
    # -> window 4 s, busy 2/4, 1/4, 1/4, busiest 2 s -> bubble 1 - 2/4 = 0.5.
    # oppo: actor 0-2, scorer 0.5-2.5 (overlapping), learner 2.5-3 -> window 3 s.
    def rec(spans, end):
        return {"metrics": [{"time/step": end, "perf/tokens_per_s": 10.0, "reward/mean": 0.5,
                             "response_length/mean": 5.0, "perf/cpu_util": 0.5}],
                "windows": {0: (0.0, end)}, "spans": spans}
    seq = rec([Span("actor", "generate", 0, 0, 2), Span("scorer", "score", 0, 2, 3),
               Span("learner", "train", 0, 3, 4)], 4.0)
    opp = rec([Span("actor", "decode", 0, 0, 2), Span("scorer", "score", 0, 0.5, 2.5),
               Span("learner", "train", 0, 2.5, 3)], 3.0)
    s = summarize({"sequential": seq, "oppo": opp}, warmup=0)
    assert s["modes"]["sequential"]["busy_fraction"] == pytest.approx({"actor": 0.5, "scorer": 0.25, "learner": 0.25})
    assert s["modes"]["sequential"]["bubble_ratio"] == pytest.approx(0.5)
    assert s["speedup"]["oppo"] == pytest.approx(4.0 / 3.0)
    # busiest worker: sequential 2/4 = 0.5; oppo max(2/3, 2/3) -> ratio (2/3)/0.5
    assert s["busiest_busy_ratio"]["oppo"] == pytest.approx((2 / 3) / 0.5)
    assert s["modes"]["oppo"]["time_to_target_s"] == pytest.approx(3.0)


def test_representative_workload_is_long_tailed():
    """The named preset the GPU bench headlines: p99/p50 >= 4 and a maximum in the hundreds."""
    from oppo.bench import WORKLOADS

    w = WORKLOADS["representative"]
    st = w.stats(seed=0)
    assert st["p99_over_p50"] >= 4.0
    assert 100 <= st["max"] <= 999 and st["max"] <= w.max_new_tokens
    assert st["p50"] == pytest.approx(w.median, abs=1)
    small = w.scaled(64).stats(seed=0)  # the smoke's copy keeps the shape
    assert small["p99_over_p50"] >= 4.0 and small["max"] <= 64


def test_stage_profile_shares_and_lengths():
    # sequential, 3 steps, the first a warm-up: generate 6/8 s, score 1/1 s, train 1/3 s, step 8/12 s
    # -> medians 7, 1, 2, 10 -> shares 0.7, 0.1, 0.2; lengths of steps 1-2: 1..100 -> p50 50.5, max 100
    from oppo.bench import stage_profile, stage_profile_markdown

    def m(g, s, t):
        return {"time/generate": g, "time/score": s, "time/train": t, "time/step": g + s + t}
    rec = {"sequential": {"metrics": [m(50, 5, 5), m(6, 1, 1), m(8, 1, 3)],
                          "lengths": [[999], list(range(1, 51)), list(range(51, 101))]}}
    p = stage_profile(rec, "w")
    assert (p["generate_s"], p["score_s"], p["train_s"], p["step_s"]) == (7, 1, 2, 10)
    assert p["generate_share"] == pytest.approx(0.7) and p["train_share"] == pytest.approx(0.2)
    assert p["largest"] == "generate"
    assert p["length_p50"] == pytest.approx(50.5) and p["length_max"] == 100 and p["sequences"] == 100
    text = "\n".join(stage_profile_markdown([p]))
    assert "| w | 10.00 | 7.00 s (70%) | 1.00 s (10%) | 2.00 s (20%) | generate |" in text
    assert "as in real RLHF" in text


def test_forced_workload_sets_the_main_runs_lengths(tiny_models, tiny_prompts, tmp_path):
    """run_modes with a LengthWorkload trains exactly the sampler's lengths (EOS forced there)."""
    from oppo.bench import LengthWorkload, run_modes
    from oppo.config import load_config, with_overrides

    w = LengthWorkload("t", sigma=0.75, median=4, max_new_tokens=16, description="test")
    cfg = load_config(None, [f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
                             f"data.prompts={tiny_prompts}", "ppo.batch_size=4", "ppo.minibatch_size=4",
                             "ppo.micro_batch_size=4", "generation.max_new_tokens=16", "placement.threads=1",
                             "log.progress=false", "run.samples=0"])
    rec = run_modes(cfg, ["sequential"], 2, tmp_path, progress=lambda s: None, lengths=w)["sequential"]
    sampler = w.sampler(cfg.run.seed)
    assert rec["lengths"] == [[sampler(i) for i in range(4)], [sampler(i) for i in range(4, 8)]]
    assert len(set(rec["lengths"][0] + rec["lengths"][1])) > 2
    # forced lengths are not samples of the policy: the runs are timing-only (issue 22 item 3), no
    # learning metric reaches the records, metrics.jsonl, bench.json or bench.md; but the losses and
    # gradient norms do, finite (issue 26: the guard's numbers)
    from oppo.bench import summarize, to_markdown
    from oppo.metrics import read_metrics

    for ms in (rec["metrics"], read_metrics(tmp_path / "sequential")):
        assert not [k for m in ms for k in m if k.startswith(("reward/", "kl/", "ppo/", "value/"))
                    or k.startswith("loss/") and k not in ("loss/policy", "loss/value")]
        assert all(math.isfinite(m[k]) for m in ms for k in ("loss/policy", "loss/value", "grad_norm/actor",
                                                              "grad_norm/critic"))
        assert all(m["bench/timing_only"] == 1 for m in ms)
        assert all("time/step" in m and "response_length/mean" in m for m in ms)
    res = summarize({"sequential": rec})
    assert res["modes"]["sequential"]["reward_last"] is None and res["target_reward"] is None
    md = to_markdown({**res, "machine": "m", "command": "c", "workload": "w", "steps": 2, "settings": ""})
    assert "Timing only" in md and "Target reward" not in md
    # groups: each member of a group draws its own length (member 0 keeps the prompt's)
    grouped = with_overrides(cfg, ["algo.name=grpo", "algo.group_size=2"])
    rec = run_modes(grouped, ["sequential"], 1, tmp_path / "g", progress=lambda s: None, lengths=w)["sequential"]
    assert sorted(rec["lengths"][0]) == sorted(sampler(p, m) if m else sampler(p) for p in range(2) for m in range(2))
    assert sampler(0, 0) == sampler(0) and any(sampler(p) != sampler(p, 1) for p in range(4))


def _gpu_bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_bench.py"
    spec = importlib.util.spec_from_file_location("gpu_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_gpu_bench_smoke_on_cpu(tmp_path):
    """benchmarks/gpu_bench.py --device cpu --tiny: models from config, all four modes, the files
    the GPU run writes, the stage profile's two rows."""
    import importlib.util
    from pathlib import Path

    mod = _gpu_bench()
    out = tmp_path / "gpu"
    # one mode at a time: the schedule the GPU run takes (oppo bench covers the interleaved one)
    assert mod.main(["--device", "cpu", "--tiny", "--schedule", "one-at-a-time", "--out", str(out)]) == 0
    res = json.loads((out / "bench.json").read_text())
    assert set(res["modes"]) == {"sequential", "intra", "inter", "oppo", "pipeline"}
    assert res["machine"] and res["steps"] == 2 and res["schedule"] == "one mode at a time"
    assert all(v["backend"].startswith("eager (generation.backend=auto") for v in res["modes"].values())
    assert [r["workload"].split()[0] for r in res["stage_profile"]] == ["representative", "short"]
    assert res["workload_lengths"]["p99_over_p50"] >= 4
    md = (out / "bench.md").read_text()
    assert "## Stage profile" in md and "| oppo |" in md
    # issue 27: each stage's utilisation, the padded share and the decode overhead, per mode
    assert "## Hardware use" in md
    for mode, v in res["modes"].items():
        hw = v["hardware"]
        assert hw["peak_tflops"] > 0 and 0 < hw["train_mfu"] and 0 <= hw["train_padded_frac"] < 1, mode
        assert hw["backend_step_ms"] > 0, mode
        # pipeline: the timed (last) step may take no decode step of its own (every row finished
        # while the previous update ran, as it does on a loaded machine); then there is no overhead
        if mode != "pipeline" or "decode_step_ms" in hw:
            assert hw["decode_overhead"] > 0, mode
    for png in ("timeline.png", "response_lengths.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # forced lengths: timing only (issue 22 item 3), no reward curve
    assert "Timing only" in md and not (out / "reward_vs_step.png").exists()


def test_gpu_bench_check_names_engine_mode_step_and_metric(tmp_path, monkeypatch, capsys):
    """gpu_bench --check: a child per engine and mode; a non-finite metric or weight, an exception,
    or a child that dies without a result fails its row (engine, mode, step, metric named), the
    other combinations still run, and the exit code is 1. The children and their trainers are
    fakes here (a real CPU --check of every mode takes about 80 s)."""
    import math
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    mod = _gpu_bench()
    policy, critic = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    trainer = SimpleNamespace(models=lambda: {"policy": policy, "critic": critic},
                              roles=SimpleNamespace(rollout_policy=policy, backend="static with CUDA graphs"))
    import dataclasses

    from oppo.api.roles import Roles

    assert set(vars(trainer.roles)) <= {f.name for f in dataclasses.fields(Roles)}  # the stand-in holds real fields
    assert mod.non_finite({"loss/policy": 0.5, "grad_norm/actor": math.nan, "kl/mean": -math.inf, "n": 3}) == \
        ["grad_norm/actor", "kl/mean"]
    assert mod.non_finite_weights(trainer) == []
    with torch.no_grad():
        critic.bias[0] = math.inf
    assert mod.non_finite_weights(trainer) == ["critic.bias"]

    def fake_run_modes(cfg, modes, steps, out, on_step, **kw):  # what check_one drives: its guard sees each step
        for step in range(steps):
            on_step(modes[0], step, {"loss/policy": 0.1, "grad_norm/critic": math.nan if step == 1 else 1.0}, trainer)

    monkeypatch.setattr(mod, "run_modes", fake_run_modes)
    monkeypatch.setattr(mod, "load_config", lambda path, settings: None)
    with torch.no_grad():
        critic.bias[0] = 0.0
    assert mod.check_one("static:oppo", [], 3, None, tmp_path / "one", print) == 1
    row = json.loads((tmp_path / "one" / "check.json").read_text())
    assert (row["ok"], row["steps"], row["ran"]) == (False, 1, "static with CUDA graphs")
    assert "step 1" in row["error"] and "grad_norm/critic=nan" in row["error"]

    def child(cmd):  # eager/inter: passes; static/oppo: a non-finite metric; static/inter: dies with no result
        engine, mode = cmd[cmd.index("--check-one") + 1].split(":", 1)
        where = Path(cmd[cmd.index("--out", cmd.index("--check-one")) + 1])
        assert "--check" not in cmd and cmd[cmd.index("--models") + 1] == str(tmp_path / "models")
        if (engine, mode) != ("static", "inter"):
            where.mkdir(parents=True, exist_ok=True)
            ok = (engine, mode) != ("static", "oppo")
            where.joinpath("check.json").write_text(json.dumps(
                {"engine": engine, "mode": mode, "steps": 3 if ok else 2, "ok": ok, "ran": engine,
                 "error": None if ok else "NonFinite: step 2: non-finite loss/value=nan"}))
        return SimpleNamespace(returncode=0 if (engine, mode) == ("eager", "inter") else 1)

    code = mod.check_all(["--device", "cpu", "--check"], ["inter", "oppo"], tmp_path / "all", tmp_path / "models",
                         lambda s: None, run=child)
    assert code == 1
    table = capsys.readouterr().out
    assert "| eager | inter | pass | 3 |" in table and "| eager | oppo | pass |" in table
    assert "| static | oppo | FAIL | 2 | static | NonFinite: step 2: non-finite loss/value=nan |" in table
    assert "| static | inter | FAIL | 0 |" in table and "exited with code 1 and no result" in table
    assert "FAILED: 2 of 4: static / inter; static / oppo" in table
    assert json.loads((tmp_path / "all" / "check.json").read_text())["rows"][0]["ok"]


def test_gpu_bench_check_one_drives_a_real_trainer(builtin_task, tmp_path):
    """The guard of ``gpu_bench --check`` reads a real Trainer (one eager step of the built-in task on
    the CPU): what it reads of the trainer and its roles exists. The test above drives it with a
    stand-in, which hid that it read ``roles.engine``, a field Roles no longer had: the GPU session's
    check part would have failed every combination."""
    mod = _gpu_bench()
    assert mod.check_one("eager:sequential", ["log.progress=false"], 1, None, tmp_path, lambda s: None) == 0
    row = json.loads((tmp_path / "check.json").read_text())
    assert (row["ok"], row["steps"], row["error"]) == (True, 1, None)
    assert row["ran"].startswith("eager")  # the backend that ran, as the run's log names it


def test_bench_quick_on_the_builtin_task(builtin_task, tmp_path, capsys):
    """``make bench``'s command, ``oppo bench --quick``, on the built-in task (prepared at its tiny
    sizes: 256 positions), shortened by its own flags only (fewer steps, one sigma): the settings
    resolve as the user's command resolves them. The representative workload's maximum (512) does
    not fit the models' positions after the longest prompt: it is clipped to what fits, said on
    the console, and the run measures (issue 53: it stopped at the prompt-length check)."""
    from oppo.models import context_length, load_model_config

    out = tmp_path / "b"
    rc = main(["bench", "--quick", "--steps", "2", "--tail", "0.5", "--tail-steps", "2", "--tail-modes", "sequential,oppo",
               "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "bench.json").read_text())
    positions = context_length(load_model_config(str(builtin_task.prepared.policy_path), "policy"))[0]
    longest = max(len(ids) for ids in _builtin_prompt_ids(builtin_task))
    assert res["workload_lengths"]["max"] <= positions - longest < 512
    assert f"generation.max_new_tokens={positions - longest}" in capsys.readouterr().err
    assert set(res["modes"]) == {"sequential", "intra", "inter", "oppo", "pipeline"}
    assert all(v["step_time_median_s"] > 0 for v in res["modes"].values())
    assert res["workload_lengths"]["p99_over_p50"] >= 4  # still long-tailed


def _builtin_prompt_ids(builtin):
    from oppo.config import load_config
    from oppo.data import build_prompt_set, read_records
    from oppo.models import load_tokenizer

    cfg = load_config(None, [])
    texts = read_records(str(builtin.prepared.prompts_path)).texts
    return build_prompt_set(texts, load_tokenizer(str(builtin.prepared.policy_path)), cfg.data, 0).ids


def test_every_benchmark_script_imports_names_that_exist():
    """The scripts under ``benchmarks/`` (most of them run only on a GPU, or by hand) import from oppo
    only modules and names that exist: a rename in the package fails here, in CI, not on a lent GPU's
    minutes. Modules of an optional package that is not installed (vLLM, Ray) are passed over."""
    import ast
    import importlib
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "benchmarks"
    scripts = sorted(root.rglob("*.py"))
    assert len(scripts) > 20  # (the folder is there: this checks something)
    missing = []
    for p in scripts:
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("oppo"):
                wanted = [(node.module, a.name) for a in node.names if a.name != "*"] or [(node.module, None)]
            elif isinstance(node, ast.Import):
                wanted = [(a.name, None) for a in node.names if a.name.startswith("oppo")]
            else:
                continue
            for module, name in wanted:
                try:
                    m = importlib.import_module(module)
                except ModuleNotFoundError as e:
                    top = (e.name or "").split(".")[0]
                    if top in ("vllm", "ray") and importlib.util.find_spec(top) is None:
                        continue  # (an optional package this machine lacks)
                    missing.append(f"{p.relative_to(root)}: {module} ({e})")
                    continue
                if name is not None and not hasattr(m, name) and importlib.util.find_spec(f"{module}.{name}") is None:
                    missing.append(f"{p.relative_to(root)}: {module}.{name}")
    assert not missing, "benchmark scripts import what oppo no longer has:\n" + "\n".join(missing)
