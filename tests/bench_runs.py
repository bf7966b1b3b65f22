"""bench.py run in this process on a tiny workload: its tests' shared command line."""

from minfer.bench import cli as bench

WORKLOAD = ["--num-requests", "6", "--input-len", "8:24", "--output-len", "4:12", "--disable-tqdm"]


def run_bench(capsys, *argv):
    """bench.py with these arguments, which must succeed; what it printed."""
    assert bench.main([str(a) for a in argv]) == 0
    return capsys.readouterr().out
