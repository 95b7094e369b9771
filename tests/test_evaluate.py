"The end-to-end quality harness (cquant.evaluate) on the DiT-shaped test model: small and fast."
import math
import pytest
from cquant.evaluate import dit_workload, evaluate, rows_table, subset_plan, subset_scores, EVAL_SENTENCES, _assert_disjoint
from cquant.minilm import SENTENCES
from cquant.policy import Policy


def test_dit_int8_vs_float():
    w = dit_workload(n=1, tokens=16)
    r = evaluate(w, Policy(mode='int8', preset='auto-conservative'))
    assert 20 < r['sqnr_db'] < 40 and r['layers'] == 25 and r['bytes'] < r['float_bytes'] / 3
    f = evaluate(w, {})
    assert f['sqnr_db'] == math.inf and f['layers'] == 0
    assert '| dit | int8 |' in rows_table([r])


def test_inputs_disjoint():
    assert not set(EVAL_SENTENCES) & set(SENTENCES)
    with pytest.raises(ValueError, match='also in calibration'): _assert_disjoint(SENTENCES, SENTENCES[:1], 'x')
    w = dit_workload(n=1, tokens=8)
    assert all((c[0] != e[0]).any() for c, e in zip(w.calibration, w.evaluation))
    with pytest.raises(ValueError, match='must differ'): dit_workload(calibration_seed=5, evaluation_seed=5)


def test_bad_plan():
    w = dit_workload(n=1, tokens=8)
    with pytest.raises(KeyError, match='not a module'): evaluate(w, {'nope': 'int8_tensorwise'})
    with pytest.raises(TypeError, match='expected a Policy'): evaluate(w, 3.0)


@pytest.mark.long
def test_measured_policy_uses_the_workload_outputs():
    w = dit_workload(n=1, tokens=16)
    seen = []
    w.outputs = lambda m, b: seen.append(1) or m(*b)
    r = evaluate(w, Policy(selection='measured', preset='auto-conservative', int4_mixed_ratio=0.1))
    assert r['layers'] == 25 and seen        # the greedy search compared what the workload compares


def test_subset_scores_match_evaluate():
    w = dit_workload(n=1, tokens=16)
    p = Policy(preset='auto-conservative', int4_mixed_ratio=0.1)
    model = w.model()
    chosen = p.plan(model).selected()
    [s] = subset_scores(w, p, [chosen])
    plan = subset_plan(p, model, chosen)
    assert {n: d.label for n, d in plan.items()} == {n: d.label for n, d in p.plan(model).items()}
    assert math.isclose(s, evaluate(w, p)['sqnr_db'], rel_tol=1e-9)
    with pytest.raises(KeyError, match='not INT8 budget candidates'): subset_plan(p, model, ['y_embed'])


@pytest.mark.long
def test_greedy_beats_structural_on_evaluation():
    # the harness's DiT workload (two calibration batches; a single small one overfits: see evaluate.html)
    w = dit_workload()
    P = lambda **kw: Policy(preset='auto-conservative', int4_mixed_ratio=0.1, **kw)
    st, me = evaluate(w, P()), evaluate(w, P(selection='measured'))
    assert me['sqnr_db'] > st['sqnr_db'] + 4 and me['bytes'] < st['bytes']
