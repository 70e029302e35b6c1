"""hpx.Forks under the set-ups of a real training loop that the basic tests do not use: gradient
clipping of the annealed copies, a GradScaler whose scale differs from fork to fork, models that
draw from Python's and NumPy's random streams, mixed precision around the first probe pass, and
changes made to your objects mid-run."""

from __future__ import annotations

import copy
import io
import random

import numpy as np
import pytest
import torch
from torch import nn

import hpx
from tests.test_forks import BATCHES, PROBE, STEPS, _loss, _net, _probe_loss, _Rep, _same


def _sgd(model: nn.Module, lr: float = 0.05) -> torch.optim.SGD:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=0.9)


def _grad_norm(model: nn.Module) -> float:
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()
                                                       if p.grad is not None])))


def test_the_annealed_copies_are_clipped_as_their_forks_are():
    model = _net(p=0.0)
    forks = hpx.Forks(model, _sgd(model, 0.5), total_steps=STEPS, probe=PROBE)
    norms = []
    for b in BATCHES[:STEPS]:
        forks.backward(_loss, b)
        forks.optimizer_step(max_grad_norm=1e-3)
        norms += [_grad_norm(c.model) for c in forks._clones if c.model[0].weight.grad is not None]
    assert norms and max(norms) <= 1e-3 * (1 + 1e-5)


def _scaled_plain(lr: float, scaler: torch.amp.GradScaler, steps: int = STEPS) -> nn.Module:
    model = _net(p=0.0)
    opt = _sgd(model, lr)
    for b in BATCHES[:steps]:
        opt.zero_grad(set_to_none=True)
        scaler.scale(_loss(_Rep(model), b)).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    return model


def _scaled_forks(lr: float, scaler: torch.amp.GradScaler, loss_fn=_loss,
                  **settings) -> tuple[nn.Module, hpx.Forks]:
    model = _net(p=0.0)
    forks = hpx.Forks(model, _sgd(model, lr), total_steps=STEPS, probe=PROBE, **settings)
    for b in BATCHES[:STEPS]:
        forks.backward(loss_fn, b, scaler=scaler)
        forks.optimizer_step(scaler=scaler)
    return model, forks


def _overflowing(rep, b):
    """The loss, whose scaled gradients overflow on the 10x fork (its lr multiple: rep.value("lr"))."""
    return _loss(rep, b) * (1e38 if rep.value("lr") > 5 else 1.0)


def test_a_challengers_overflow_leaves_your_scaler_and_your_run_as_plain_training():
    """The 10x fork overflows at every step until it is cut: with one scaler for all, each of its
    overflows halved the scale your run trains with."""
    plain_scaler, scaler = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    plain = _scaled_plain(0.03, plain_scaler)
    model, forks = _scaled_forks(0.03, scaler, _overflowing, confidence=1e9)  # your run is kept
    assert forks.factor == 1.0
    assert scaler.get_scale() == plain_scaler.get_scale() == 65536.0
    assert _same(model, plain)


def test_the_winners_scaler_state_is_loaded_into_yours():
    """The 10x fork overflows until it is cut, halving its own scale (and, with one scaler for all,
    everyone's): the winner's scale is plain training's at the winner's multiple, and it is what
    your scaler holds after."""
    yours = torch.amp.GradScaler("cpu")
    model, forks = _scaled_forks(0.001, yours, _overflowing, confidence=0.0)
    assert 1.0 < forks.factor < 5
    at_multiple = torch.amp.GradScaler("cpu")
    plain = _scaled_plain(0.001 * forks.factor, at_multiple)
    assert yours.state_dict() == at_multiple.state_dict()
    assert _same(model, plain)


def test_a_resume_with_a_scaler_is_bit_for_bit_for_every_forks_scale(tmp_path):
    def build():
        model = _net(p=0.0)
        scaler = torch.amp.GradScaler("cpu")
        return model, scaler, hpx.Forks(model, _sgd(model, 0.01), total_steps=STEPS, probe=PROBE)

    def train(forks, scaler, batches):  # the 10x fork overflows until its own scale is 8192
        for b in batches:
            forks.backward(lambda rep, b: _loss(rep, b) * (1e34 if rep.value("lr") > 5 else 1.0), b,
                           scaler=scaler)
            forks.optimizer_step(scaler=scaler)

    model, scaler, forks = build()
    train(forks, scaler, BATCHES[:2])
    buf = io.BytesIO()
    torch.save({"forks": forks.state_dict(), "scaler": scaler.state_dict()}, buf)
    train(forks, scaler, BATCHES[2:STEPS])

    model2, scaler2, forks2 = build()
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    forks2.load_state_dict(saved["forks"])
    scaler2.load_state_dict(saved["scaler"])
    train(forks2, scaler2, BATCHES[2:STEPS])
    assert _same(model, model2) and scaler.state_dict() == scaler2.state_dict()
    assert [r.scores for r in forks.history] == [r.scores for r in forks2.history]


class _LayerDrop(nn.Module):
    """Skips its hidden layer at random, drawing from Python's and NumPy's global streams (as
    LayerDrop and a SpecAugment mask do)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if not self.training or random.random() > 0.3:
            h = torch.tanh(self.mid(h))
        if self.training:
            h = h * torch.as_tensor(np.random.rand(*h.shape) > 0.1, dtype=h.dtype)
        return self.out(h)


def test_a_model_drawing_from_pythons_and_numpys_streams_is_plain_training_when_kept():
    def run(with_forks: bool):
        random.seed(3)
        np.random.seed(3)
        model = _LayerDrop()
        opt = _sgd(model)
        if with_forks:
            forks = hpx.Forks(model, opt, total_steps=STEPS, probe=PROBE, confidence=1e9)
            for b in BATCHES[:STEPS]:
                forks.step(_loss, b)
        else:
            _plain_loop(model, opt)
        return model, random.random(), float(np.random.rand())

    (a, ra, na), (b, rb, nb) = run(True), run(False)
    assert _same(a, b) and (ra, na) == (rb, nb)


def _plain_loop(model, opt, batches=None, change=None):
    for i, b in enumerate(BATCHES[:STEPS] if batches is None else batches):
        if change is not None:
            change(i, model, opt)
        opt.zero_grad(set_to_none=True)
        _loss(_Rep(model), b).backward()
        opt.step()


def test_the_first_probe_pass_scores_in_full_precision_inside_your_autocast():
    model = _net(p=0.0)
    fp32 = _probe_loss(copy.deepcopy(model))
    forks = hpx.Forks(model, _sgd(model), total_steps=STEPS, probe=PROBE)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        forks.backward(_loss, BATCHES[0])
    assert forks._initial == pytest.approx(fp32, rel=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = _probe_loss(copy.deepcopy(model))
    assert abs(low - fp32) > 1e-6 * fp32  # what it recorded before: the bf16 score


def _frozen_net() -> nn.Module:
    model = _net(p=0.0)
    model[0].requires_grad_(False)
    return model


@pytest.mark.parametrize("change, match", [
    (lambda f, m, o: m[0].requires_grad_(True), "was frozen when hpx.Forks was built.*now requires grad"),
    (lambda f, m, o: o.param_groups[0].__setitem__("lr", 0.01), "parameter group 0's lr 0.01 where the"),
    (lambda f, m, o: o.add_param_group({"params": list(m[0].parameters())}), "2 parameter groups where the "
                                                                              "copies have 1"),
])
def test_a_change_to_your_objects_alone_mid_run_is_refused_at_the_next_step(change, match):
    model = _frozen_net()
    opt = _sgd(model)
    forks = hpx.Forks(model, opt, total_steps=STEPS, probe=PROBE)
    for b in BATCHES[:5]:
        forks.step(_loss, b)
    change(forks, model, opt)
    with pytest.raises(hpx.ConfigError, match=match + r".*forks.each\(lambda replica"):
        forks.step(_loss, BATCHES[5])


def test_forks_each_changes_every_fork_alike_and_the_kept_run_is_plain_training():
    def unfreeze(replica):
        replica.model[0].requires_grad_(True)
        replica.optimizer.add_param_group({"params": list(replica.model[0].parameters()), "lr": 0.02})

    model = _frozen_net()
    forks = hpx.Forks(model, _sgd(model), total_steps=STEPS, probe=PROBE, confidence=1e9)
    for i, b in enumerate(BATCHES[:STEPS]):
        if i == 5:
            forks.each(unfreeze)
        forks.step(_loss, b)
    assert len(forks.history) == 3 and forks.factor == 1.0

    ref = _frozen_net()
    _plain_loop(ref, _sgd(ref), change=lambda i, m, o: unfreeze(_Replica(m, o)) if i == 5 else None)
    assert _same(model, ref)


class _Replica:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer


def test_a_knob_your_loss_reads_needs_a_probe_loss_of_its_own():
    """Scored with the training loss, each label-smoothing fork was judged by its own smoothed loss:
    with identical weights, the fork without smoothing won."""
    model = _net(p=0.0)
    with pytest.raises(hpx.ConfigError, match="knob 'label_smoothing' is read by your loss"):
        hpx.Forks(model, _sgd(model), total_steps=STEPS, probe=PROBE,
                  knobs=[hpx.LabelSmoothing(base=0.1, spread=0.05)],
                      knob_start=0)
    forks = hpx.Forks(model, _sgd(model), total_steps=STEPS, probe=PROBE, loss_fn=_loss,
                      knobs=[hpx.LabelSmoothing(base=0.1, spread=0.05)],
                      knob_start=0)
    assert forks.factors[-2:] == [1.0, 1.0]  # the knob's two forks, at your lr


def test_dropout_forks_from_a_rate_of_0_keep_the_side_the_bound_allows():
    model = _net(p=0.0)
    forks = hpx.Forks(model, _sgd(model), total_steps=STEPS, probe=PROBE, knobs=[hpx.Dropout(spread=0.2)],
                      knob_start=0)
    assert [f.values["dropout"] for f in forks._forks][-1:] == [0.2] and len(forks.factors) == 6


def _state_bits(forks: hpx.Forks) -> list[torch.Tensor]:
    return [t.clone() for f in [*forks._forks, *forks._clones] for t in f.model.state_dict().values()]


def test_misuse_at_construction_is_refused_naming_the_value_and_the_fix():
    model = _net(p=0.0)
    with pytest.raises(hpx.ConfigError, match=r"parameter group 0's lr is nan: give a finite learning rate"):
        hpx.Forks(model, torch.optim.SGD(model.parameters(), lr=float("nan")), total_steps=STEPS, probe=PROBE)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*PROBE[0]), batch_size=16)
    with pytest.raises(hpx.ConfigError, match=r"rather than iter\(loader\)"):
        hpx.Forks(model, _sgd(model), total_steps=STEPS, probe=iter(loader))
    forks = hpx.Forks(model, _sgd(model), total_steps=STEPS, probe=loader)  # the loader itself is fine
    with pytest.raises(hpx.ConfigError, match=r"each\(\) takes a function replica -> None"):
        forks.each(5)


def test_a_hand_made_state_is_refused_before_anything_changes():
    model = _net(p=0.0)
    forks = hpx.Forks(model, _sgd(model), total_steps=STEPS, probe=PROBE)
    forks.step(_loss, BATCHES[0])
    good = forks.state_dict()
    before = _state_bits(forks)
    for bad, words in [({k: v for k, v in good.items() if k != "forks"}, "the state has no forks"),
                       ({**good, "forks": good["forks"] * 2}, "holds 10 forks \\(at most 5 here\\)"),
                       ({**good, "clones": [{**good["forks"][1], "parent": 7}]}, "a parent")]:
        with pytest.raises(hpx.ConfigError, match=words if "parent" not in words else "whose parent is not"):
            forks.load_state_dict(bad)
    assert forks.step_count == 1 and all(torch.equal(a, b) for a, b in zip(before, _state_bits(forks)))


def test_your_model_left_in_eval_mode_is_refused_and_the_run_goes_on_as_plain_training():
    model = _net(p=0.2)
    forks = hpx.Forks(model, _sgd(model), total_steps=STEPS, probe=PROBE, confidence=1e9)
    for i, b in enumerate(BATCHES[:STEPS]):
        if i == 5:
            model.eval()  # an evaluation that forgot model.train()
            before = _state_bits(forks)
            with pytest.raises(hpx.ConfigError, match="your model is in eval mode where the forks' copies"):
                forks.step(_loss, b)
            assert forks.step_count == 5
            assert all(torch.equal(a, c) for a, c in zip(before, _state_bits(forks)))
            model.train()
        forks.step(_loss, b)
    ref = _net(p=0.2)
    _plain_loop(ref, _sgd(ref))
    assert forks.factor == 1.0 and _same(model, ref)


def test_a_scaler_given_to_backward_alone_is_refused_before_any_fork_steps():
    scaler = torch.amp.GradScaler("cpu")
    model = _net(p=0.0)
    forks = hpx.Forks(model, _sgd(model, 0.03), total_steps=STEPS, probe=PROBE)
    forks.backward(_loss, BATCHES[0], scaler=scaler)
    before = _state_bits(forks)
    with pytest.raises(hpx.ConfigError, match="must be given the same GradScaler"):
        forks.optimizer_step()
    assert forks.step_count == 0 and all(torch.equal(a, b) for a, b in zip(before, _state_bits(forks)))
    forks.optimizer_step(scaler=scaler)
    for b in BATCHES[1:STEPS]:
        forks.backward(_loss, b, scaler=scaler)
        forks.optimizer_step(scaler=scaler)
    assert _same(model, _scaled_forks(0.03, torch.amp.GradScaler("cpu"))[0])


def test_an_lr_set_by_hand_on_your_optimizer_under_a_lambdalr_is_refused_at_the_next_step():
    """The README says so; the LambdaLR wrote the lr over it at its step, so it reached your run for one
    step and was never refused."""
    model = _net(p=0.0)
    opt = _sgd(model)
    forks = hpx.Forks(model, opt, total_steps=STEPS, probe=PROBE, schedule=lambda t: 1 - t / (2 * STEPS))
    for b in BATCHES[:3]:
        forks.step(_loss, b)
    opt.param_groups[0]["lr"] = 0.5
    before = _state_bits(forks)
    with pytest.raises(hpx.ConfigError, match=r"parameter group 0's lr 0\.5 where the copies have"):
        forks.step(_loss, BATCHES[3])
    assert forks.step_count == 3 and all(torch.equal(a, b) for a, b in zip(before, _state_bits(forks)))


def test_converge_before_total_steps_says_the_end_came_early(caplog):
    model = _net(p=0.0)
    forks = hpx.Forks(model, _sgd(model), total_steps=STEPS, probe=PROBE)
    for b in BATCHES[:5]:
        forks.step(_loss, b)
    with caplog.at_level("WARNING", logger="hpx"):
        forks.converge()
    assert f"converge() at step 5 of total_steps={STEPS}" in caplog.text and forks.decided


def test_an_each_that_raises_part_way_refuses_every_step_until_it_runs_through():
    """It left the forks half-changed and the next step did not notice. A function that works on every
    fork, given to each() again, ends the refusal, and the run is then as if it had run once."""
    def unfreeze(replica):
        replica.model[0].requires_grad_(True)

    calls = []

    def flaky(replica):
        unfreeze(replica)
        calls.append(replica)
        if len(calls) == 2:
            raise RuntimeError("no such layer")

    model = _frozen_net()
    forks = hpx.Forks(model, _sgd(model), total_steps=STEPS, probe=PROBE, confidence=1e9)
    for b in BATCHES[:5]:
        forks.step(_loss, b)
    with pytest.raises(RuntimeError, match="no such layer"):
        forks.each(flaky)
    before = _state_bits(forks)
    with pytest.raises(hpx.ConfigError, match=r"forks\.each\(fn\) raised \(RuntimeError: no such layer\) "
                       r"on the fork at 0\.316x, having run on your run \(not on the fork at 3\.16x\): .*"
                       r"Call forks\.each again"):
        forks.step(_loss, BATCHES[5])
    assert forks.step_count == 5 and all(torch.equal(a, b) for a, b in zip(before, _state_bits(forks)))
    forks.each(unfreeze)
    for b in BATCHES[5:STEPS]:
        forks.step(_loss, b)
    ref = _frozen_net()
    _plain_loop(ref, _sgd(ref), change=lambda i, m, o: m[0].requires_grad_(True) if i == 5 else None)
    assert forks.factor == 1.0 and _same(model, ref)


def test_your_own_optimizer_step_between_steps_is_refused_at_the_next_step():
    """Your run took the extra step and the forks did not, silently."""
    model = _net(p=0.0)
    opt = _sgd(model)
    forks = hpx.Forks(model, opt, total_steps=STEPS, probe=PROBE)
    for b in BATCHES[:3]:
        forks.step(_loss, b)
    opt.step()  # a loop that kept its own optimizer.step()
    before = _state_bits(forks)
    with pytest.raises(hpx.ConfigError, match=r"your optimizer was stepped 1 time\(s\) outside hpx\.Forks.*"
                       r"Remove optimizer\.step\(\) from the loop"):
        forks.step(_loss, BATCHES[3])
    assert forks.step_count == 3 and all(torch.equal(a, b) for a, b in zip(before, _state_bits(forks)))


def test_a_second_forks_on_a_model_in_training_is_refused_and_one_that_took_over_an_unstarted_one_wins():
    """Both stepped your model: your run took two steps per batch."""
    model = _net(p=0.0)
    first = hpx.Forks(model, _sgd(model), total_steps=STEPS, probe=PROBE)
    first.step(_loss, BATCHES[0])
    with pytest.raises(hpx.ConfigError, match=r"already the run of another hpx\.Forks \(Forks\(step=1/30.*"
                       r"End that one first \(its converge\(\)\)"):
        hpx.Forks(model, _sgd(model), total_steps=STEPS, probe=PROBE)
    first.step(_loss, BATCHES[1])  # the refused one changed nothing
    first.converge()
    hpx.Forks(model, _sgd(model), total_steps=STEPS, probe=PROBE)  # once ended, the model is free

    fresh = _net(p=0.0)
    unstarted = hpx.Forks(fresh, _sgd(fresh), total_steps=STEPS, probe=PROBE)
    again = hpx.Forks(fresh, _sgd(fresh), total_steps=STEPS, probe=PROBE)  # a cell run again
    with pytest.raises(hpx.ConfigError, match=r"another hpx\.Forks was built on this one's model"):
        unstarted.step(_loss, BATCHES[0])
    again.step(_loss, BATCHES[0])
    assert unstarted.step_count == 0 and again.step_count == 1


def test_a_model_that_cannot_be_forked_is_refused_naming_the_fix():
    meta = _net(p=0.0).to("meta")
    with pytest.raises(hpx.ConfigError, match=r"4 of the model's tensors are on the meta device \(0\.weight, "
                       r"0\.bias, 3\.weight and 1 more\).*model\.to_empty"):
        hpx.Forks(meta, _sgd(meta), total_steps=STEPS, probe=PROBE)
    bound = _net(p=0.0)
    bound.forward = torch.compile(bound.forward)  # compiled in place: every copy would run this object
    with pytest.raises(hpx.ConfigError, match=r"'Sequential' has a forward set on the object itself.*"
                       r"model\.compile\(\)"):
        hpx.Forks(bound, _sgd(bound), total_steps=STEPS, probe=PROBE)


def test_model_compile_is_plain_training_per_fork():
    """What the refusal above names as the fix: model.compile() (and torch.compile(model)) gives each
    copy its own compiled forward; every fork's losses are those of the uncompiled run."""
    def losses(how):
        model = _net(p=0.0)
        if how == "compile":
            model.compile()
        forks = hpx.Forks(model, _sgd(model), total_steps=STEPS, probe=PROBE)
        return torch.stack([forks.step(_loss, b) for b in BATCHES[:4]])

    torch.testing.assert_close(losses("compile"), losses("plain"), rtol=1e-5, atol=1e-6)


def test_a_loss_fn_that_switches_to_your_model_object_after_step_1_is_refused():
    """The check ran at step 1 only: a loss that reads your model from step 2 on trained your run
    once per fork and the copies never."""
    model = _net(p=0.0)
    forks = hpx.Forks(model, _sgd(model), total_steps=STEPS, probe=PROBE)
    forks.step(_loss, BATCHES[0])
    before = _state_bits(forks)
    with pytest.raises(hpx.ConfigError, match=r"reached none of its parameters.*not with your model object"):
        forks.step(lambda rep, b: _loss(_Rep(model), b), BATCHES[1])
    assert forks.step_count == 1 and all(torch.equal(a, b) for a, b in zip(before, _state_bits(forks)))
    assert all(p.grad is None for f in forks._forks for p in f.model.parameters())
    forks.step(_loss, BATCHES[1])


def test_the_reliability_doc_holds_the_misuse_table_naming_these_tests():
    from pathlib import Path

    from benchmarks import reliability

    assert all(callable(globals().get(test)) for *_, test in reliability.FORKS_MISUSE_ROWS)
    doc = (Path(__file__).parents[1] / "docs" / "reliability.md").read_text()
    assert "\n".join(reliability.FORKS_MISUSE_SECTION) in doc
