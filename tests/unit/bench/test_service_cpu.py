"""bench.service's CPU accounting: only the benchmark's own process tree is read (a shared machine runs
other services, other Ray nodes), each process counted once, a reused pid as a new process."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.service import CLIENT_ROLE, ProcessCpu, cpu_by_role, process_tree_cpu

BURN = """
import sys, time
started = time.process_time()
while time.process_time() - started < 0.3:
    pass
print("burnt", flush=True)
sys.stdin.read()
"""


def test_cpu_by_role_counts_each_process_once_and_a_reused_pid_as_new() -> None:
    before = {
        1: ProcessCpu("ApiIngress", started=100, cpu_s=1.0),
        2: ProcessCpu("redis-server", started=200, cpu_s=5.0),
        3: ProcessCpu("Ray daemons", started=300, cpu_s=2.0),
    }
    after = {
        1: ProcessCpu("ApiIngress", started=100, cpu_s=1.5),
        2: ProcessCpu("redis-server", started=999, cpu_s=0.25),  # pid 2 ended and was reused
        4: ProcessCpu("ApiIngress", started=400, cpu_s=0.5),  # started meanwhile; pid 3 ended
    }
    assert cpu_by_role(before, after) == {"ApiIngress": 1.0, "redis-server": 0.25}


def test_the_tree_holds_this_process_and_its_children_and_nothing_else() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "burnt"
        tree = process_tree_cpu(client_pids={child.pid})
        child.stdin.close()
    assert tree[os.getpid()].role == CLIENT_ROLE
    assert tree[child.pid].role == CLIENT_ROLE and tree[child.pid].cpu_s >= 0.2
    assert os.getppid() not in tree and 1 not in tree  # the parent that started the tests is not counted
