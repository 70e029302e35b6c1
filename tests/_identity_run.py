"""Train a fixed set of scenarios with whatever ``hpx`` is importable and save every replica's
final weights, buffers, knob bases and history lengths: ``python _identity_run.py OUT WORLD...``.

Run once with the code as it was before a restructuring and once with the code after it
(``tests/test_identity.py``): equal outputs bit for bit mean the move changed no behaviour.
Each ``WORLD`` in turn, in one launch: 1 runs the scenarios in this process, more runs them on that
many gloo processes on localhost, forked from this one (which has imported torch and hpx: a fresh
process per rank would import them again). ``OUT`` holds ``{world: outputs}``, a list of the ranks'
outputs for a world of several.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Dropout(0.1), torch.nn.Linear(16, 3))


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)) for _ in range(n)]


def _loss(rep, b):
    return F.cross_entropy(rep.model(b[0]), b[1])


def _weights(engine) -> list[torch.Tensor]:
    return [t.detach().clone() for r in engine.replicas for t in r.model.state_dict().values()]


def _knobbed(hpx, backend, local: int, mode: str, state=None):
    torch.manual_seed(5)  # the dropout masks: equal in both runs
    knobs = [hpx.LearningRate(spread=0.3), hpx.Dropout(spread=0.05)]
    e = hpx.Engine(_model(), lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01),
                   knobs, backend=backend, replicas=local, mode=mode, sync_every=3, seed=7, warmup=3)
    if state is not None:
        e.load_state_dict(state)
    return e


def _scenarios(hpx, backend, local: int, gather=lambda s: [s]) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {}
    data = _data(14)
    for mode in ("shared", "independent"):
        e = _knobbed(hpx, backend, local, mode)
        saved = None
        for t, b in enumerate(data):
            if t == 5:  # a NaN on one replica's part of the batch: left out, then reset
                b = (b[0].clone(), b[1])
                b[0][0, 0] = float("nan")
            if t % 2:  # accumulation of two micro-batches, clipping
                half = len(b[1]) // 2
                e.backward(_loss, (b[0][:half], b[1][:half]), scale=0.5)
                e.backward(_loss, (b[0][half:], b[1][half:]), scale=0.5)
                e.optimizer_step(max_grad_norm=0.5)
            else:
                e.step(_loss, b)
            if t == 7:
                saved = e.state_dict()
        out[f"{mode}/final"] = [*_weights(e), torch.tensor(list(e.bases.values()))]
        r = _knobbed(hpx, backend, local, mode, saved)  # resumed at step 8 and run to the end
        for b in data[8:]:
            r.step(_loss, b)
        out[f"{mode}/resumed"] = _weights(r)
        el = _knobbed(hpx, backend, 1, mode)  # the same run resumed with one replica per process
        el.load_elastic(gather(saved))
        for b in data[8:]:
            el.step(_loss, b)
        out[f"{mode}/elastic"] = [*_weights(el), torch.tensor(list(el.bases.values()))]
    # autolr: a schedule, a probe and a strategy that places points on the displacement
    torch.manual_seed(5)
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=40)
    probe = _data(2)
    a = hpx.autolr(m, opt, total_steps=40, schedule=sched, probe=probe, backend=backend, seed=3)
    for b in _data(40):
        a.step(_loss, b)
    out["autolr"] = [*_weights(a), torch.tensor([a.bases["lr"], len(a.history)], dtype=torch.float64)]
    return out


def _rank(rank: int, world: int, port: int, path: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import hpx
    from hpx.backends import TorchDistributed

    def gather(state):
        states = [None] * world
        dist.all_gather_object(states, state)
        return states

    out = _scenarios(hpx, TorchDistributed(), 2, gather)
    torch.save(out, f"{path}.{rank}")
    import gc

    gc.collect()  # the engines (held in reference cycles) go before the process group: gloo's
    dist.destroy_process_group()  # teardown can abort at exit while they are alive


def main() -> None:
    path, worlds = sys.argv[1], [int(w) for w in sys.argv[2:]]
    torch.set_num_threads(1)
    import hpx

    print(hpx.__file__)  # which code ran
    out = {}
    for world in worlds:
        if world == 1:
            out[world] = _scenarios(hpx, None, 3)
            continue
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_rank, args=(world, port, path), nprocs=world, start_method="fork")
        out[world] = [torch.load(f"{path}.{r}") for r in range(world)]
    torch.save(out, path)


if __name__ == "__main__":
    main()
