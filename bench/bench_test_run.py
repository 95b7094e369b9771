"""The test suite's cost as issue 36 states it: wall time and the peak of the summed RSS of the whole process tree
(pytest, its xdist workers and every process a test starts), sampled every 0.5 s from /proc (Linux).

    python bench/bench_test_run.py                                  # pytest -q tests (the README's test command)
    python bench/bench_test_run.py pytest -q -m "not long" tests    # the quick tier
"""
import os, subprocess, sys, time


def _children() -> dict:
    "{parent pid: [child pids]} of every process now."
    kids = {}
    for p in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{p}/stat') as f: ppid = int(f.read().rsplit(')', 1)[1].split()[1])
        except (OSError, IndexError, ValueError): continue
        kids.setdefault(ppid, []).append(int(p))
    return kids


def _rss_kib(pid:int) -> int:
    try:
        with open(f'/proc/{pid}/status') as f: return next((int(l.split()[1]) for l in f if l.startswith('VmRSS:')), 0)
    except OSError: return 0


def tree_rss_mib(root:int) -> int:
    "The summed RSS (MiB) of `root` and all its descendants."
    kids, todo, total = _children(), [root], 0
    while todo:
        p = todo.pop(); total += _rss_kib(p); todo += kids.get(p, [])
    return total // 1024


def main(cmd:list) -> int:
    t0, peak = time.time(), 0
    p = subprocess.Popen(cmd)
    while p.poll() is None:
        peak = max(peak, tree_rss_mib(p.pid))
        time.sleep(0.5)
    print(f"{' '.join(cmd)}: exit {p.returncode}, {time.time() - t0:.0f} s wall, peak RSS of the process tree "
          f"{peak / 1024:.2f} GiB ({os.cpu_count()} CPUs)")
    return p.returncode


if __name__ == '__main__': sys.exit(main(sys.argv[1:] or ['pytest', '-q', 'tests']))
