"""The same contract over every built-in knob, then each knob's own behaviour."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpx


class Attention(nn.Module):
    """A toy attention block that reads a temperature attribute in forward."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / (x.shape[-1] ** 0.5 * self.temperature)
        return scores.softmax(-1) @ v


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.attn = Attention()
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(8, 3)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.attn(self.embed(x)))) * self.scale


def make_optimizer(net: Net) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [{"params": net.embed.parameters(), "name": "embed", "lr": 1e-2, "weight_decay": 0.0},
         {"params": [*net.attn.parameters(), *net.head.parameters()], "name": "body"}],
        lr=3e-3, weight_decay=0.05,
    )


def make_replica() -> hpx.Replica:
    torch.manual_seed(0)
    net = Net()
    return hpx.Replica(0, net, make_optimizer(net))


def where(knob: hpx.Knob, rep: hpx.Replica) -> float:
    """Where each knob keeps its value, read independently of the knob's own code."""
    if isinstance(knob, hpx.LearningRate):
        return next(g for g in rep.optimizer.param_groups if g["name"] == knob.group)["lr"]
    if isinstance(knob, hpx.WeightDecay):
        return next(g for g in rep.optimizer.param_groups if g["name"] == knob.group)["weight_decay"]
    if isinstance(knob, hpx.Dropout):
        return rep.model.drop.p
    if isinstance(knob, hpx.AttentionTemperature):
        return rep.model.attn.temperature
    if isinstance(knob, hpx.Custom):
        return rep.model.scale
    raise AssertionError(knob)


FACTORIES = {
    "lr": lambda: hpx.LearningRate("lr", group="body", spread=0.3),
    "wd": lambda: hpx.WeightDecay("wd", group="body", spread=0.3),
    "dropout": lambda: hpx.Dropout(spread=0.05),
    "temperature": lambda: hpx.AttentionTemperature(modules=Attention, spread=0.2),
    "custom": lambda: hpx.Custom("scale", get=lambda r: r.model.scale,
                                 set=lambda r, v: setattr(r.model, "scale", v), spread=0.1),
}
EXPECTED_BASE = {"lr": 3e-3, "wd": 0.05, "dropout": 0.1, "temperature": 1.0, "custom": 2.0}


@pytest.mark.parametrize("key", FACTORIES)
def test_base_is_read_from_the_replica(key):
    knob, rep = FACTORIES[key](), make_replica()
    knob.resolve_base(rep)
    assert knob.base == pytest.approx(EXPECTED_BASE[key])


@pytest.mark.parametrize("key", FACTORIES)
def test_setter_writes_where_the_model_reads(key):
    knob, rep = FACTORIES[key](), make_replica()
    knob.resolve_base(rep)
    setter = knob.bind(rep)
    setter(0.123)
    assert where(knob, rep) == 0.123
    assert knob.read(rep) == pytest.approx(0.123)


@pytest.mark.parametrize("key", FACTORIES)
def test_values_spread_around_the_base(key):
    knob, rep = FACTORIES[key](), make_replica()
    knob.resolve_base(rep)
    vals = knob.values(torch.arange(5))
    assert float(vals.mean()) == pytest.approx(knob.base, rel=1e-12)
    assert vals.min() < knob.base < vals.max()
    assert (vals >= knob.low).all() and (vals <= knob.high).all()


@pytest.mark.parametrize("key", FACTORIES)
def test_state_round_trip_and_repr(key):
    knob, rep = FACTORIES[key](), make_replica()
    knob.resolve_base(rep)
    knob.base = knob.base * 0.9
    other = FACTORIES[key]()
    other.load_state_dict(knob.state_dict())
    assert other.base == knob.base
    assert repr(knob).startswith(type(knob).__name__) and knob.name in repr(knob)
    with pytest.raises(hpx.ConfigError, match="checkpoint holds knob"):
        hpx.Dropout("other").load_state_dict(knob.state_dict())


def test_every_knob_in_one_engine_trains_and_moves():
    """All knob kinds co-explored in one engine; each replica's model really sees its values."""
    knobs = [f() for f in FACTORIES.values()] + [hpx.LabelSmoothing("ls", base=0.1, spread=0.05)]
    seen = []

    def loss(rep, batch):
        x, y = batch
        seen.append((rep.index, rep.model.attn.temperature, rep.value("temperature")))
        logits = rep.model(x)  # [batch, tokens, classes]
        return F.cross_entropy(logits.reshape(-1, 3), y.reshape(-1), label_smoothing=rep.value("ls"))

    def opt(m):
        return torch.optim.AdamW(
            [{"params": m.embed.parameters(), "name": "embed", "lr": 1e-2},
             {"params": [*m.attn.parameters(), *m.head.parameters()], "name": "body"}],
            lr=3e-3, weight_decay=0.05)

    torch.manual_seed(0)
    engine = hpx.Engine(Net(), opt, knobs, replicas=4, sync_every=3, signal=hpx.SharedBatch())
    g = torch.Generator().manual_seed(0)
    for _ in range(9):
        x = torch.randn(16, 5, 4, generator=g)
        y = torch.randint(0, 3, (16, 5), generator=g)
        engine.step(loss, (x, y))
    assert all(t == v for _, t, v in seen)  # the model read the value hpx reports
    assert len({t for _, t, _ in seen[-4:]}) == 4  # four replicas, four temperatures
    assert len(engine.history) == 3
    first = engine.history[0]
    for k in knobs:
        start = sum(first.values[k.name]) / 4
        assert engine.bases[k.name] != pytest.approx(start, rel=1e-9), k.name


def test_lr_knob_survives_optimizer_load_state_dict():
    """optimizer.load_state_dict replaces param-group dicts; the knob must write into the new ones."""
    rep = make_replica()
    knob = hpx.LearningRate(group="body")
    knob.resolve_base(rep)
    setter = knob.bind(rep)
    rep.optimizer.load_state_dict(make_replica().optimizer.state_dict())
    setter(0.5)
    assert rep.optimizer.param_groups[1]["lr"] == 0.5


def test_group_by_name_errors_list_the_names():
    rep = make_replica()
    with pytest.raises(hpx.ConfigError, match=r"named 'decoder'.*\['embed', 'body'\]"):
        hpx.LearningRate(group="decoder").bind(rep)
    with pytest.raises(hpx.ConfigError, match="has 2 group"):
        hpx.LearningRate(group=5).bind(rep)


def test_zero_weight_decay_group_is_read_and_refused_by_the_engine():
    """A group at weight decay 0 is read (hpx.Forks explores it upward, from_zero); the engine,
    which spreads a multiplicative knob by ratios of its base, refuses it naming the group that has
    a value and hpx.Forks."""
    rep = make_replica()
    knob = hpx.WeightDecay(group="embed", spread=0.2)
    knob.resolve_base(rep)
    assert knob.base == 0.0 and knob.from_zero_value() == 0.01  # AdamW: decoupled decay's default
    with pytest.raises(hpx.ConfigError, match=r"weight_decay=0.0 from parameter group 0 \(group='embed'\).*"
                                              r"needs a value > 0 to spread around: give group='body'.*"
                                              r"or use hpx.Forks, which explores a knob at 0 upward"):
        hpx.Engine(Net(), make_optimizer, [hpx.WeightDecay(group="embed", spread=0.2)], replicas=2)


def test_module_selectors():
    rep = make_replica()
    assert hpx.Dropout(modules="drop").select(rep.model) == [rep.model.drop]
    assert hpx.Dropout(modules=lambda m: [m.drop]).select(rep.model) == [rep.model.drop]
    with pytest.raises(hpx.ConfigError, match="no submodule 'nope'"):
        hpx.Dropout(modules="nope").select(rep.model)
    with pytest.raises(hpx.ConfigError, match=r"found no modules to set 'p' on in Linear \(it looked for "
                       r"torch\.nn\.modules\.dropout\._DropoutNd instances\): point it at the modules .* "
                       r"with modules="):
        hpx.Dropout().select(nn.Linear(2, 2))  # it named no fix
    with pytest.raises(hpx.ConfigError, match=r"it looked for modules=<class .*Dropout'>"):
        hpx.Dropout(modules=nn.Dropout).select(nn.Linear(2, 2))
    with pytest.raises(hpx.ConfigError, match="no attribute 'temperature'"):
        hpx.AttentionTemperature(modules="head").select(rep.model)


def test_label_smoothing_is_read_not_written():
    knob = hpx.LabelSmoothing("ls", base=0.1, spread=0.05)
    assert knob.bind(make_replica()) is None
    assert knob.kind == "add" and (knob.low, knob.high) == (0.0, 0.99)


def test_explore_false_pins_the_knob():
    knob = hpx.LearningRate(base=0.1, spread=0.5, explore=False)
    assert knob.values(torch.arange(4)).tolist() == [0.1] * 4


def test_registry_rejects_duplicates_and_non_knobs():
    with pytest.raises(hpx.ConfigError) as err:
        hpx.Knobs(hpx.Dropout("a"), hpx.LabelSmoothing("a"), "lr")
    assert len(err.value.problems) == 2
