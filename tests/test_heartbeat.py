"""A long step says where it is (``oppo.run.heartbeat``): a line every so often while it runs, with
the stages that finished in it, and none once it ended or for a short step."""

from __future__ import annotations

import time

from oppo.run.heartbeat import status_line, step_heartbeat
from oppo.trace import Tracer


def test_the_line_names_the_step_its_time_and_its_finished_stages():
    tracer = Tracer()
    tracer.add("scorer", "score_reward", 3, 41.0, 50.8)
    tracer.add("actor", "generate", 3, 0.0, 40.0)
    tracer.add("actor", "generate", 3, 60.0, 61.0)  # a stage twice: its total, at its first start
    tracer.add("actor", "generate", 2, 0.0, 500.0)  # another step's: not this one's
    assert status_line(3, 125.4, tracer) == "[oppo] step 3 running for 2m05s; done in it: generate 41s, score_reward 9.8s"
    assert status_line(4, 3725, tracer) == "[oppo] step 4 running for 1h02m05s"
    assert status_line(3, 5, Tracer(enabled=False)) == "[oppo] step 3 running for 5.0s"


def test_lines_come_while_the_step_runs_and_stop_with_it():
    lines: list[str] = []
    with step_heartbeat(7, lines.append, None, every=0.02):
        time.sleep(0.3)
    assert lines and all(line.startswith("[oppo] step 7 running for ") for line in lines)
    n = len(lines)
    time.sleep(0.1)
    assert len(lines) == n, "a line after the step ended"
    with step_heartbeat(8, lines.append, None, every=30):  # a short step: no line
        pass
    assert len(lines) == n
