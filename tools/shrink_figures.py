"""Re-encode the figures saved in the notebooks as 256-colour palette PNGs: the same pixels size and dpi, a quarter of
the bytes (a matplotlib figure holds a few hundred distinct colours, almost all of them anti-aliasing shades).

    python tools/shrink_figures.py            # rewrite nbs/*.ipynb in place (figures already in a palette are left)
    python tools/shrink_figures.py --check    # exit 1, naming them, if any figure is still full colour

Run it after executing a notebook in Jupyter; `tests/test_docs.py::test_figures_are_palette_pngs` fails until then.
"""
import argparse, base64, io, json, sys
from pathlib import Path
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def shrink_png(data:bytes) -> bytes|None:
    "The PNG `data` as a palette PNG with the same size and dpi, or None where it is one already."
    im = Image.open(io.BytesIO(data))
    if im.mode == 'P': return None
    out, opaque = io.BytesIO(), im.mode == 'RGB' or im.mode == 'RGBA' and im.getextrema()[3][0] == 255
    pal = (im.convert('RGB').quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE) if opaque else
           im.quantize(256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE))    # the one that keeps an alpha
    pal.save(out, 'png', optimize=True, **({'dpi': im.info['dpi']} if 'dpi' in im.info else {}))
    return out.getvalue()


def saved_pngs(nb:dict):
    "(output dict, PNG bytes) of each image/png output saved in the notebook `nb` (its JSON)."
    for cell in nb['cells']:
        for o in cell.get('outputs', []):
            if png := o.get('data', {}).get('image/png'):
                yield o, base64.b64decode(png if isinstance(png, str) else ''.join(png))


def shrink_notebook(path:Path, write:bool=True) -> int:
    "Re-encode the full-colour figures of the notebook at `path` (in place with `write`); how many there were."
    text = path.read_text(encoding='utf-8')
    nb, n = json.loads(text), 0
    for o, png in saved_pngs(nb):
        if (small := shrink_png(png)) is None: continue
        o['data']['image/png'] = base64.b64encode(small).decode('ascii')
        n += 1
    if n and write:      # nbdev's own layout: one-space indent, non-ASCII kept, a final newline
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + '\n', encoding='utf-8')
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--check', action='store_true', help='only report full-colour figures (exit 1 if any)')
    args = ap.parse_args(argv)
    found = {p.name: n for p in sorted((ROOT/'nbs').glob('*.ipynb')) if (n := shrink_notebook(p, write=not args.check))}
    for name, n in found.items(): print(f"{name}: {n} full-colour figure(s){'' if args.check else ' re-encoded'}")
    return 1 if found and args.check else 0


if __name__ == '__main__': sys.exit(main())
