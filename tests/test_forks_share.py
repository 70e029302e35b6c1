"""hpx.Forks holds once what no step writes: frozen parameters from the start, the buffers the
first step left unwritten from then on; a fork's own memory is what it trains. The winner is still
plain training at its multiple, bit for bit, and a change that would break the sharing is refused
before anything changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx
from tests.test_forks import BATCHES, PROBE, _Rep, _same

STEPS = 30


class _Tuned(nn.Module):
    """A frozen base (Linear + BatchNorm kept in eval mode, a constant mask buffer) under a
    trainable head, with a buffer of its own the step writes (a step counter)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh())
        self.base.requires_grad_(False)
        self.register_buffer("mask", (torch.arange(32) % 4 != 0).float())  # never written
        self.register_buffer("seen", torch.zeros(()))  # written by every training forward
        self.head = nn.Linear(32, 1)

    def train(self, mode: bool = True) -> _Tuned:
        super().train(mode)
        self.base.eval()  # the frozen base keeps its running statistics
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += 1
        return self.head(self.base(x) * self.mask)


def _loss(rep, b):
    return F.mse_loss(rep.model(b[0]).squeeze(-1), b[1])


def _adamw(model: nn.Module, lr: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)  # frozen parameters included


def _plain(model: nn.Module, opt: torch.optim.Optimizer, steps: int = STEPS) -> None:
    model.train()
    for b in BATCHES[:steps]:
        opt.zero_grad(set_to_none=True)
        _loss(_Rep(model), b).backward()
        opt.step()


def _held(forks: hpx.Forks) -> list[nn.Module]:
    return [f.model for f in [*forks._forks, *forks._clones]]


def test_frozen_parameters_and_unwritten_buffers_are_held_once_and_the_winner_is_plain_training():
    model = _Tuned().train()
    opt = _adamw(model, 1e-3)
    forks = hpx.Forks(model, opt, total_steps=STEPS, probe=PROBE, multiples=(0.1, 1.0, 10.0),
                      cuts=((0.4, 2),), confidence=0)
    frozen = [model.base[0].weight, model.base[0].bias, model.base[1].weight, model.base[1].bias]
    assert all(m.base[0].weight is frozen[0] and m.base[1].bias is frozen[3] for m in _held(forks))
    assert all(m.head.weight is not model.head.weight for m in _held(forks)[1:])  # what trains is its own
    assert all(m.mask is not model.mask for m in _held(forks)[1:])  # not known to be unwritten yet
    shared_seen = []
    for i, b in enumerate(BATCHES[:STEPS]):
        forks.step(_loss, b)
        if i == 0:  # the first step showed which buffers a step writes
            assert all(m.mask is model.mask for m in _held(forks))
            assert all(m.seen is not model.seen for m in _held(forks)[1:])
            assert all(m.base[1].running_mean is not model.base[1].running_mean for m in _held(forks)[1:])
        if forks._clones:  # a cut's annealed copies hold them once too
            shared_seen.append(all(c.model.base[0].weight is frozen[0] and c.model.mask is model.mask
                                   for c in forks._clones))
    assert shared_seen and all(shared_seen)
    assert forks.factor == 10.0  # the fastest fork wins this short run (whichever: compared below)

    ref = _Tuned().train()
    ref_opt = _adamw(ref, 1e-3 * forks.factor)
    _plain(ref, ref_opt)
    assert _same(model, ref) and float(model.seen) == STEPS
    got, want = opt.state_dict(), ref_opt.state_dict()
    assert got["state"].keys() == want["state"].keys()  # no state for the frozen parameters
    assert all(torch.equal(got["state"][k][n], want["state"][k][n])
               for k in want["state"] for n in ("exp_avg", "exp_avg_sq", "step"))


def test_share_false_copies_everything():
    model = _Tuned().train()
    forks = hpx.Forks(model, _adamw(model, 1e-3), total_steps=STEPS, probe=PROBE, share=False)
    forks.step(_loss, BATCHES[0])
    assert all(m.base[0].weight is not model.base[0].weight and m.mask is not model.mask
               for m in _held(forks)[1:])
    with pytest.raises(hpx.ConfigError, match="share must be True or False"):
        hpx.Forks(model, _adamw(model, 1e-3), total_steps=STEPS, probe=PROBE, share=1)


def test_a_frozen_layer_unfrozen_through_each_is_trained_by_every_fork_on_its_own():
    """Unfreezing through forks.each() first gives every other fork its own copy of the layer:
    the winner (a challenger) is plain training at its multiple with the same change."""
    def unfreeze(replica):
        replica.model.base[0].requires_grad_(True)

    def run(model, step):
        for i, b in enumerate(BATCHES[:STEPS]):
            if i == 5 and step is None:
                unfreeze(_Rep(model))
            elif i == 5:
                forks.each(unfreeze)
                other = forks._forks[1].model
                assert other.base[0].weight is not model.base[0].weight  # its own now
                assert other.base[1].weight is model.base[1].weight  # still frozen: still held once
            (step or _plain_step)(b)

    model = _Tuned().train()
    opt = _adamw(model, 1e-3)  # built on every parameter: the frozen ones start training when unfrozen
    forks = hpx.Forks(model, opt, total_steps=STEPS, probe=PROBE, multiples=(1.0, 10.0), cuts=(),
                      confidence=0)
    run(model, lambda b: forks.step(_loss, b))
    assert forks.factor == 10.0

    ref = _Tuned().train()
    ref_opt = _adamw(ref, 1e-2)

    def _plain_step(b):
        ref_opt.zero_grad(set_to_none=True)
        _loss(_Rep(ref), b).backward()
        ref_opt.step()

    run(ref, None)
    assert _same(model, ref)
    assert not torch.equal(ref.base[0].weight, _Tuned().base[0].weight)  # the unfrozen layer trained


def test_unfreezing_your_model_alone_is_refused_before_anything_changes():
    model = _Tuned().train()
    forks = hpx.Forks(model, _adamw(model, 1e-3), total_steps=STEPS, probe=PROBE)
    for b in BATCHES[:3]:
        forks.step(_loss, b)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in _held(forks)]
    model.base[0].requires_grad_(True)
    with pytest.raises(hpx.ConfigError, match=r"parameter 'base\.0\.weight' was frozen.*forks\.each"):
        forks.step(_loss, BATCHES[3])
    assert forks.step_count == 3
    assert all(torch.equal(v, s[k]) for m, s in zip(_held(forks), before) for k, v in m.state_dict().items())


def test_a_shared_buffer_written_after_the_first_step_stops_the_run_with_its_name():
    model = _Tuned().train()
    forks = hpx.Forks(model, _adamw(model, 1e-3), total_steps=STEPS, probe=PROBE)
    forks.step(_loss, BATCHES[0])
    assert _held(forks)[1].mask is model.mask
    model.mask.mul_(1.0)  # a late in-place write, as a cache filled at step 2 would make
    with pytest.raises(hpx.ConfigError, match=r"buffer 'mask' was written in place after the first step.*"
                                              r"share=False"):
        forks.step(_loss, BATCHES[1])


def test_a_buffer_a_knob_sets_apart_is_not_shared():
    """A buffer each fork holds at another value (set by each()) is no buffer to share."""
    model = _Tuned().train()
    forks = hpx.Forks(model, _adamw(model, 1e-3), total_steps=STEPS, probe=PROBE)
    values = iter(range(100))
    forks.each(lambda rep: rep.model.mask.fill_(1.0 + next(values)))
    forks.step(_loss, BATCHES[0])
    assert all(m.mask is not model.mask for m in _held(forks)[1:])


def test_a_resumed_run_holds_them_once_again_and_goes_on_bit_for_bit(tmp_path):
    def build():
        m = _Tuned().train()
        return m, hpx.Forks(m, _adamw(m, 1e-3), total_steps=STEPS, probe=PROBE, multiples=(0.1, 1.0, 10.0),
                            cuts=((0.4, 2),), confidence=0)

    model, forks = build()
    for b in BATCHES[:13]:  # inside the cut's annealed window
        forks.step(_loss, b)
    assert forks._clones
    torch.save(forks.state_dict(), tmp_path / "s.pt")
    for b in BATCHES[13:STEPS]:
        forks.step(_loss, b)

    again, resumed = build()
    resumed.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=False))
    assert all(m.base[0].weight is again.base[0].weight and m.mask is again.mask for m in _held(resumed))
    assert all(m.seen is not again.seen for m in _held(resumed)[1:])
    for b in BATCHES[13:STEPS]:
        resumed.step(_loss, b)
    assert resumed.factor == forks.factor and _same(again, model)


def test_the_memory_benchmark_measures_each_configuration_in_a_fresh_process():
    """The plumbing of ``python -m benchmarks.forks_memory`` on a small width (its figures are the
    benchmark's, not a test's)."""
    pytest.importorskip("sklearn")
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks import forks_memory

    with ThreadPoolExecutor(2) as pool:  # the two fresh processes side by side, one per core
        forks_run = pool.submit(forks_memory.measure, "full", "forks", steps=20, width=96)
        plain_run = pool.submit(forks_memory.measure, "frozen", "plain", steps=20, width=96)
        forks, plain = forks_run.result(), plain_run.result()
    assert forks["trained"] == forks["params"] == 64 * 96 + 3 * 96 * 97 + 96 + 970
    assert plain["trained"] == 96 * 256 + 256 + 2570 < plain["params"]
    assert forks["bytes"] > 0 and plain["bytes"] > 0
    assert forks["fork_steps"] > 2 * 20 and "fork_steps" not in plain
    res = {k: {"plain": plain, "forks": forks} for k in forks_memory.KINDS}
    text = forks_memory.section(res, "python -m benchmarks.forks_memory", 1.0)
    assert text.count("\n| ") == 2 + len(forks_memory.KINDS) and "frozen, a trainable head" in text


def _frozen_data_write(model: nn.Module) -> None:
    model.base[0].weight.data.mul_(0.5)  # through .data: torch counts no version


def _frozen_write(model: nn.Module) -> None:
    with torch.no_grad():
        model.base[0].weight.mul_(0.5)


def _buffer_write(model: nn.Module) -> None:
    model.mask.mul_(2.0)


def _buffer_assigned(model: nn.Module) -> None:
    model.mask = torch.ones(32)


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize(("write", "match"), [
    (_buffer_write, r"buffer .*'mask' was written in place"),
    (_frozen_write, r"frozen parameter 'base\.0\.weight' was written in place"),
    (_buffer_assigned, r"buffer 'mask' of your model was replaced by assignment"),
])
def test_a_write_to_what_the_forks_hold_alike_on_your_model_alone_is_refused_in_both_modes(
        share, write, match):
    """A buffer no step writes or a frozen weight, written on your model alone between steps: with
    share=False your run alone used the new value (the forks kept the old one), with share=True every
    fork did at once; replaced by assignment, the winner's old one was loaded over yours at the end.
    Refused at the next step in both modes, the same way, before anything changes."""
    model = _Tuned().train()
    forks = hpx.Forks(model, _adamw(model, 1e-3), total_steps=STEPS, probe=PROBE, share=share)
    for b in BATCHES[:3]:
        forks.step(_loss, b)
    write(model)
    with pytest.raises(hpx.ConfigError, match=match + r".*forks\.each"):
        forks.step(_loss, BATCHES[3])
    assert forks.step_count == 3


@pytest.mark.parametrize("share", [True, False])
def test_a_frozen_weight_written_through_data_on_your_model_alone_is_refused_at_the_next_decision(share):
    model = _Tuned().train()
    forks = hpx.Forks(model, _adamw(model, 1e-3), total_steps=STEPS, probe=PROBE, share=share)
    for b in BATCHES[:2]:
        forks.step(_loss, b)
    _frozen_data_write(model)
    with pytest.raises(hpx.ConfigError, match=r"parameter 'base\.0\.weight' changed on your model outside "
                                              r"forks\.each\(\) \(a write through \.data"):
        for b in BATCHES[2:STEPS]:
            forks.step(_loss, b)
    at = forks.step_count
    assert 2 < at < STEPS and not forks.decided
    with pytest.raises(hpx.ConfigError, match=r"changed on your model outside forks\.each"):  # and after
        forks.step(_loss, BATCHES[at])
    assert forks.step_count == at


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("write", [_buffer_write, _frozen_data_write, _frozen_write])
def test_each_writes_what_every_fork_holds_once_exactly_once(share, write):
    """forks.each(lambda r: r.model.mask.mul_(2)) doubled the one shared buffer once per fork (4.0 on
    a run of 2 forks; 2.0 with share=False), a frozen weight halved once per fork likewise. Every
    fork now holds the value one write gives, in both modes, and the run goes on through decisions."""
    model = _Tuned().train()
    forks = hpx.Forks(model, _adamw(model, 1e-3), total_steps=STEPS, probe=PROBE, share=share)
    for b in BATCHES[:3]:
        forks.step(_loss, b)
    mask, weight = model.mask.clone(), model.base[0].weight.detach().clone()
    forks.each(lambda rep: write(rep.model))
    want_mask = mask * 2 if write is _buffer_write else mask
    want_weight = weight if write is _buffer_write else weight * 0.5
    for m in _held(forks):
        assert torch.equal(m.mask, want_mask) and torch.equal(m.base[0].weight, want_weight)
        assert (m.mask is model.mask) is (share and m is not model) or m is model
    for b in BATCHES[3:STEPS]:  # through every decision: nothing refused
        forks.step(_loss, b)
    assert forks.decided


def test_with_share_false_a_buffer_every_step_writes_is_each_forks_own():
    """share=False: a buffer the steps write (a counter) is each fork's, not refused."""
    model = _Tuned().train()
    forks = hpx.Forks(model, _adamw(model, 1e-3), total_steps=STEPS, probe=PROBE, share=False)
    for b in BATCHES[:STEPS]:
        forks.step(_loss, b)
    assert forks.decided and float(model.seen) >= STEPS


def test_the_reliability_doc_holds_the_round_two_table_naming_tests_that_exist():
    import importlib
    from pathlib import Path

    from benchmarks import reliability

    for *_, tests in reliability.FORKS_ROUND_TWO_ROWS:
        for ref in tests.split(","):
            path, name = ref.strip().split("::")
            module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
            assert callable(getattr(module, name, None)), ref
    doc = (Path(__file__).parents[1] / "docs" / "reliability.md").read_text()
    assert "\n".join(reliability.FORKS_ROUND_TWO_SECTION) in doc
    # the command ran them: the line below the table, as run_round_two writes it, every one passed
    ran = f"Run by this command: the {len(reliability.round_two_tests())} tests named above, each with its"
    line = next(x for x in doc.splitlines() if x.startswith(ran))
    assert " passed (" in line and "failed" not in line and line.endswith("pytest's exit status 0).")
