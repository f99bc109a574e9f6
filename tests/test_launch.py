import sys
import time

from holmes_lightning.launch import launch
from holmes_lightning.topology import Topology

PRINT_RANK = "import os; print(os.environ['RANK'], os.environ['GROUP_RANK'], os.environ['LOCAL_RANK'], flush=True)"


def test_every_rank_gets_torchrun_variables(capfd):
    topology = Topology.from_config("single_node", devices_per_node=3)
    assert launch([sys.executable, "-c", PRINT_RANK], topology) == 0
    lines = sorted(capfd.readouterr().out.split("\n"))[-3:]
    assert lines == ["0 0 0", "1 0 1", "2 0 2"]


def test_one_failing_rank_stops_the_others(capfd):
    crash_rank_two = "import os, sys, time\nif os.environ['RANK'] == '2': sys.exit(7)\ntime.sleep(120)\n"
    start = time.monotonic()
    code = launch([sys.executable, "-c", crash_rank_two], Topology.from_config("two_cluster_mixed"), grace_s=5)
    assert code == 7
    assert time.monotonic() - start < 30
    assert "rank 2 on node B-node0 exited with code 7" in capfd.readouterr().err
