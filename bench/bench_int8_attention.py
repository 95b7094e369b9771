"""Peak memory and time of cquant's INT8 attention reference (`cq.int8_attention`) against torch SDPA, on CPU.

    python bench/bench_int8_attention.py [--shape 1 8 8192 128] [--dtype bf16] [--block-q 1024 256] [--threads N] [--no-sdpa]

Each case runs in a fresh subprocess: it allocates Q, K, V (seeded Gaussian), reads its resident memory, runs the
attention once (timed), and reports the peak resident memory (`ru_maxrss`) above that baseline, i.e. the extra memory
the call needed beyond its inputs. Cases: `int8_attention` with each `--block-q`, and torch's
`scaled_dot_product_attention` on the same inputs (the exact reference, for scale). Prints one line per case and
writes bench/out/int8_attention.json.
"""
from __future__ import annotations
import argparse, json, os, platform, resource, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # run from a checkout without installing cquant
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def rss_bytes() -> int:
    "Current resident memory of this process."
    with open("/proc/self/statm") as f: return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_case(case: str, shape: list, dtype: str, block_q: int) -> dict:
    import torch
    import torch.nn.functional as F
    import cquant as cq
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g).to(getattr(torch, DTYPES[dtype])) for _ in range(3))
    base = rss_bytes()
    t = time.perf_counter()
    out = cq.int8_attention(q, k, v, block_q=block_q) if case == "int8" else F.scaled_dot_product_attention(q, k, v)
    secs = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"case": case, "block_q": block_q if case == "int8" else None, "seconds": round(secs, 2),
            "extra_peak_mib": round((peak - base) / 2**20, 1), "inputs_mib": round(3 * q.nbytes / 2**20, 1),
            "output_mib": round(out.nbytes / 2**20, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=4, default=[1, 8, 8192, 128], metavar=("B", "H", "T", "D"))
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--block-q", type=int, nargs="+", default=[1024, 256])
    p.add_argument("--threads", type=int, default=0, help="torch threads per case (0: torch's default)")
    p.add_argument("--no-sdpa", action="store_true", help="skip torch SDPA")
    p.add_argument("--case", help=argparse.SUPPRESS)
    a = p.parse_args()
    import torch
    if a.threads: torch.set_num_threads(a.threads)
    if a.case:   # one case, in this (fresh) process
        print(json.dumps(run_case(a.case, a.shape, a.dtype, a.block_q[0]))); return
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); shape {a.shape} {a.dtype}")
    cases = [("int8", b) for b in a.block_q] + ([] if a.no_sdpa else [("sdpa", 0)])
    rows = []
    for case, b in cases:
        cmd = [sys.executable, __file__, "--case", case, "--shape", *map(str, a.shape), "--dtype", a.dtype,
               "--block-q", str(b), "--threads", str(a.threads)]
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
        r = rows[-1]
        name = f"int8_attention block_q={b}" if case == "int8" else "torch SDPA (exact)"
        print(f"{name:28s} {r['seconds']:8.2f} s   extra peak {r['extra_peak_mib']:8.1f} MiB   "
              f"(inputs {r['inputs_mib']} MiB, output {r['output_mib']} MiB)")
    out = ROOT / "bench" / "out"; out.mkdir(exist_ok=True)
    (out / "int8_attention.json").write_text(json.dumps({"shape": a.shape, "dtype": a.dtype, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
