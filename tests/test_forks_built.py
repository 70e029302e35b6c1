"""What built a Forks run, checked at a resume (hpx/forks/record.py): the schedule's whole shape
(every OneCycleLR argument, any scheduler's settings) and the probe's loss as it scores. Each of
these loaded silently: a OneCycleLR of another ``pct_start``, a StepLR of another ``gamma``, a probe
loss with label smoothing added. Refused with both values and the fix, the run left as it was;
built alike, the run resumes bit for bit. AdamW on scikit-learn's digits (nothing downloaded)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx

STEPS = 12


@pytest.fixture(scope="module")
def data(digits):
    x, y = digits
    batches = [(x[32 * i:32 * i + 32], y[32 * i:32 * i + 32]) for i in range(STEPS)]
    probe = [(x[1600:1664], y[1600:1664]), (x[1664:1728], y[1664:1728])]
    return batches, probe


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 10))


def _loss(rep, b):
    return F.cross_entropy(rep.model(b[0]), b[1])


def _probe_loss(smoothing: float = 0.0, per_example: bool = True):
    def fn(rep, b):
        return F.cross_entropy(rep.model(b[0]), b[1], label_smoothing=smoothing,
                               reduction="none" if per_example else "mean")
    return fn


def _onecycle(**kw):
    kw = {"max_lr": 0.01, "total_steps": STEPS, **kw}
    return lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, **kw)


def _steplr(gamma: float):
    return lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=gamma)


def _build(probe, schedule=None, loss_fn=None):
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    sched = (schedule or _onecycle())(opt)
    forks = hpx.Forks(model, opt, total_steps=STEPS, schedule=sched, probe=probe,
                      loss_fn=loss_fn or _probe_loss(), multiples=(0.5, 1.0, 2.0), cuts=((0.5, 2),))
    return model, forks


def _saved(tmp_path, data, schedule=None, loss_fn=None, steps: int = 5):
    batches, probe = data
    torch.manual_seed(7)
    model, forks = _build(probe, schedule, loss_fn)
    for b in batches[:steps]:
        forks.step(_loss, b)
    hpx.save_checkpoint(tmp_path, forks)
    return model, forks


def _flat(state) -> list:
    """Every value of a state, tensors cloned, in order: to tell that a refused load changed nothing."""
    if torch.is_tensor(state):
        return [state.detach().clone()]
    if isinstance(state, dict):
        return [x for k in state for x in [k, *_flat(state[k])]]
    if isinstance(state, (list, tuple)):
        return [x for v in state for x in _flat(v)]
    return [repr(state)]


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) if torch.is_tensor(x) and torch.is_tensor(y) else x == y
                                    for x, y in zip(a, b))


def _refused(tmp_path, forks, model, *words: str) -> str:
    """The load of ``tmp_path`` into ``forks`` refused, naming ``words``, with nothing changed."""
    before, weights = _flat(forks.state_dict()), copy.deepcopy(model.state_dict())
    with pytest.raises(hpx.ConfigError) as err:
        hpx.load_checkpoint(tmp_path, forks)
    text = str(err.value)
    for w in words:
        assert re.search(w, text), (w, text)
    assert "Build hpx.Forks as the saved run was" in text
    assert forks.step_count == 0 and _equal(before, _flat(forks.state_dict()))
    assert all(torch.equal(a, b) for a, b in zip(weights.values(), model.state_dict().values()))
    return text


@pytest.mark.parametrize("change, words", [
    ({"pct_start": 0.5}, [r"the schedule: saved \{'pct_start': 0\.3\}, this run \{'pct_start': 0\.5\}",
                          "build the schedule with the saved run's scheduler and arguments, or start a "
                          "fresh run"]),
    ({"three_phase": True}, [r"the schedule: saved \{'three_phase': False\}, this run "
                             r"\{'three_phase': True\}"]),
    ({"anneal_strategy": "linear"}, [r"the schedule: saved \{'anneal_strategy': 'cos'\}, this run "
                                     r"\{'anneal_strategy': 'linear'\}"]),
    ({"div_factor": 10.0}, [r"the schedule: saved \{'base_lrs': \[0\.0004\], 'div_factor': 25\.0\}, "
                            r"this run \{'base_lrs': \[0\.001\], 'div_factor': 10\.0\}"]),
    ({"final_div_factor": 100.0}, [r"the schedule: saved \{'final_div_factor': 10000\.0\}, this run "
                                   r"\{'final_div_factor': 100\.0\}"]),
    ({"max_momentum": 0.9}, [r"the schedule: saved \{'max_momentum': 0\.95\}, this run "
                             r"\{'max_momentum': 0\.9\}"]),
], ids=["pct_start", "three_phase", "anneal_strategy", "div_factor", "final_div_factor", "max_momentum"])
def test_a_resume_into_a_onecycle_of_another_shape_is_refused_naming_the_argument(change, words, tmp_path,
                                                                                  data):
    _saved(tmp_path, data)
    model, other = _build(data[1], _onecycle(**change))
    text = _refused(tmp_path, other, model, *words)  # each word named, nothing changed
    assert "the schedule" in text


def test_a_resume_into_a_steplr_of_another_gamma_is_refused(tmp_path, data):
    _saved(tmp_path, data, _steplr(0.5))
    model, other = _build(data[1], _steplr(0.1))
    _refused(tmp_path, other, model, r"the schedule: saved \{'gamma': 0\.5\}, this run \{'gamma': 0\.1\}")
    _, same = _build(data[1], _steplr(0.5))
    assert hpx.load_checkpoint(tmp_path, same) == 5


@pytest.mark.parametrize("schedule", [_onecycle(), _steplr(0.5)], ids=["onecycle", "steplr"])
def test_a_resume_built_alike_is_bit_for_bit(schedule, tmp_path, data):
    batches, probe = data
    model, forks = _saved(tmp_path, data, schedule)
    for b in batches[5:]:
        forks.step(_loss, b)
    model2, forks2 = _build(probe, schedule)
    assert hpx.load_checkpoint(tmp_path, forks2) == 5
    for b in batches[5:]:
        forks2.step(_loss, b)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert [(r.step, r.scores) for r in forks.history] == [(r.step, r.scores) for r in forks2.history]


@pytest.mark.parametrize("per_example", [True, False], ids=["per-example", "mean"])
def test_a_resume_with_another_probe_loss_is_refused_and_the_same_one_resumes(per_example, tmp_path, data):
    _saved(tmp_path, data, loss_fn=_probe_loss(0.0, per_example))
    model, other = _build(data[1], loss_fn=_probe_loss(0.1, per_example))
    _refused(tmp_path, other, model, r"the probe's loss \(its values on the first probe batch at the saved "
             r"weights\): saved \{'mean': ", "give the probe the saved run's loss_fn=, or start a fresh run")
    _, same = _build(data[1], loss_fn=_probe_loss(0.0, per_example))
    assert hpx.load_checkpoint(tmp_path, same) == 5


def test_the_probe_loss_is_recorded_at_the_saved_weights_and_leaves_the_run_alone(tmp_path, data):
    """The record a save keeps is the probe loss of your run's weights at that step (not its start's),
    and taking it changes neither the random stream nor the model's mode."""
    batches, probe = data
    model, forks = _build(probe)
    for b in batches[:5]:
        forks.step(_loss, b)
    rng = torch.random.get_rng_state()
    rec = forks.state_dict()["built"]["probe_loss"]
    assert torch.equal(rng, torch.random.get_rng_state()) and model.training
    with torch.no_grad():
        model.eval()
        want = F.cross_entropy(model(probe[0][0]), probe[0][1], reduction="none").double()
        model.train()
    assert rec["examples"] == 64 and rec["mean"] == pytest.approx(float(want.mean()), rel=1e-12)
    assert rec["first"] == pytest.approx(want[:4].tolist(), rel=1e-12)


def test_a_checkpoint_saved_before_these_records_still_loads(tmp_path, data):
    """A state without the probe's loss and the schedule's shape and arguments (saved before they
    were kept): unknown, not a difference."""
    _, forks = _saved(tmp_path, data)
    state = copy.deepcopy(forks.state_dict())
    del state["built"]["probe_loss"]
    del state["built"]["schedule"]["arguments"]
    state["built"]["schedule"].pop("shape", None)
    _, other = _build(data[1], _onecycle(pct_start=0.5), loss_fn=_probe_loss(0.1))
    other.load_state_dict(state)  # what it could not tell, it does not refuse
    assert other.step_count == 5


def test_a_shuffled_probe_loader_resumes(tmp_path, data):
    """A probe whose first batch is another at the load (a shuffled loader) leaves the loss's
    comparison out rather than refusing a run built alike."""
    x = torch.cat([b[0] for b in data[1]])
    y = torch.cat([b[1] for b in data[1]])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
    _, forks = _saved(tmp_path, (data[0], loader))
    rng = torch.random.get_rng_state()
    assert forks.state_dict()["built"]["probe_loss"] is not None  # the loader read: its draw put back
    assert torch.equal(rng, torch.random.get_rng_state())
    torch.manual_seed(123)  # another draw of the shuffle at the load
    _, same = _build(loader)
    assert hpx.load_checkpoint(tmp_path, same) == 5
