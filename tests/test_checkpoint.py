"""hpx.save_checkpoint / hpx.load_checkpoint in one process: exact resume, atomicity,
damaged files, refusal without change. The distributed cases are in test_engine_dist.py."""

from __future__ import annotations

import logging
import math
import random
import shutil

import pytest
import torch
from torch import nn

import hpx
import hpx.checkpoint as ckpt
from tests._digits import ce, data

STEPS, T = 23, 4
BATCHES: list = []


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 10))


class Counter:
    """A stand-in for an LR scheduler: something with state the run depends on."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, s: dict) -> None:
        self.n = s["n"]


def _engine() -> hpx.Engine:
    return hpx.Engine(_model(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                      [hpx.LearningRate(spread=0.5)], replicas=3, sync_every=T)


@pytest.fixture(autouse=True)
def _data(digits):
    global BATCHES
    BATCHES = data(digits, STEPS, size=48)


def _train(engine, counter, until: int, *, save_to=None, save_every: int = 5, keep: int = 2):
    while engine.step_count < until:
        engine.step(ce, BATCHES[engine.step_count])  # dropout draws from torch's global RNG
        counter.n += 1
        random.random()  # and the user's code from Python's
        if save_to is not None and engine.step_count % save_every == 0:
            hpx.save_checkpoint(save_to, engine, extra={"sched": counter}, keep=keep)


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for r in engine.replicas for p in r.model.parameters()]


def test_resume_continues_bit_for_bit(tmp_path):
    torch.manual_seed(1)
    random.seed(1)
    full, c_full = _engine(), Counter()
    _train(full, c_full, STEPS)
    end_rng = torch.random.get_rng_state()

    torch.manual_seed(1)
    random.seed(1)
    first, c_first = _engine(), Counter()
    _train(first, c_first, 17, save_to=tmp_path)  # saves at 5, 10, 15; the run "dies" at 17
    torch.manual_seed(999)  # the restarted process's RNG is elsewhere
    random.seed(999)
    resumed, c_res = _engine(), Counter()
    assert hpx.load_checkpoint(tmp_path, resumed, extra={"sched": c_res}) == 15
    assert resumed.step_count == 15 and c_res.n == 15
    _train(resumed, c_res, STEPS)
    assert all(torch.equal(a, b) for a, b in zip(_params(full), _params(resumed)))
    assert [r.bases for r in resumed.history] == [r.bases for r in full.history]
    assert torch.equal(torch.random.get_rng_state(), end_rng)
    # keep=2: only the two newest steps remain
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000010", "step-000000015"]


def test_nothing_saved_returns_none_and_changes_nothing(tmp_path):
    engine = _engine()
    before = _params(engine)
    state = torch.random.get_rng_state()
    assert hpx.load_checkpoint(tmp_path / "absent", engine) is None
    assert hpx.load_checkpoint(tmp_path, engine) is None
    assert all(torch.equal(a, b) for a, b in zip(before, _params(engine)))
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    engine, counter = _engine(), Counter()
    _train(engine, counter, 10, save_to=tmp_path)
    real_save = torch.save

    def dies_halfway(obj, f, *a, **k):
        f.write(b"\x80\x02partial")  # a few bytes reach the disk, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.torch, "save", dies_halfway)
    _train(engine, counter, 14)
    with pytest.raises(KeyboardInterrupt):
        hpx.save_checkpoint(tmp_path, engine)
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    folder = tmp_path / "step-000000014"
    assert not any(p.name.startswith("rank-") for p in folder.iterdir())  # no file under a final name
    # a kill that left a payload but no digest (killed between the two renames) does not count either
    (folder / "rank-00000.pt").write_bytes(b"not a checkpoint")
    fresh = _engine()
    assert hpx.load_checkpoint(tmp_path, fresh) == 10


def test_a_damaged_file_is_skipped_for_the_previous_one(tmp_path, caplog):
    engine, counter = _engine(), Counter()
    _train(engine, counter, 10, save_to=tmp_path)
    newest = tmp_path / "step-000000010" / "rank-00000.pt"
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte, somewhere inside a weight
    newest.write_bytes(bytes(raw))
    fresh = _engine()
    with caplog.at_level(logging.WARNING, logger="hpx"):
        assert hpx.load_checkpoint(tmp_path, fresh) == 5
    assert "does not match its digest" in caplog.text


def test_an_engine_that_cannot_take_it_is_refused_unchanged(tmp_path):
    engine, counter = _engine(), Counter()
    _train(engine, counter, 5, save_to=tmp_path)
    other = hpx.Engine(_model(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                       [hpx.LearningRate(spread=0.5)], replicas=3, sync_every=T + 1)
    before, rng = _params(other), torch.random.get_rng_state()
    with pytest.raises(hpx.ConfigError, match="sync_every=4"):
        hpx.load_checkpoint(tmp_path, other)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(other)))
    assert other.step_count == 0 and torch.equal(torch.random.get_rng_state(), rng)
    hpx.save_checkpoint(tmp_path / "no-extra", engine)
    with pytest.raises(hpx.ConfigError, match=r"holds no state for \['sched'\]"):
        hpx.load_checkpoint(tmp_path / "no-extra", _engine(), extra={"sched": Counter()})


@pytest.mark.parametrize("call, needle", [
    (lambda d, e: hpx.save_checkpoint(d, e, keep=0), "keep must be an integer >= 1 (got 0)"),
    (lambda d, e: hpx.save_checkpoint(d, e, extra={"s": object()}), "extra['s'] (object) has no state_dict"),
    (lambda d, e: hpx.load_checkpoint(d, e, extra=[1]), "extra must be a mapping"),
])
def test_bad_arguments_name_the_value(tmp_path, call, needle):
    engine = _engine()
    with pytest.raises(hpx.ConfigError) as err:
        call(tmp_path, engine)
    assert needle in str(err.value)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing written


# --- elastic resume ------------------------------------------------------------------------


def _engine_n(n: int) -> hpx.Engine:
    return hpx.Engine(_model(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                      [hpx.LearningRate(spread=0.5)], replicas=n, sync_every=T)


@pytest.mark.parametrize("m", [2, 8])
def test_elastic_resume_with_another_replica_count(tmp_path, m):
    src, counter = _engine_n(4), Counter()
    _train(src, counter, 10, save_to=tmp_path)  # saved at step 10, mid-interval (sync at 12)
    saved = torch.load(tmp_path / "step-000000010" / "rank-00000.pt", weights_only=False)["engine"]
    dst = _engine_n(m)
    with pytest.raises(hpx.ConfigError, match=r"checkpoint has 4 replicas, this engine 2|this engine 8"):
        hpx.load_checkpoint(tmp_path, dst)  # not asked for: refused, naming the way out
    assert hpx.load_checkpoint(tmp_path, dst, elastic=True) == 10
    assert dst.step_count == 10 and dst.next_sync == src.next_sync == 12
    assert dst.bases == src.bases and [r.bases for r in dst.history] == [r.bases for r in src.history]
    # every replica starts from the mean of the saved ones (weights and momentum)
    for name in dict(dst.replicas[0].model.named_parameters()):
        mean = torch.stack([rep["model"][name] for rep in saved["replicas"]]).mean(0)
        for r in dst.replicas:
            torch.testing.assert_close(dict(r.model.named_parameters())[name].detach(), mean)
    buf = torch.stack([rep["optimizer"]["state"][0]["momentum_buffer"] for rep in saved["replicas"]]).mean(0)
    for rep in dst.state_dict()["replicas"]:  # as each replica's optimizer would hold it
        torch.testing.assert_close(rep["optimizer"]["state"][0]["momentum_buffer"], buf)
    assert len(dst.values("lr")) == m and len(set(dst.values("lr"))) == m  # m distinct values
    _train(dst, counter, 16)  # and it trains on, through the next syncs
    assert [r.step for r in dst.history][-2:] == [12, 16]
    # the resumed engine is the saved run: its next save goes into the run's directory beside the
    # saved steps (refused as another run's before it took over the run's identity)
    _train(dst, counter, 20, save_to=tmp_path)
    assert hpx.load_checkpoint(tmp_path, _engine_n(m)) == 20
    assert all(len(r.values["lr"]) == m for r in dst.history[-2:])


def test_elastic_resume_gives_each_replica_its_own_optimizer_state(tmp_path):
    src, counter = _engine_n(4), Counter()
    _train(src, counter, 10, save_to=tmp_path)
    dst = hpx.Engine(_model(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                     [hpx.LearningRate(spread=0.5)], replicas=2, sync_every=T, shared_optimizer_state=False)
    hpx.load_checkpoint(tmp_path, dst, elastic=True)
    bufs = [r.optimizer.state[next(iter(r.model.parameters()))]["momentum_buffer"] for r in dst.replicas]
    before = bufs[0].clone()
    _train(dst, counter, 11)  # one step: each buffer takes the mean gradient once, not once per replica
    assert bufs[0].data_ptr() != bufs[1].data_ptr()
    assert torch.equal(bufs[0], bufs[1])
    assert not torch.allclose(bufs[0], 0.9 * before)  # it moved


def test_elastic_refuses_another_model(tmp_path):
    src, counter = _engine_n(4), Counter()
    _train(src, counter, 5, save_to=tmp_path)
    other = hpx.Engine(nn.Sequential(nn.Linear(64, 10)), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                       [hpx.LearningRate(spread=0.5)], replicas=2, sync_every=T)
    before = [p.detach().clone() for p in other.replicas[0].model.parameters()]
    with pytest.raises(hpx.ConfigError, match="another architecture"):
        hpx.load_checkpoint(tmp_path, other, elastic=True)
    assert all(torch.equal(a, b) for a, b in zip(before, other.replicas[0].model.parameters()))


@pytest.mark.parametrize("saved_at", [4, 10, 16, 24])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_autolr_resumes_elastically_and_runs_to_the_end(tmp_path, digits, m, saved_at):
    """Saved with 4 replicas inside the search's window (4, 10), at its end (16) and after it
    (24), resumed with 1, 2 or 8: the first sync scores the replicas where they are (no move, no
    landing), the next ones place the new count's points, and the run ends like any other."""
    steps = 40
    batches = data(digits, steps, size=48)

    def engine(n):
        return hpx.autolr(_model(), lambda mod: torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9),
                          total_steps=steps, probe=batches[:2], loss_fn=ce, replicas=n)

    def train(e, until):
        while e.step_count < until:
            e.step(ce, batches[e.step_count])

    src = engine(4)
    train(src, saved_at)
    hpx.save_checkpoint(tmp_path, src)
    base = src.bases["lr"]
    dst = engine(m)
    assert hpx.load_checkpoint(tmp_path, dst, elastic=True) == saved_at
    assert dst.bases["lr"] == base and dst.step_count == saved_at
    train(dst, steps)
    assert math.isfinite(dst.bases["lr"])
    assert all(torch.isfinite(p).all() for p in dst.converge().parameters())
    resumed = [r for r in dst.history if r.step > saved_at]
    assert resumed, "no sync after the resume"
    if resumed[0].searched:  # the first sync after the resume scored unplaced replicas: no move
        assert resumed[0].points is None and resumed[0].bases["lr"] == base
    placed = [r for r in resumed[1:] if r.points is not None]
    assert all(len(r.points) == m * -(-4 // m) for r in placed)  # the smallest multiple of m >= 4
    if saved_at < 16:  # inside the window the search goes on with the new count
        assert placed


# --- what load_checkpoint is given ------------------------------------------------------


def _saved_run(tmp_path) -> hpx.Engine:
    src, counter = _engine(), Counter()
    _train(src, counter, 10, save_to=tmp_path)  # steps 5 and 10
    return src


def test_a_file_or_a_step_folder_is_an_error_naming_the_directory_and_nothing_changes(tmp_path):
    _saved_run(tmp_path)
    dst = _engine()
    before = _params(dst)
    cases = {tmp_path / "step-000000010" / "rank-00000.pt": r"is a file: .*\(" + str(tmp_path) + r"\?\)",
             tmp_path / "step-000000010": r"one step's folder: .*\(" + str(tmp_path) + r"\)"}
    for path, message in cases.items():
        with pytest.raises(hpx.ConfigError, match=message):
            hpx.load_checkpoint(path, dst)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "readme.txt").write_text("x")
    with pytest.raises(hpx.ConfigError, match=r"holds readme.txt but no checkpoint"):
        hpx.load_checkpoint(other, dst)
    assert dst.step_count == 0 and all(torch.equal(a, b) for a, b in zip(before, _params(dst)))
    assert hpx.load_checkpoint(tmp_path, dst) == 10  # the directory itself resumes


def test_a_new_or_empty_directory_is_a_first_run_unless_required(tmp_path, caplog):
    dst = _engine()
    with caplog.at_level(logging.WARNING, logger="hpx"):
        assert hpx.load_checkpoint(tmp_path / "new", dst) is None
        assert hpx.load_checkpoint(tmp_path, dst) is None
    assert not caplog.records  # a first run is not worth a warning
    with pytest.raises(hpx.ConfigError, match=r"no checkpoint in .*required=True"):
        hpx.load_checkpoint(tmp_path, dst, required=True)
    with pytest.raises(hpx.ConfigError, match=r"required must be True or False \(got 'yes'\)"):
        hpx.load_checkpoint(tmp_path, dst, required="yes")


def test_checkpoints_that_all_fail_start_fresh_with_a_warning_or_raise_when_required(tmp_path, caplog):
    _saved_run(tmp_path)
    for f in tmp_path.glob("step-*/rank-*.pt"):
        f.write_bytes(b"damaged")
    dst = _engine()
    with caplog.at_level(logging.WARNING, logger="hpx"):
        assert hpx.load_checkpoint(tmp_path, dst) is None
    assert any("starting fresh from step 0" in r.getMessage() and "damaged" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(hpx.ConfigError, match=r"no step is complete and intact.*required=True"):
        hpx.load_checkpoint(tmp_path, dst, required=True)
    assert dst.step_count == 0


def test_a_run_restarted_fresh_over_damaged_steps_keeps_its_own_saves(tmp_path):
    """The damaged steps 10 and 15 of an earlier run are newer than the new run's step 3: they
    must not count when pruning it (the new save used to be deleted right after being written,
    so a second crash resumed from nothing)."""
    src, counter = _engine(), Counter()
    _train(src, counter, 15, save_to=tmp_path, save_every=5, keep=2)  # steps 10 and 15 kept
    for f in tmp_path.glob("step-*/rank-*.pt"):
        f.write_bytes(b"damaged")
    fresh = _engine()
    assert hpx.load_checkpoint(tmp_path, fresh) is None
    _train(fresh, Counter(), 3, save_to=tmp_path, save_every=3, keep=2)
    assert (tmp_path / "step-000000003" / "rank-00000.pt").is_file()
    assert (tmp_path / "step-000000015" / "rank-00000.pt").is_file()  # not this run's to prune
    again = _engine()
    assert hpx.load_checkpoint(tmp_path, again) == 3  # a second crash resumes the new run's save


def test_checkpoints_missing_a_file_everywhere_name_what_each_step_lacks(tmp_path):
    """Every step's digest deleted: nothing is damaged (no warning precedes it), so the message says
    what the steps lack (it said 'see the warnings above', and none had been printed)."""
    _saved_run(tmp_path)
    for f in tmp_path.glob("step-*/rank-*.pt.sha256"):
        f.unlink()
    with pytest.raises(hpx.ConfigError, match=r"on rank 0: step-\d+ lacks rank-00000\.pt\.sha256"):
        hpx.load_checkpoint(tmp_path, _engine(), required=True)


def test_a_newest_step_missing_a_file_is_skipped_with_a_warning_naming_it(tmp_path, caplog):
    _saved_run(tmp_path)
    steps = sorted(tmp_path.glob("step-*"))
    next(steps[-1].glob("rank-*.pt.sha256")).unlink()
    with caplog.at_level(logging.WARNING, logger="hpx"):
        step = hpx.load_checkpoint(tmp_path, _engine())
    assert step == int(steps[-2].name[5:])
    assert any(f"{steps[-1].name} not complete and intact on every rank; resuming from step {step}"
               in r.getMessage() for r in caplog.records)


def test_a_step_folder_of_another_engine_run_is_refused_and_a_new_run_cannot_save_over_its_steps(tmp_path):
    """The run identity holds for the engine as for hpx.Forks: another run's step copied in is
    refused at a load (it was resumed silently), and a run that did not resume cannot save beside
    another run's steps; resuming first, it saves under the resumed run's identity."""
    mine, theirs = tmp_path / "a", tmp_path / "b"
    _train(_engine(), Counter(), 10, save_to=mine, keep=3)
    _train(_engine(), Counter(), 15, save_to=theirs, keep=3)
    shutil.copytree(theirs / "step-000000015", mine / "step-000000015")
    dst = _engine()
    before = _params(dst)
    with pytest.raises(hpx.ConfigError, match=r"holds checkpoints of two runs.*step-000000015.*of another"):
        hpx.load_checkpoint(mine, dst, extra={"sched": Counter()})
    assert dst.step_count == 0 and all(torch.equal(a, b) for a, b in zip(before, _params(dst)))
    with pytest.raises(hpx.ConfigError, match=r"which this run did not resume from"):
        hpx.save_checkpoint(theirs, dst)
    shutil.rmtree(mine / "step-000000015")
    assert hpx.load_checkpoint(mine, dst, extra={"sched": Counter()}) == 10
    assert hpx.save_checkpoint(mine, dst) is not None  # the resumed run's own directory
