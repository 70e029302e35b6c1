"""A floating buffer that holds ``-inf`` from the start (a causal mask) is a constant, not a weight:
syncs neither average it nor read it as a blown-up replica, in every mode and backend."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hpx
from hpx.averaging import constant_buffers, float_state
from tests._dist import run_distributed

CTX, VOCAB = 12, 16


class _MaskedLM(nn.Module):
    """A real ``nn.TransformerEncoder`` LM with its causal mask registered as a float buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(16, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CTX))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.tok(x), mask=self.mask, is_causal=True))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):  # a learnable sequence: each token is the previous one plus 1
        start = torch.randint(0, VOCAB, (8, 1), generator=g)
        seq = (start + torch.arange(CTX + 1)) % VOCAB
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def _loss(rep, batch):
    x, y = batch
    return F.cross_entropy(rep.model(x).reshape(-1, VOCAB), y.reshape(-1))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _MaskedLM()


def test_a_mask_of_minus_inf_is_named_a_constant_and_batchnorm_statistics_are_not():
    m = nn.Sequential(_MaskedLM(), nn.BatchNorm1d(4))
    assert constant_buffers(m) == frozenset({"0.mask"})
    names = [n for n, b in m.named_buffers() if b.is_floating_point()]
    assert len(float_state(m)) - len(float_state(m, constant_buffers(m))) == 1
    assert "1.running_mean" in names and "1.running_var" in names


@pytest.mark.parametrize("mode", ["shared", "independent"])
def test_a_transformer_with_a_mask_buffer_trains_through_syncs_in_process(mode):
    model = _model()
    mask = model.mask.clone()
    engine = hpx.Engine(model, lambda m: torch.optim.Adam(m.parameters(), lr=3e-3),
                        [hpx.LearningRate("lr", base=3e-3, spread=0.2)], replicas=2, sync_every=5,
                        mode=mode, seed=0)
    batches = _batches(40)
    with torch.no_grad():
        first = sum(float(_loss(engine.replicas[0], b)) for b in batches[:4])
    for b in batches:
        engine.step(_loss, b)
    final = engine.converge()
    assert len(engine.history) >= 7  # it went through its syncs
    assert not any(r.nonfinite for r in engine.history)  # no replica was blamed
    for r in engine.replicas:
        assert torch.equal(r.model.mask, mask)  # the -inf entries are still -inf, nothing became NaN
    with torch.no_grad():
        last = sum(float(_loss(engine.replicas[0], b)) for b in batches[:4])
    assert last < 0.8 * first
    assert final is engine.replicas[0].model


def test_autolr_on_a_transformer_with_a_mask_buffer_runs_its_search():
    model = _model()
    batches = _batches(60)
    engine = hpx.autolr(model, torch.optim.AdamW(model.parameters(), lr=3e-3), total_steps=60,
                        probe=batches[:2], seed=0)
    for b in batches:
        engine.step(_loss, b)
    engine.converge()
    searched = [r for r in engine.history if r.searched]
    assert searched and all(torch.isfinite(torch.tensor(r.scores)).all() for r in searched)
    assert torch.isinf(model.mask).sum() == CTX * (CTX - 1) // 2


def test_a_buffer_that_becomes_non_finite_in_training_is_still_caught():
    """Only buffers non-finite *before* training are constants: statistics that blow up later
    are weights gone bad, and the replica holding them is reset."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    engine = hpx.Engine(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.01),
                        [hpx.LearningRate("lr", base=0.01, spread=0.2)], replicas=2, sync_every=2, seed=0)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))

    def loss(rep, b):
        return F.cross_entropy(rep.model(b[0]), b[1])

    engine.step(loss, (x, y))
    with torch.no_grad():
        engine.replicas[1].model[1].running_var.fill_(float("nan"))
    engine.step(loss, (x, y))
    assert engine.history[-1].nonfinite == [1]
    assert torch.isfinite(engine.replicas[1].model[1].running_var).all()


def _dist_scenario(rank: int, world_size: int, mode: str) -> dict:
    torch.manual_seed(0)
    net = _MaskedLM()
    model = DDP(net) if mode == "shared" else net
    engine = hpx.Engine(model, lambda m: torch.optim.Adam(m.parameters(), lr=3e-3),
                        [hpx.LearningRate("lr", base=3e-3, spread=0.2)], mode=mode, sync_every=5, seed=0,
                        backend=hpx.backends.TorchDistributed())
    for b in _batches(20):
        half = len(b[0]) // world_size
        engine.step(_loss, (b[0][rank * half:(rank + 1) * half], b[1][rank * half:(rank + 1) * half]))
    engine.converge()
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    return {"syncs": len(engine.history), "blamed": [r.nonfinite for r in engine.history],
            "mask_inf": int(torch.isinf(net.mask).sum()), "mask_nan": int(torch.isnan(net.mask).sum()),
            "equal": all(torch.equal(gathered[0], g) for g in gathered)}


def _both_modes(rank: int, world: int) -> dict:
    """Each mode in turn in one launch (starting the processes costs more than a run)."""
    return {mode: _dist_scenario(rank, world, mode) for mode in ("shared", "independent")}


@pytest.fixture(scope="module")
def dist_runs() -> list[dict]:
    return run_distributed(_both_modes, 2, timeout=180)


@pytest.mark.parametrize("mode", ["shared", "independent"])
def test_a_transformer_with_a_mask_buffer_trains_through_syncs_on_two_gloo_processes(dist_runs, mode):
    for out in [r[mode] for r in dist_runs]:
        assert out["syncs"] == 4
        assert all(b == [] for b in out["blamed"])
        assert out["mask_inf"] == CTX * (CTX - 1) // 2 and out["mask_nan"] == 0
        assert out["equal"]
