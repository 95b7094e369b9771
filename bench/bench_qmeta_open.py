"""Time `cq.open_checkpoint` on legacy `_quantization_metadata` files whose layer names carry a prefix the tensor
names lack (issue 16: it was quadratic, 5k layers 3.9 s, 10k 15.3 s, 20k 70.7 s). Prints seconds and the ratio to
the 5k time (linear: about 2x and 4x).

    python bench/bench_qmeta_open.py
"""
import json, tempfile, time, warnings
from pathlib import Path
import cquant as cq


def qmeta_file(path:Path, n:int) -> Path:
    "A safetensors file of n scalar 'm<i>.weight' tensors and n prefixed fp8 layers in _quantization_metadata."
    ents = [f'"m{i}.weight": {{"dtype": "F32", "shape": [], "data_offsets": [{4 * i}, {4 * i + 4}]}}' for i in range(n)]
    layers = {f'model.diffusion_model.m{i}': {'format': 'float8_e4m3fn'} for i in range(n)}
    meta = json.dumps({'_quantization_metadata': json.dumps({'layers': layers})})
    hdr = ('{' + f'"__metadata__": {meta}, ' + ', '.join(ents) + '}').encode()
    hdr += b' ' * (-len(hdr) % 8)
    path.write_bytes(len(hdr).to_bytes(8, 'little') + hdr + b'\0\0\x80\x3f' * n)
    return path


if __name__ == '__main__':
    with tempfile.TemporaryDirectory() as d:
        base = None
        for n in (5_000, 10_000, 20_000):
            p = qmeta_file(Path(d) / f'q{n}.safetensors', n)
            t = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter('ignore')
                ck = cq.open_checkpoint(p, convert=True); ck.close()
            dt = time.perf_counter() - t; base = base or dt
            print(f'{n:6d} layers: {dt:6.2f} s  ({dt / base:.1f}x the 5k time)')
