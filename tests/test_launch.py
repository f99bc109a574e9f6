import re
import subprocess
import sys

import pytest
from distributed import deadline, one_rank_fails_while_the_others_wait

from holmes_lightning.cli.launch import main
from holmes_lightning.launch.processes import launch
from holmes_lightning.topology import Topology

PRINT_RANK = (  # one write per line, as PRINT_CLUSTER below
    "import os; env = os.environ; os.write(1, f\"{env['RANK']} {env['GROUP_RANK']} {env['LOCAL_RANK']}\\n\".encode())"
)


def test_every_rank_gets_torchrun_variables(capfd):
    topology = Topology.from_config("single_node", devices_per_node=3)
    assert launch([sys.executable, "-c", PRINT_RANK], topology) == 0
    lines = sorted(capfd.readouterr().out.split("\n"))[-3:]
    assert lines == ["0 0 0", "1 0 1", "2 0 2"]


def test_one_failing_rank_stops_the_others(capfd, tmp_path):
    crash_rank_two = one_rank_fails_while_the_others_wait(2, "sys.exit(7)", tmp_path)
    with deadline(120, "a launch whose ranks wait until they are stopped"):
        code = launch(crash_rank_two, Topology.from_config("two_cluster_mixed"), grace_s=5)
    assert code == 7
    err = capfd.readouterr().err
    assert "rank 2 on node B-node0 exited with code 7" in err
    assert sorted(re.findall(r"rank (\d) stopped by SIGTERM", err)) == ["0", "1", "3"]


PRINT_CLUSTER = (  # one write per line: the 8 ranks share the test's stdout, and print() writes text and newline apart
    "import json, os; spec = json.loads(os.environ['HOLMES_TOPOLOGY'])['spec']; "
    "os.write(1, f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} devices_per_node "
    "{spec['devices_per_node']}\\n\".encode())"
)


def test_holmes_launch_runs_any_command_with_cluster_overrides(capfd):
    assert (
        main(["cluster=two_cluster_mixed", "cluster.devices_per_node=2", "--", sys.executable, "-c", PRINT_CLUSTER])
        == 0
    )
    out = capfd.readouterr().out
    assert "holmes-launch: 8 ranks of 'two_cluster_mixed' (loopback)" in out
    assert sorted(line for line in out.splitlines() if line.startswith("rank")) == sorted(
        f"rank {rank} of 8 devices_per_node 2" for rank in range(8)
    )


PRINT_SITE = (
    "import os; e = os.environ; "
    "os.write(1, f\"rank {e['RANK']} of {e['WORLD_SIZE']} site {e['HOLMES_SITE']} of {e['HOLMES_SITES']}\\n\".encode())"
)


def test_holmes_launch_starts_each_site_as_a_job_of_its_own(capfd):
    assert main(["cluster=multi_site", "sites=A|B|C", "--", sys.executable, "-c", PRINT_SITE]) == 0
    ranks = sorted(line for line in capfd.readouterr().out.splitlines() if line.startswith("rank"))
    assert ranks == sorted(f"rank {r} of 2 site {site} of A|B|C" for site in "ABC" for r in range(2))


def test_holmes_launch_help(capsys):
    assert main(["--help"]) == 0
    assert "holmes-launch cluster=NAME" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["cluster=two_cluster_mixed"], "give the command to run after `--`"),
        (["--", "CMD"], "You must specify 'cluster', e.g, cluster=<OPTION>; Available options: base_cluster,"),
        (["cluster=nope", "--", "CMD"], "Could not find 'cluster/nope'"),
        (["cluster=two_cluster_mixed", "cluster.foo=1", "--", "CMD"], "Could not override 'cluster.foo': Key 'foo'"),
        (["cluster=two_cluster_mixed", "cluster.devices_per_node=0", "--", "CMD"], "cluster.devices_per_node=0: must"),
        (["cluster=two_cluster_mixed", "lab=emulate", "lab.bandwidth_scale=-1", "--", "CMD"], "lab.bandwidth_scale"),
        (["cluster=two_cluster_mixed", "lab.mode=netns", "--", "CMD"], "lab.mode=netns: Invalid value 'netns'"),
        (["cluster=multi_site", "sites=A|C", "--", "CMD"], "sites='A|C' is not a way the links of cluster"),
        (["cluster=ib_only", "sites=auto", "--", "CMD"], "cluster 'ib_only' is one site"),
    ],
)
def test_holmes_launch_bad_input_is_one_error_line_before_anything_starts(args, message, capfd, tmp_path):
    started = tmp_path / "started"
    command = [sys.executable, "-c", f"open({str(started)!r}, 'w')"]
    args = [*args[:-1], *command] if args[-1] == "CMD" else args
    assert main(args) == 2
    out, err = capfd.readouterr()
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not out and not started.exists()


EXIT_ORDER = """
import atexit, gc
from holmes_lightning.launch.shutdown import skip_exit_collections

atexit.register(lambda: print("frozen at the last handler:", gc.get_freeze_count() > 0, flush=True))
skip_exit_collections()
atexit.register(lambda: print("frozen at a later handler:", gc.get_freeze_count() > 0, flush=True))


class Garbage:
    def __del__(self):
        print("garbage finalized", flush=True)


cycle = Garbage()
cycle.itself = cycle
del cycle
"""


def test_a_process_collects_its_garbage_then_freezes_after_the_handlers_registered_later():
    done = subprocess.run([sys.executable, "-c", EXIT_ORDER], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == [
        "frozen at a later handler: False",
        "garbage finalized",
        "frozen at the last handler: True",
    ]
