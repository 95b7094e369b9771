"""Cost of `cq.load_file`'s owned-memory default (positioned reads) against the opt-in `mmap=True` (zero-copy) on a
~200 MB file of 50 bf16 tensors: seconds to load and seconds to load and touch every byte (a sum), page cache warm
(each variant runs once first). Best of 3.

    python bench/bench_load_copy.py
"""
import tempfile, time
from pathlib import Path
import torch
import cquant as cq


def best(f, n=3) -> float:
    "Best wall time of `n` runs of `f`."
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return min(ts)


def main():
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / 'big.safetensors'
        cq.save_file({f'l{i}.weight': torch.randn(1024, 2048).bfloat16() for i in range(50)}, p)
        mb = p.stat().st_size / 1e6
        for mmap in (False, True):
            cq.load_file(p, mmap=mmap)
            load = best(lambda: cq.load_file(p, mmap=mmap))
            touch = best(lambda: [float(v.float().sum()) for v in cq.load_file(p, mmap=mmap).values()])
            print(f"{mb:.0f} MB  mmap={mmap!s:5}  load {load:.3f} s  load+touch {touch:.3f} s")


if __name__ == '__main__': main()
