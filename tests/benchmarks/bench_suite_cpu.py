"""Where the test suite's time and CPU go (figures printed, nothing asserted): runs pytest in this process with a
plugin that reads the machine's busy CPU time (/proc/stat, all processes: the tests' peers, their DHT and averager
processes, p2pd) before and after each test, and prints wall and CPU by kind (multi-peer `-m slow` / fast) and for
the files that took longest. Run it on an idle machine: the CPU column counts everything the machine did.

Run: python tests/benchmarks/bench_suite_cpu.py                       (the whole suite, one process, ~24 min)
     python tests/benchmarks/bench_suite_cpu.py tests/lightning_swarm/test_leaver.py   (any pytest arguments)
Linux only (/proc/stat).
"""

from __future__ import annotations

import collections
import os
import sys
import time

import pytest

from paths import REPO

_HZ = os.sysconf("SC_CLK_TCK")


def busy_cpu_seconds() -> float:
    """Seconds the machine's cores were busy since boot (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / _HZ  # minus idle and iowait


class CpuRecorder:
    def __init__(self):
        self.rows = []  # (nodeid, slow, wall s, machine CPU s)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        wall, cpu = time.monotonic(), busy_cpu_seconds()
        yield
        self.rows.append((item.nodeid, item.get_closest_marker("slow") is not None,
                          time.monotonic() - wall, busy_cpu_seconds() - cpu))


def main(args: list[str]) -> int:
    os.chdir(REPO)
    recorder = CpuRecorder()
    load_before = os.getloadavg()
    code = pytest.main(["-m", "slow or not slow", "-p", "no:cacheprovider", "-q", *args], plugins=[recorder])
    rows = recorder.rows
    print(f"\nload average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores")
    print(f"{'':<12} {'tests':>6} {'wall s':>9} {'CPU s':>9} {'cores':>6}")
    for name, selected in (("multi-peer", [r for r in rows if r[1]]), ("fast", [r for r in rows if not r[1]]),
                           ("all", rows)):
        wall, cpu = sum(r[2] for r in selected), sum(r[3] for r in selected)
        print(f"{name:<12} {len(selected):>6} {wall:>9.1f} {cpu:>9.1f} {cpu / wall if wall else 0:>6.2f}")
    by_file = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for nodeid, _, wall, cpu in rows:
        entry = by_file[nodeid.split("::")[0]]
        entry[0] += 1
        entry[1] += wall
        entry[2] += cpu
    print(f"\n{'wall s':>8} {'CPU s':>8} {'cores':>6} {'tests':>6}  file (the 20 longest)")
    for path, (count, wall, cpu) in sorted(by_file.items(), key=lambda kv: -kv[1][1])[:20]:
        print(f"{wall:>8.1f} {cpu:>8.1f} {cpu / wall if wall else 0:>6.2f} {count:>6}  {path}")
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
