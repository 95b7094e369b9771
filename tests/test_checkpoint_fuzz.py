"""Malformed checkpoints: every one must end in a clean `CheckpointError` naming the file, never a crash,
a hang or a large allocation.

- hand-made files covering each way a safetensors header or a Comfy entry can lie (in process, with a
  peak-RSS check per case);
- the nastiest ones (declared sizes of terabytes, multi-GB sparse files, deep JSON nesting) again in a
  subprocess under an address-space limit and an alarm;
- hypothesis: random headers, random byte mutations and truncations of valid files, random comfy_quant
  bytes. Whenever cquant's header check accepts a file, `safetensors` must read every tensor of it with the
  dtype and shape cquant announced (cquant is at least as strict as the library it hands files to).
"""
import json, os, struct, subprocess, sys, textwrap, warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import cquant as cq
from cquant.checkpoint import (CheckpointError, MAX_JSON_BYTES, encode_json, inspect_checkpoint, load_file,
                               open_checkpoint, read_header)

FP8 = 'float8_e4m3fn'
MiB = 1 << 20


# ---------------------------------------------------------------- helpers
def write_raw(path, header, data=b'', n=None, size=None):
    "A file with a hand-made header (dict/list -> JSON, or raw bytes), data section, optional fake length / sparse size."
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, 'wb') as f:
        f.write(struct.pack('<Q', len(hb) if n is None else n) + hb + data)
        if size is not None: f.truncate(size)      # sparse: no disk, no memory
    return path


def ent(dt, shape, b, e): return {'dtype': dt, 'shape': shape, 'data_offsets': [b, e]}


def valid_bytes(sd, metadata=None):
    "A valid safetensors file (as bytes) written by cquant."
    p = Path(os.environ.get('TMPDIR', '/tmp')) / f'cq_fuzz_src_{os.getpid()}.safetensors'
    cq.checkpoint.save_file(sd, p, metadata, validate=False)
    b = p.read_bytes(); p.unlink()
    return b


def _hwm_reset():
    try:
        with open('/proc/self/clear_refs', 'w') as f: f.write('5')
        return True
    except OSError: return False


def _status(key):
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(key + ':'): return int(line.split()[1]) * 1024
    return 0


def clean(path, ops=('load', 'inspect'), mem_limit=64 * MiB):
    """Run load_file / open+modules / inspect on `path`: each succeeds or raises CheckpointError naming the file.
    Peak RSS growth stays under `mem_limit`. Returns the error messages."""
    msgs = []
    for op in ops:
        can = _hwm_reset(); base = _status('VmRSS')
        try:
            with warnings.catch_warnings():
                warnings.simplefilter('ignore')
                if op == 'load': load_file(path)
                elif op == 'inspect': inspect_checkpoint(path)
                elif op == 'open': open_checkpoint(path).modules()
        except CheckpointError as e:
            assert str(path) in str(e), f'{op}: error does not name the file: {e}'
            msgs.append(str(e))
        except Exception as e:   # anything else is a bug
            raise AssertionError(f'{op} on {path.name}: unclean {type(e).__name__}: {e}') from e
        if can:
            grew = _status('VmHWM') - base
            assert grew < mem_limit, f'{op} on {path.name}: peak RSS grew by {grew / MiB:.0f} MiB'
    return msgs


def fp8_module(prefix='m.', shape=(8, 16)):
    w = torch.randn(shape)
    qt = cq.quantize(w, FP8)
    return {f'{prefix}weight': qt}


@pytest.fixture(scope='module', autouse=True)
def warm_up(tmp_path_factory):
    "First-use costs (lazy torch imports of meta kernels, safetensors) are paid once here, not charged to a case."
    p = tmp_path_factory.mktemp('warm') / 'warm.safetensors'
    cq.checkpoint.save_file({**fp8_module('a.'), 'b.weight': torch.randn(300, 1000)}, p)
    load_file(p); inspect_checkpoint(p)


# ---------------------------------------------------------------- hand-made container lies
HAND = {  # name: (header, data, n, expected message fragment)
    'empty': (b'', b'', 0, None),
    'seven_bytes': (None, None, None, 'expected at least the 8-byte header length'),
    'len_max': ({}, b'', 2**64 - 1, 'expected a header length within'),
    'len_plus_one': (b'{}', b'', 3, 'expected a header length within'),
    'len_huge_small_file': (b'{}', b'', 99_999_999, 'expected a header length within'),
    'not_json': (b'{"a": [1, 2', b'', None, 'expected valid JSON'),
    'not_utf8': (b'{"\xff\xfe": 1}', b'', None, 'invalid UTF-8'),
    'not_object': (b'[1, 2]', b'', None, 'expected a JSON object'),
    'leading_space': (b' {}', b'', None, 'expected a JSON object'),
    'deep_nesting': (b'{"a": ' + b'[' * 200_000 + b']' * 200_000 + b'}', b'', None, 'expected valid JSON'),
    'huge_int_literal': (b'{"a": {"dtype": "U8", "shape": [' + b'9' * 6000 + b'], "data_offsets": [0, 1]}}', b'\0', None, 'expected valid JSON'),
    'nan_shape': (b'{"a": {"dtype": "U8", "shape": [NaN], "data_offsets": [0, 1]}}', b'\0', None, 'non-negative integers'),
    'entry_not_object': ({'a': [1, 2]}, b'', None, 'expected an object with dtype'),
    'entry_missing_offsets': ({'a': {'dtype': 'U8', 'shape': [1]}}, b'\0', None, "found no 'data_offsets'"),
    'bad_dtype': ({'a': ent('Q8', [1], 0, 1)}, b'\0', None, 'expected a dtype in'),
    'dtype_not_str': ({'a': ent(8, [1], 0, 1)}, b'\0', None, 'expected a dtype in'),
    'negative_dim': ({'a': ent('U8', [-1], 0, 1)}, b'\0', None, 'non-negative integers'),
    'float_dim': ({'a': ent('U8', [1.0], 0, 1)}, b'\0', None, 'non-negative integers'),
    'bool_dim': ({'a': ent('U8', [True], 0, 1)}, b'\0', None, 'non-negative integers'),
    'shape_not_list': ({'a': ent('U8', 5, 0, 5)}, b'\0' * 5, None, 'non-negative integers'),
    'zero_dim_huge_rest': ({'a': ent('F32', [0, 2**62, 2**62], 0, 0)}, b'', None, 'a shape torch can describe'),
    'too_many_dims': ({'a': ent('U8', [1] * 100, 0, 1)}, b'\0', None, 'a shape torch can describe'),
    'negative_offset': ({'a': ent('U8', [1], -1, 0)}, b'', None, 'data_offsets [begin, end]'),
    'reversed_offsets': ({'a': ent('U8', [0], 4, 0)}, b'\0' * 4, None, 'data_offsets [begin, end]'),
    'offsets_not_pair': ({'a': {'dtype': 'U8', 'shape': [1], 'data_offsets': [0, 1, 2]}}, b'\0', None, 'data_offsets [begin, end]'),
    'float_offsets': ({'a': {'dtype': 'U8', 'shape': [1], 'data_offsets': [0.0, 1.0]}}, b'\0', None, 'data_offsets [begin, end]'),
    'shape_bytes_mismatch': ({'a': ent('F32', [3], 0, 8)}, b'\0' * 8, None, 'expected F32[3] = 12 bytes'),
    'shape_huge_offsets_small': ({'a': ent('F32', [2**20, 2**20], 0, 16)}, b'\0' * 16, None, 'bytes, found data_offsets [0, 16] = 16 bytes'),
    'offsets_past_eof': ({'a': ent('U8', [2**40], 0, 2**40)}, b'\0' * 8, None, 'past the end'),
    'offsets_2_64': ({'a': ent('U8', [2**64], 0, 2**64)}, b'\0' * 8, None, 'a shape torch can describe'),
    'overlap': ({'a': ent('U8', [4], 0, 4), 'b': ent('U8', [4], 2, 6)}, b'\0' * 6, None, 'overlapping'),
    'duplicate_range': ({'a': ent('U8', [4], 0, 4), 'b': ent('U8', [4], 0, 4)}, b'\0' * 4, None, 'overlapping'),
    'gap': ({'a': ent('U8', [2], 0, 2), 'b': ent('U8', [2], 4, 6)}, b'\0' * 6, None, 'gap'),
    'trailing': ({'a': ent('U8', [2], 0, 2)}, b'\0' * 5, None, 'trailing bytes'),
    'truncated_data': ({'a': ent('F32', [4], 0, 16)}, b'\0' * 10, None, 'past the end'),
    'metadata_not_strings': ({'__metadata__': {'a': 1}}, b'', None, 'an object of strings'),
    'metadata_list': ({'__metadata__': [1]}, b'', None, 'an object of strings'),
    'odd_fp4': ({'a': ent('F4', [3], 0, 1)}, b'\0', None, 'expected F4[3] = 1.5 bytes'),
}


@pytest.mark.parametrize('name', sorted(HAND))
@pytest.mark.writes_invalid
def test_hand_made_container(tmp_path, name):
    header, data, n, msg = HAND[name]
    p = tmp_path / f'{name}.safetensors'
    if header is None: p.write_bytes(b'\x01' * 7)
    else: write_raw(p, header, data, n)
    msgs = clean(p)
    if name == 'empty':   # an 8-byte zero length: header '' is not JSON
        assert msgs and all('expected a JSON object' in m for m in msgs)
        return
    assert len(msgs) == 2, f'{name}: accepted a malformed file'
    for m in msgs: assert msg in m, m


# ---------------------------------------------------------------- hand-made Comfy-level lies
def _sd_file(tmp_path, name, sd, metadata=None):
    "Written by the safetensors library, as another tool would (cquant's own writer converts and validates)."
    from safetensors.torch import save_file as st_save
    p = tmp_path / f'{name}.safetensors'
    st_save({k: v.contiguous() for k, v in sd.items()}, p, metadata)
    return p


def _base():
    sd = cq.checkpoint.Checkpoint.from_state_dict(fp8_module('blk.')).state_dict()
    sd['blk.bias'] = torch.zeros(8)
    sd['norm.weight'] = torch.ones(16)
    return sd


COMFY = {  # name: (changes to a valid fp8 module state dict, metadata, message fragment)
    'cq_garbage_json': ({'blk.comfy_quant': torch.tensor(list(b'{"format": "float8'), dtype=torch.uint8)}, None, 'expected valid JSON'),
    'cq_not_utf8': ({'blk.comfy_quant': torch.tensor([0xff, 0xfe, 0x7b], dtype=torch.uint8)}, None, 'invalid UTF-8'),
    'cq_float': ({'blk.comfy_quant': encode_json({'format': FP8}).float()}, None, 'found dtype torch.float32'),
    'cq_2d': ({'blk.comfy_quant': encode_json({'format': FP8}).reshape(1, -1)}, None, 'found shape (1, '),
    'cq_scalar': ({'blk.comfy_quant': torch.tensor(123, dtype=torch.uint8)}, None, 'found shape ()'),
    'cq_list': ({'blk.comfy_quant': encode_json([FP8])}, None, 'expected a JSON object, found list'),
    'cq_no_format': ({'blk.comfy_quant': encode_json({'params': {}})}, None, 'expected a "format" field'),
    'cq_unknown_format': ({'blk.comfy_quant': encode_json({'format': 'int3'})}, None, "expected one of"),
    'cq_format_not_str': ({'blk.comfy_quant': encode_json({'format': ['x']})}, None, "expected one of"),
    'cq_deep': ({'blk.comfy_quant': torch.tensor(list(b'[' * 300_000), dtype=torch.uint8)}, None, 'expected valid JSON'),
    'cq_too_big': ({'blk.comfy_quant': torch.full((MAX_JSON_BYTES + 1,), 32, dtype=torch.uint8)}, None, f'expected at most {MAX_JSON_BYTES} bytes of JSON'),
    'missing_scale': ({'blk.weight_scale': None}, None, "'blk.weight_scale': expected float8_e4m3fn tensors ['weight', 'weight_scale'], found blk.weight_scale missing"),
    'missing_weight': ({'blk.weight': None}, None, "'blk.weight': expected float8_e4m3fn tensors"),
    'extra_scale': ({'blk.weight_scale_2': torch.tensor(1.0)}, None, "'blk.weight_scale_2': expected only float8_e4m3fn tensors"),
    'stray_scale': ({'norm.weight_scale': torch.tensor(1.0)}, None, "'norm.weight_scale': expected no scale tensors on module 'norm' without a comfy_quant entry"),
    'stray_input_scale': ({'norm.input_scale': torch.tensor(2.0)}, None, "'norm.input_scale': expected no scale tensors"),
    'wrong_weight_dtype': ({'blk.weight': torch.zeros(8, 16, dtype=torch.bfloat16)}, None, "'blk.weight': expected float8_e4m3fn storage dtype"),
    'wrong_scale_shape': ({'blk.weight_scale': torch.ones(3)}, None, "'blk.weight_scale'"),
    'int_bias': ({'blk.bias': torch.zeros(8, dtype=torch.int64)}, None, "'blk.bias': expected a floating-point tensor"),
    'input_scale_vector': ({'blk.input_scale': torch.ones(4)}, None, "'blk.input_scale': expected one value, found shape (4,)"),
    'attention_float': ({'blk.comfy_attention.config': torch.ones(3)}, None, 'expected a 1-D uint8 tensor'),
    'qmeta_garbage': ({}, {'_quantization_metadata': '{"layers": '}, "header __metadata__['_quantization_metadata']: expected valid JSON"),
    'qmeta_layers_list': ({}, {'_quantization_metadata': '{"layers": [1]}'}, 'expected an object with a "layers" object'),
    'qmeta_conf_str': ({}, {'_quantization_metadata': '{"layers": {"norm": "fp8"}}'}, "[\"layers\"]['norm']: expected a JSON object, found str"),
    'qmeta_bad_format': ({}, {'_quantization_metadata': '{"layers": {"norm": {"format": "nope"}}}'}, 'expected one of'),
    'legacy_rename_clash': ({'blk.scale_weight': torch.tensor(1.0), 'scaled_fp8': torch.empty(0, dtype=torch.float8_e4m3fn)}, None, "found both 'blk.scale_weight' and 'blk.weight_scale'"),
}


@pytest.mark.parametrize('name', sorted(COMFY))
@pytest.mark.writes_invalid
def test_hand_made_comfy(tmp_path, name):
    changes, meta, msg = COMFY[name]
    sd = _base()
    for k, v in changes.items():
        if v is None: sd.pop(k)
        else: sd[k] = v
    p = _sd_file(tmp_path, name, sd, meta)
    msgs = clean(p)
    assert len(msgs) == 2, f'{name}: accepted a malformed file'
    for m in msgs: assert msg in m, m


def test_unknown_attention_method_warns_not_fails(tmp_path):
    sd = _base(); sd['blk.comfy_attention.config'] = encode_json([{'attention': 'flash9'}, {'attention': 'comfy_kitchen_sol', 'tau': 2}])
    p = _sd_file(tmp_path, 'attn', sd)
    assert clean(p) == []
    cfg = inspect_checkpoint(p)['attention']['blk']
    assert cfg == [{'attention': 'flash9'}, {'attention': 'comfy_kitchen_sol', 'tau': 2}]
    with pytest.warns(cq.checkpoint.CheckpointWarning, match="Ignoring unsupported attention method 'flash9' for blk"):
        ch = cq.select_attention(cfg, {'comfy_kitchen_sol'}, 'blk')
    assert ch.options == {'tau': 2.0}


def test_good_file_is_clean(tmp_path):
    p = _sd_file(tmp_path, 'good', _base())
    assert clean(p) == []
    assert set(load_file(p)) == set(_base())


# ---------------------------------------------------------------- nastiest cases: subprocess, memory limit, alarm
NASTY_SCRIPT = textwrap.dedent('''
    import json, resource, signal, sys, warnings
    warnings.simplefilter('ignore')
    import cquant as cq
    from cquant.checkpoint import CheckpointError, load_file, inspect_checkpoint
    with open('/proc/self/status') as f: vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmSize:'))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (768 << 20), resource.RLIM_INFINITY))   # 768 MiB of headroom
    signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError('hang')))
    out = {}
    for path, ops in json.loads(sys.argv[1]):
        res = []
        for op in ops:
            signal.alarm(20)
            try:
                r = (load_file if op == 'load' else inspect_checkpoint)(path)
                res.append(['ok', op, sorted(r['totals']) if op == 'inspect' else len(r)])
            except CheckpointError as e: res.append(['clean', op, str(e)])
            except BaseException as e: res.append(['UNCLEAN', op, f'{type(e).__name__}: {e}'[:300]])
            finally: signal.alarm(0)
        out[path] = res
    print(json.dumps(out))
''')


@pytest.mark.writes_invalid
def test_nasty_in_subprocess_with_memory_limit(tmp_path):
    G = 1 << 30
    cases = {}   # path: (ops, expected 'clean' message or 'ok')
    def add(name, header, data=b'', n=None, size=None, ops=('load', 'inspect'), expect='clean'):
        p = write_raw(tmp_path / f'{name}.safetensors', header, data, n, size)
        cases[str(p)] = (list(ops), expect)
    add('len_2_63', {}, n=2**63)
    add('len_header_limit_sparse', b'{', n=100_000_001, size=100_000_100)      # over the 100 MB header cap, never read
    add('tb_tensor', {'w': ent('F32', [2**38], 0, 2**40)}, b'\0' * 64)
    add('shape_2_40_sq', {'w': ent('U8', [2**40, 2**40], 0, 2**80)}, b'\0' * 64)
    add('deep_header', b'{"a":' + b'[' * 500_000 + b'}')
    # a consistent header over a sparse 3 GiB file whose comfy_quant claims 2 GiB: refused unread
    hdr = {'m.comfy_quant': ent('U8', [2 * G], 0, 2 * G), 'm.weight': ent('F8_E4M3', [G // 4096, 4096], 2 * G, 3 * G)}
    hb = json.dumps(hdr).encode(); hb += b' ' * (-len(hb) % 8)
    add('sparse_huge_comfy_quant', hb, size=8 + len(hb) + 3 * G, ops=('load', 'inspect'))
    # a valid fp8 module of 4 GiB (sparse): inspect reads only the header and the JSON entries
    cqb = json.dumps({'format': FP8}).encode()
    hdr = {'big.weight': ent('F8_E4M3', [65536, 65536], 0, 4 * G), 'big.weight_scale': ent('F32', [], 4 * G, 4 * G + 4),
           'big.comfy_quant': ent('U8', [len(cqb)], 4 * G + 4, 4 * G + 4 + len(cqb))}
    hb = json.dumps(hdr).encode(); hb += b' ' * (-len(hb) % 8)
    p = tmp_path / 'sparse_4g_valid.safetensors'
    with open(p, 'wb') as f:
        f.write(struct.pack('<Q', len(hb)) + hb); f.seek(8 + len(hb) + 4 * G); f.write(struct.pack('<f', 1.0) + cqb)
    cases[str(p)] = (['inspect'], 'ok')
    arg = json.dumps([[k, v[0]] for k, v in cases.items()])
    r = subprocess.run([sys.executable, '-c', NASTY_SCRIPT, arg], capture_output=True, text=True, timeout=240,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for path, (ops, expect) in cases.items():
        for status, op, msg in out[path]:
            assert status == expect, f'{Path(path).name} {op}: {status} {msg}'
            if status == 'clean': assert path in msg
    big = out[str(p)][0]
    assert big[2] == [FP8], big


# ---------------------------------------------------------------- hypothesis
DTS = ['U8', 'I8', 'F16', 'BF16', 'F32', 'I64', 'F8_E4M3', 'F8_E5M2', 'BOOL']
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False), st.text(max_size=8))
json_val = st.recursive(json_leaf, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=6), c, max_size=4)), max_leaves=12)
entry = st.fixed_dictionaries({'dtype': st.one_of(st.sampled_from(DTS + ['F4', 'X']), json_leaf),
                               'shape': st.one_of(st.lists(st.integers(-2, 2**65), max_size=4), json_val),
                               'data_offsets': st.one_of(st.lists(st.integers(-4, 2**66), min_size=2, max_size=2), json_val)})
header = st.dictionaries(st.text(min_size=1, max_size=12), st.one_of(entry, json_val), max_size=5)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def _agrees_with_safetensors(p):
    "If cquant's header check accepts `p`, safetensors reads every tensor with the announced dtype and shape."
    try: infos, meta = read_header(p)
    except CheckpointError: return
    from safetensors import safe_open
    with safe_open(str(p), 'pt') as f:
        assert set(f.keys()) == set(infos)
        for k, i in infos.items():
            t = f.get_tensor(k)
            assert (t.dtype, tuple(t.shape)) == (i.dtype, i.shape), k


@SETTINGS
@given(hdr=header, data=st.binary(max_size=64), fake_len=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_random_headers(tmp_path_factory, hdr, data, fake_len):
    p = write_raw(tmp_path_factory.mktemp('h') / 'h.safetensors', hdr, data, fake_len)
    clean(p)
    _agrees_with_safetensors(p)


def _valid_file():
    g = torch.Generator().manual_seed(0)
    sd = {'blk.weight': cq.quantize(torch.randn(8, 16, generator=g), FP8), 'blk.bias': torch.randn(8, generator=g),
          'emb.weight': torch.randn(4, 6, generator=g).to(torch.bfloat16), 'flag': torch.tensor([True, False]),
          'attn.comfy_attention.config': encode_json([{'attention': 'comfy_kitchen_sol', 'tau': 1.0}])}
    return valid_bytes(sd, {'source': 'fuzz'})


VALID = None


def _valid():
    global VALID
    if VALID is None: VALID = _valid_file()
    return VALID


@SETTINGS
@given(cut=st.integers(0, 10**6), edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
       extra=st.binary(max_size=16))
def test_mutated_valid_file(tmp_path_factory, cut, edits, extra):
    b = bytearray(_valid())
    for pos, val in edits: b[pos % len(b)] = val
    b = bytes(b[:cut % (len(b) + 1)]) + extra
    p = tmp_path_factory.mktemp('m') / 'm.safetensors'
    p.write_bytes(b)
    clean(p)
    _agrees_with_safetensors(p)


@SETTINGS
@given(field_=st.sampled_from(['dtype', 'shape', 'data_offsets']), value=json_val, victim=st.integers(0, 10))
def test_mutated_header_fields(tmp_path_factory, field_, value, victim):
    b = _valid()
    n = struct.unpack('<Q', b[:8])[0]
    hdr = json.loads(b[8:8 + n])
    names = sorted(k for k in hdr if k != '__metadata__')
    hdr[names[victim % len(names)]][field_] = value
    hb = json.dumps(hdr).encode()
    p = tmp_path_factory.mktemp('f') / 'f.safetensors'
    p.write_bytes(struct.pack('<Q', len(hb)) + hb + b[8 + n:])
    clean(p)
    _agrees_with_safetensors(p)


@SETTINGS
@given(raw=st.one_of(st.binary(max_size=64), json_val.map(lambda v: json.dumps(v).encode()),
                     st.dictionaries(st.sampled_from(['format', 'params', 'convrot', 'full_precision_matrix_mult', 'x']),
                                     st.one_of(json_val, st.sampled_from(sorted(cq.FORMATS) or [FP8])), max_size=3).map(lambda v: json.dumps(v).encode())))
def test_random_comfy_quant(tmp_path_factory, raw):
    sd = _base()
    sd['blk.comfy_quant'] = torch.tensor(list(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    p = tmp_path_factory.mktemp('c') / 'c.safetensors'
    cq.checkpoint.save_file(sd, p, validate=False)
    clean(p)
