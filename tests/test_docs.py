"""The documentation site: `python tools/build_docs.py` builds it from the notebooks, offline, without Quarto.

The site is built once per test session into a temporary folder. These tests check that every notebook has
a page, that pages carry nbdev's API docs (show_doc) and the figures saved in the notebooks, that the
navigation lists every page in nbdev's order, and that the site works opened from the file system. Where a
headless Chromium is installed, it loads pages from file:// and the rendered DOM is checked too.
"""
import json, re, shutil, subprocess, sys, tempfile
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from fastcore.nbio import read_nb
from nbdev.config import get_config, nbpath2html
from nbdev.doclinks import nbglob

ROOT = Path(__file__).resolve().parents[1]
CFG = get_config(ROOT)
NBS = sorted(nbglob(CFG.nbs_path, as_path=True, skip_file_re='^[_.]'), key=lambda p: p.relative_to(CFG.nbs_path).as_posix())
PAGES = {nb: nbpath2html(nb.relative_to(CFG.nbs_path)).as_posix() for nb in NBS}  # nbdev's page names
NUMERICS = next((nb for nb in NBS if nb.stem.endswith('_numerics')), None)


def _default_exp(nb):
    for c in read_nb(nb).cells:
        if c.cell_type == 'code' and c.directive('default_exp'): return c.directive('default_exp').split()[0]


class _Links(HTMLParser):
    "Collects href/src/id attributes, primary-nav links and headings of a page"
    def __init__(self):
        super().__init__()
        self.refs, self.ids, self.nav, self._nav_depth, self.title = [], set(), [], 0, ''
        self._in_title = False
    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for k in ('href', 'src'):
            if a.get(k) is not None: self.refs.append((tag, k, a[k]))
        if a.get('id'): self.ids.add(a['id'])
        if tag == 'nav' and 'md-nav--primary' in (a.get('class') or ''): self._nav_depth = 1
        elif tag == 'nav' and self._nav_depth: self._nav_depth += 1
        if self._nav_depth and tag == 'a' and 'md-nav__link' in (a.get('class') or '') and a.get('href'):
            self.nav.append(a['href'])
        if tag == 'title': self._in_title = True
    def handle_endtag(self, tag):
        if tag == 'nav' and self._nav_depth: self._nav_depth -= 1
        if tag == 'title': self._in_title = False
    def handle_data(self, data):
        if self._in_title: self.title += data


def _parse(path):
    p = _Links(); p.feed(path.read_text(encoding='utf-8')); return p


@pytest.fixture(scope='session')
def site():
    out = Path(tempfile.mkdtemp(prefix='cquant-site-'))/'site'
    r = subprocess.run([sys.executable, str(ROOT/'tools'/'build_docs.py'), '--out', str(out), '-q'],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(r.stdout[-3000:], r.stderr[-3000:])
    assert r.returncode == 0, f'docs build failed:\n{r.stdout[-5000:]}\n{r.stderr[-5000:]}'
    yield out
    shutil.rmtree(out.parent, ignore_errors=True)


def test_a_page_per_notebook(site):
    assert (site/'index.html').exists()
    missing = [f'{nb.name} -> {page}' for nb, page in PAGES.items() if not (site/page).exists()]
    assert not missing, f'notebooks without a page: {missing}'


def test_pages_have_title_and_description(site):
    from fastcore.nbio import nb_frontmatter
    for nb, page in PAGES.items():
        fm = nb_frontmatter(read_nb(nb))
        html = (site/page).read_text(encoding='utf-8')
        if fm.get('title'):
            assert re.search(r'<h1[^>]*>\s*' + re.escape(str(fm['title'])), html), f'{page}: no <h1> {fm["title"]!r}'
        assert '#|' not in re.sub(r'<script.*?</script>', '', html, flags=re.S), f'{page} shows `#|` directives'
        assert 'output-file:' not in html, f'{page} shows the raw frontmatter'


@pytest.mark.parametrize('nb', [nb for nb in NBS if _default_exp(nb)], ids=lambda p: p.stem)
def test_api_docs(site, nb):
    "show_doc renders the API docs of the notebook's public functions and classes, with nbdev's anchors"
    import importlib, inspect
    modname = f'{CFG.lib_name}.{_default_exp(nb)}'
    mod = importlib.import_module(modname)
    names = [n for n in getattr(mod, '__all__', []) if (inspect.isfunction(o := getattr(mod, n, None)) or inspect.isclass(o))
             and getattr(o, '__module__', None) == modname]
    if not names: pytest.skip(f'{modname} exports no functions or classes')
    page = _parse(site/PAGES[nb])
    html = (site/PAGES[nb]).read_text(encoding='utf-8')
    missing = [n for n in names if n.lower() not in page.ids]
    assert not missing, f'{PAGES[nb]}: no show_doc heading (anchor) for {missing}'
    assert re.search(r'(def|class)\s*(<[^>]+>\s*)*' + re.escape(names[0]), html), f'{PAGES[nb]}: no signature of {names[0]}'


@pytest.mark.skipif(NUMERICS is None, reason='nbs/00_numerics.ipynb does not exist yet')
def test_numerics_page(site):
    html = (site/PAGES[NUMERICS]).read_text(encoding='utf-8')
    assert re.search(r'<h[1-6][^>]*id="hadamard"', html), 'numerics page: no show_doc heading for hadamard'
    assert re.search(r'<img[^>]+src="(data:image/png;base64,|[^"]+\.png)', html), 'numerics page: no figure'
    import importlib.util
    tex = any(c.cell_type == 'markdown' and re.search(r'\$[^$\s][^$]*\$', c.source) for c in read_nb(NUMERICS).cells)
    if tex and importlib.util.find_spec('latex2mathml'):
        assert '<math' in html, 'numerics page: TeX not turned into MathML'


def test_figures_come_from_saved_outputs(site):
    "every notebook with a saved PNG output shows it (the docs build does not execute notebooks)"
    for nb, page in PAGES.items():
        n_png = sum('image/png' in o.get('data', {}) for c in read_nb(nb).cells if c.cell_type == 'code'
                    for o in c.get('outputs', []))
        if n_png: assert 'data:image/png;base64,' in (site/page).read_text(encoding='utf-8'), f'{page}: figure missing'


def test_nav_lists_every_page_in_order(site):
    "every page's sidebar lists every page; index first, numbered notebooks in their order (nbdev's sidebar)"
    want = list(PAGES.values())
    for page in [site/p for p in want]:
        here = page.relative_to(site).as_posix()
        nav = _parse(page).nav
        missing = [p for p in want if p not in nav and p != here]
        assert not missing, f'{here}: nav lacks {missing}'
    nav = [h for h in _parse(site/'index.html').nav if h.endswith('.html')]
    assert nav and nav[0] == 'index.html', f'index is not first in the nav: {nav}'
    pos = [nav.index(PAGES[nb]) for nb in NBS if re.match(r'\d', nb.name) and PAGES[nb] in nav]
    assert pos == sorted(pos), f'numbered notebooks out of order in the nav: {nav}'


def test_toc_entries_have_text_and_targets(site):
    "every table-of-contents entry names a heading on its page"
    for page in PAGES.values():
        html = (site/page).read_text(encoding='utf-8')
        ids = _parse(site/page).ids
        for href, text in re.findall(r'<a href="(#[^"]*)" class="md-nav__link">\s*<span class="md-ellipsis">(.*?)</span>', html, re.S):
            assert re.sub(r'<[^>]+>|\s', '', text), f'{page}: empty TOC entry {href}'
            assert href[1:] in ids, f'{page}: TOC entry {href} has no target'


def test_works_from_file_system(site):
    "relative links only, every local link resolves to a file, offline search index present"
    assert (site/'search'/'search_index.js').exists(), 'no search/search_index.js: the offline plugin did not run'
    for page in site.glob('**/*.html'):
        if page.name == '404.html': continue  # for web servers only; MkDocs makes its links absolute
        for tag, attr, ref in _parse(page).refs:
            u = urlsplit(ref)
            if u.scheme or ref.startswith(('#', '//')) or not u.path: continue
            assert not ref.startswith('/'), f'{page.name}: absolute link {ref!r} breaks file://'
            assert (page.parent/unquote(u.path)).exists(), f'{page.name}: {tag} {attr}={ref!r} does not resolve'


CHROMIUM = shutil.which('chromium') or shutil.which('chromium-browser') or shutil.which('google-chrome')


def _dump_dom(url):
    with tempfile.TemporaryDirectory() as prof:
        r = subprocess.run([CHROMIUM, '--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
                            '--disable-component-update', '--disable-sync', '--no-first-run', f'--user-data-dir={prof}',
                            '--virtual-time-budget=3000', '--dump-dom', url], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.mark.skipif(CHROMIUM is None, reason='headless Chromium not installed (apt-get install -y chromium)')
def test_chromium_renders_pages(site):
    from fastcore.nbio import nb_frontmatter
    others = [nb for nb in NBS if PAGES[nb] != 'index.html']
    for nb in [n for n in NBS if PAGES[n] == 'index.html'] + others[:1]:
        page = site/PAGES[nb]
        dom = _dump_dom(page.as_uri())
        title = str(nb_frontmatter(read_nb(nb)).get('title') or CFG.title)
        assert re.search(r'<h1[^>]*>\s*' + re.escape(title), dom), f'{page.name}: rendered DOM lacks the title {title!r}'
        assert 'md-nav--primary' in dom, f'{page.name}: rendered DOM lacks the navigation'
        for p in PAGES.values():
            if p != PAGES[nb]: assert f'href="{p}"' in dom, f'{page.name}: rendered nav lacks {p}'
        assert 'md-search__input' in dom, f'{page.name}: no search box'
