"""The sections of docs/benchmarks.md written from committed stores (the learning-rate suite's in
``benchmarks/lr/stored/``, the engine study's measurements in ``benchmarks/stored/``) are rebuilt
here from those stores by the functions their commands write them with, and must equal the
committed text byte for byte: a figure in the docs is one a clone re-derives (issue 41).

Nothing here trains: each section is read from stored runs only. A section whose stores are not
all committed yet is skipped, naming the store and the command that makes it; each method's
table of the suite's section is checked on its own as soon as that method's store is committed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("transformers")
pytest.importorskip("pydoc_data.topics")

from benchmarks import (
    _store,
    bench_dist,
    bench_step,
    forks_knobs,
    forks_memory,
    forks_overhead,
    scaling,
    vmap_probe,
)
from benchmarks.knobs import __main__ as knobs_suite
from benchmarks.lr import __main__ as suite
from benchmarks.lr import (
    bar,
    carve,
    ceiling,
    coexplore,
    cost,
    ninth,
    noise,
    probesize,
    sidebyside,
    staged,
    warmup,
)
from benchmarks.lr import tasks as suite_tasks
from benchmarks.lr.tasks import TASKS

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
COMMANDS = {suite.store_path("Forks"): "python -m benchmarks.lr eval --method Forks",
            suite.store_path("autolr"): "python -m benchmarks.lr eval --method autolr",
            cost.COST: "python -m benchmarks.lr.cost", bar.COEXPLORE: "python -m benchmarks.lr.coexplore",
            noise.PATH: "python -m benchmarks.lr.noise",
            **{p: ceiling.COMMAND for p in (ceiling.STORE, ceiling.CHUNKS, ceiling.HALVES)},
            probesize.STORE: probesize.COMMAND, carve.STORE: carve.COMMAND, warmup.STORE: warmup.COMMAND,
            staged.STORE: staged.COMMAND, ninth.STORE: ninth.COMMAND, sidebyside.STORE: sidebyside.COMMAND,
            sidebyside.GRID: sidebyside.COMMAND}


def committed(marker: str) -> str:
    """The text of docs/benchmarks.md between ``<!-- marker -->`` and ``<!-- /marker -->``."""
    text = DOC.read_text()
    start, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    return text[text.index(start) + len(start):text.index(end)]


def needs(*stores: Path) -> None:
    """Skip unless every one of ``stores`` is committed (naming the command that makes each), and
    each method's store holds every cell of the suite (a report refuses a store short of a task)."""
    missing = [f"{_store.shown(p)} (`{COMMANDS.get(p, '?')}`)" for p in stores if not p.exists()]
    grids = suite._load(suite.GRIDS)
    for method in suite.REPORTED:
        path = suite.store_path(method)
        if path in stores and path.exists():
            store = suite._load(path)
            short = [t for t in TASKS if any(suite.Run(t, method, lr, s).key not in store
                                             for lr in suite.cells(t, grids).values() for s in suite.SEEDS)]
            if short:
                missing.append(f"{_store.shown(path)} holds no runs of {len(short)} tasks (`{COMMANDS[path]} "
                               f"--tasks {' '.join(short)}`)")
    if missing:
        pytest.skip("not committed yet: " + ", ".join(missing))


def _suite_methods() -> list[str]:
    """The methods the suite's section was reported with (its "Produced by" line)."""
    command = re.search(r"`python -m benchmarks\.lr report --method ([^`]+)`", committed("lr-suite"))
    return command.group(1).split()


def _table(method: str) -> str:
    """``method``'s table as ``python -m benchmarks.lr report`` writes it, from its committed store."""
    store = suite._load(suite.store_path(method))
    return suite.markdown(method, suite.table(method, list(TASKS), suite._load(suite.GRIDS), store))


@pytest.mark.parametrize("method", suite.REPORTED)
def test_each_methods_table_in_the_suites_section_is_its_committed_store_read(method):
    needs(suite.store_path(method))
    text = committed("lr-suite")
    head = f"### `{method}`\n\n"
    assert head in text, f"the suite's section shows no table of {method}"
    shown = text[text.index(head) + len(head):]
    nxt = shown.find("\n### `")
    shown = shown if nxt < 0 else shown[:nxt + 1]
    assert shown.rstrip("\n") == _table(method).rstrip("\n")


def test_the_suites_section_is_its_committed_stores_read():
    text = committed("lr-suite")
    methods = _suite_methods()
    needs(*(suite.store_path(m) for m in methods))
    on = re.search(r"two runs at a time, on (.+?)\.\n", text).group(1)  # the machine the runs were made on
    body = suite.suite_section(methods, suite._load(suite.GRIDS), [_table(m) for m in methods], on)
    assert text == f"\n## {suite.SUITE_TITLE}\n\n{body}"


def test_the_bars_section_is_its_committed_stores_read():
    needs(suite.store_path("Forks"), bar.COEXPLORE, cost.COST, noise.PATH)
    assert committed("lr-bar") == f"\n## {bar.TITLE}\n\n{bar.markdown('Forks')}"


@pytest.mark.parametrize("route", coexplore.ROUTES)
def test_the_coexplore_sections_tables_are_its_committed_store_read(route):
    needs(bar.COEXPLORE)  # the prose around the tables is written by hand
    shown = coexplore.tables_in(committed("coexplore"))[route]
    store = json.loads(bar.COEXPLORE.read_text())
    assert shown == "\n".join(coexplore.table(store, suite._load(suite.GRIDS), coexplore.ROUTES[route]))


def test_the_knobs_suites_section_is_its_committed_stores_read():
    """The co-exploration suite's section (``python -m benchmarks.knobs report``) from its grid and
    each reported method's committed runs."""
    if f"<!-- {knobs_suite.MARKER} -->" not in DOC.read_text():
        pytest.skip("the co-exploration suite's section is not written yet (`python -m benchmarks.knobs "
                    "report`)")
    stores = {m: knobs_suite._load(knobs_suite.STORED / f"{m}.json") for m in knobs_suite.REPORTED}
    grid = knobs_suite._load(knobs_suite.GRID)
    assert committed(knobs_suite.MARKER) == "\n" + knobs_suite.section(grid, stores)


def test_every_co_exploration_task_is_in_one_set_and_the_held_out_sets_hold_five_each():
    """The report's sets partition the suite: the design tasks and three held-out sets of five, none
    sharing a task (a task moved between sets would change what "held out" means)."""
    tasks = knobs_suite.TASKS
    for name in tasks:
        assert sum(knobs_suite.in_group(name, g) for g in knobs_suite.GROUPS) == 1, name
    held = [knobs_suite.FIRST_HELD_OUT, knobs_suite.SECOND_HELD_OUT, knobs_suite.THIRD_HELD_OUT]
    assert [len(h) for h in held] == [5, 5, 5] and len(set().union(*held)) == 15
    assert set(knobs_suite.HELD_OUT) == set().union(*held) <= set(tasks)


def test_the_readmes_co_exploration_figures_are_the_stores():
    """The README's co-exploration counts on the fresh held-out sets (the second and the third) are
    the knobs suite's committed runs."""
    stores = {m: knobs_suite.STORED / f"{m}.json" for m in ("Forks", "Optuna")}
    if not all(p.exists() for p in stores.values()):
        pytest.skip("the co-exploration suite's runs are not committed yet (`python -m benchmarks.knobs "
                    "eval`)")
    grid = knobs_suite._load(knobs_suite.GRID)
    got = {}
    for m, p in stores.items():
        sets = [knobs_suite.counts(m, knobs_suite._load(p), grid, g) for g in ("second", "third")]
        got[m] = {k: sum(c[k] for c in sets) for k in sets[0]}
    readme = " ".join((DOC.parents[1] / "README.md").read_text().split())
    said = re.search(r"On the co-exploration suite's (\d+) fresh held-out set-ups \(two sets of five, each "
                     r"committed with its grids before any search ran on it\), started at the grid's best "
                     r"cell it stays within 2% of plain training on (\d+) of (\d+) \(Optuna at the same "
                     r"steps: (\d+)\); from a worse knob value it ends at least 2% better than plain "
                     r"training from (\d+) of (\d+) starts \(Optuna: (\d+)\), and one spread per run "
                     r"rarely reaches the grid's best \((\d+) of (\d+) within 5%; Optuna: (\d+)\)", readme)
    assert said, "the README states no held-out co-exploration figures"
    f, o = got["Forks"], got["Optuna"]
    n = len(knobs_suite.SECOND_HELD_OUT) + len(knobs_suite.THIRD_HELD_OUT)
    assert [int(x) for x in said.groups()] == [n, f["best"], f["best_n"], o["best"], f["better"], f["bad_n"],
                                              o["better"], f["near"], f["bad_n"], o["near"]]


def test_the_cost_section_is_its_committed_store_read():
    needs(cost.COST)
    text = committed("lr-cost")
    m = re.search(r"`python -m benchmarks\.lr\.cost --repeats (\d+) --method ([^`]+)` on (.+?), one thread\.",
                  text)
    md = cost.section(json.loads(cost.COST.read_text()), int(m.group(1)), m.group(2).split(), m.group(3))
    assert text == md[len("<!-- lr-cost -->"):-len("<!-- /lr-cost -->")]


# the engine study's sections whose command keeps its measurement in benchmarks/stored/ (with the
# machine it was made on) and writes the section from that store alone
ENGINE = {"vmap_probe": vmap_probe, "bench_step": bench_step, "scaling": scaling,
          "forks-memory": forks_memory, "forks-overhead": forks_overhead, "forks-knobs": forks_knobs,
          "bench_dist": bench_dist}


@pytest.mark.parametrize("marker", ENGINE)
def test_an_engine_study_section_is_its_committed_store_read(marker):
    module = ENGINE[marker]
    if not module.STORE.exists():
        pytest.skip(f"not committed yet: {_store.shown(module.STORE)} (`{module.COMMAND}`)")
    text = module.stored_section(json.loads(module.STORE.read_text()))
    if marker == "bench_dist":  # its section carries its own markers
        text = text[len(bench_dist.BEGIN):-len(bench_dist.END)]
    else:  # benchmarks.report.write_section puts the stripped text between the markers
        text = f"\n{text.strip()}\n"
    assert committed(marker) == text


@pytest.mark.parametrize("marker", ["bench_quality", "bench_overhead"])
def test_the_engine_benchmarks_sections_are_their_committed_store_read(marker):
    from benchmarks import __main__ as bench
    from benchmarks.suite import SuiteConfig

    path = bench.results_path("full")
    if not path.exists():
        pytest.skip(f"not committed yet: {_store.shown(path)} (`python -m benchmarks --full`)")
    command = "python -m benchmarks --full"
    texts, _, _ = bench.sections(SuiteConfig(), bench.load_results(path), command, "img",
                                 bench.FINDINGS.read_text(), _store.shown(path))
    assert marker in texts, f"{_store.shown(path)} holds nothing the {marker} section is written from"
    assert committed(marker) == f"\n{texts[marker].strip()}\n"


def test_the_ceiling_section_is_its_committed_stores_read():
    """``python -m benchmarks.lr.ceiling --chunks 30 100 200 --val-halves --report-only``: the section
    from the committed stores, as the run wrote it (``ceiling.json`` holds reruns of grid runs made
    before the grid kept the probe's loss: none, today, so it need not exist)."""
    needs(ceiling.CHUNKS, ceiling.HALVES)
    body = ceiling.section(list(TASKS), suite._load(suite.GRIDS), suite._load(ceiling.STORE),
                           suite._load(ceiling.CHUNKS), suite._load(ceiling.HALVES), [30, 100, 200], True)
    title = "What the probe can tell: the grid's runs scored on the probe"
    assert committed("lr-ceiling") == f"\n## {title}\n\n{ceiling._INTRO}{body}"


def test_the_probesize_section_is_its_committed_stores_read():
    """``python -m benchmarks.lr.probesize --method Forks --sizes 200 100 --report-only``: the section
    from Forks' committed suite runs (the whole probe) and the committed runs with the probe cut."""
    needs(probesize.STORE, suite.store_path("Forks"))
    grids = suite._load(suite.GRIDS)
    tasks = [t for t in TASKS if t not in suite.HELD_OUT and suite.probe_size(t) > suite.PROBE_SPLIT]
    body = probesize.section("Forks", [200, 100], tasks, grids, suite.suite_runs("Forks", tasks, grids),
                             suite._load(probesize.STORE))
    assert committed("lr-probesize") == f"\n## {probesize.TITLE}\n\n{body}"


def test_the_carve_section_is_its_committed_store_read():
    """``python -m benchmarks.lr.carve --report-only``: the section from the committed store (the
    runs with the probe put back, and the carved seeds the grid lacks) and the grid's runs."""
    needs(carve.STORE)
    body = carve.section(carve.row_tasks(), suite._load(suite.GRIDS), suite._load(carve.STORE))
    assert committed("lr-carve") == f"\n## {carve.TITLE}\n\n{body}"


def test_the_warmup_section_is_its_committed_store_read():
    """``python -m benchmarks.lr.warmup --report-only``: the section from the committed store alone
    (its own grid of the OneCycleLR tasks and both searches' runs, made on one machine)."""
    needs(warmup.STORE)
    body = warmup.section(warmup.onecycle_tasks(), suite._load(warmup.STORE))
    assert committed("lr-warmup") == f"\n## {warmup.TITLE}\n\n{body}"


def test_the_eighth_held_out_section_is_its_committed_store_read():
    """``python -m benchmarks.lr.staged --report-only``: the section from the committed grid and the
    store of hpx.Forks' and Optuna's runs on the eighth held-out set."""
    assert staged.STORE.exists(), f"{staged.STORE} is missing: run `{staged.COMMAND}`"
    body = staged.section(suite._load(suite.GRIDS), suite._load(staged.STORE))
    assert committed(staged.MARKER) == f"\n## {staged.TITLE}\n\n{body}"


def test_the_ninth_held_out_section_is_its_committed_store_read():
    """``python -m benchmarks.lr.ninth --report-only``: the section from the committed grid and the
    store of hpx.Forks' and Optuna's runs on the ninth held-out set."""
    assert ninth.STORE.exists(), f"{ninth.STORE} is missing: run `{ninth.COMMAND}`"
    body = ninth.section(suite._load(suite.GRIDS), suite._load(ninth.STORE))
    assert committed(ninth.MARKER) == f"\n## {ninth.TITLE}\n\n{body}"


def test_the_readmes_warmup_figures_are_the_ninth_sets():
    """The README's line on the ninth held-out set reads the section's figures, and the count over
    both warm-up sets adds the eighth's."""
    grids = suite._load(suite.GRIDS)
    got = {m: ninth.counts(m, grids, suite._load(ninth.STORE)) for m in ninth.METHODS}
    eighth = [r for r in staged.rows("Forks", list(staged.STAGED), grids, suite._load(staged.STORE))
              if r["start"] == "10x"]
    both = got["Forks"]["high"][0] + sum(r["vs_oracle"] <= 1.05 for r in eighth)
    n = got["Forks"]["high"][1] + len(eighth)
    readme = " ".join((DOC.parents[1] / "README.md").read_text().split())
    assert (f"recovers from 10x too high in {got['Forks']['high'][0]} of {got['Forks']['high'][1]} cells "
            f"(Optuna: {got['Optuna']['high'][0]}); over both warm-up sets, {both} of {n}") in readme


def test_the_side_by_side_section_is_its_committed_stores_read():
    """``python -m benchmarks.lr.sidebyside --report-only``: the section from that machine's own grid
    of the held-out tasks and hpx.Forks' and Optuna's runs against it."""
    needs(sidebyside.STORE, sidebyside.GRID)
    body = sidebyside.section(suite._load(sidebyside.GRID), suite._load(sidebyside.STORE))
    assert committed(sidebyside.MARKER) == f"\n## {sidebyside.TITLE}\n\n{body}"


def test_the_readmes_side_by_side_figures_are_the_stores():
    """The README's line on Optuna beside hpx.Forks on the held-out tasks reads that section's stores."""
    needs(sidebyside.STORE, sidebyside.GRID)
    grids, store = suite._load(sidebyside.GRID), suite._load(sidebyside.STORE)
    rows = {m: suite.table(m, list(suite_tasks.HELD_OUT), grids, store) for m in sidebyside.METHODS}
    at, n = staged._at_or_below(rows["Forks"], rows["Optuna"])
    off = {m: sum(staged._within(rows[m], s)[0] for s in ("0.1x", "10x")) for m in sidebyside.METHODS}
    readme = " ".join((DOC.parents[1] / "README.md").read_text().split())
    assert (f"it ends at or below Optuna's loss in {at} of {n} cells; from 10x too low or too high Optuna "
            f"ends within 5% of the grid's best in {off['Optuna']} of {2 * len(suite_tasks.HELD_OUT)} cells, "
            f"hpx.Forks in {off['Forks']}.") in readme


def test_the_readmes_warmup_figures_are_the_eighth_sets():
    """The README's line on the eighth held-out set reads the section's figures."""
    grids, store = suite._load(suite.GRIDS), suite._load(staged.STORE)
    rows = {m: staged.rows(m, list(staged.STAGED), grids, store) for m in staged.METHODS}
    ok = lambda r: r["vs_oracle"] <= 1.05  # noqa: E731
    above = [r for r in rows["Forks"] if r["start"] == "10x"]
    optuna = [r for r in rows["Optuna"] if r["start"] == "10x"]
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert (f"from 10x too high in {sum(map(ok, above))} of {len(above)} cells (Optuna at the same budget: "
            f"{sum(map(ok, optuna))})") in " ".join(readme.split())


def test_the_readmes_cost_with_knobs_is_the_stores():
    """The README's steps with one, two and three knobs are forks_knobs' stored figures."""
    if not forks_knobs.STORE.exists():
        pytest.skip(f"not committed yet: {_store.shown(forks_knobs.STORE)} (`{forks_knobs.COMMAND}`)")
    rows = json.loads(forks_knobs.STORE.read_text())["res"]
    readme = " ".join((DOC.parents[1] / "README.md").read_text().split())
    said = re.search(r"knobs add a fork per knob with a lower side, raced from the start, and one branched "
                     r"at 70% of the run: (.*?) \(`python -m benchmarks\.forks_knobs`\)", readme)
    assert said, "the README's Cost line names no figure with knobs"
    assert re.findall(r"(\d\.\d)x", said.group(1)) == [f"{r['steps']:.1f}" for r in rows if r["count"]]


def test_the_forks_probe_section_is_its_committed_store_read():
    """``python -m benchmarks.forks_probe --report-only``: the section from its committed store."""
    from benchmarks import forks_probe

    if not forks_probe.STORE.exists():
        pytest.skip(f"not committed yet: {_store.shown(forks_probe.STORE)} (`{forks_probe.COMMAND}`)")
    text = forks_probe.stored_section(json.loads(forks_probe.STORE.read_text()))
    assert committed(forks_probe.MARKER) == f"\n{text.strip()}\n"


def test_the_forks_batched_section_is_its_committed_store_read():
    """``python -m benchmarks.forks_batched --report-only``: the section from the committed store alone
    (hpx.Forks(batched=True) against the sequential forks, measured on one machine)."""
    from benchmarks import forks_batched

    assert forks_batched.STORE.exists(), f"{forks_batched.STORE} is missing: run `{forks_batched.COMMAND}`"
    text = forks_batched.stored_section(json.loads(forks_batched.STORE.read_text()))
    assert committed(forks_batched.MARKER) == f"\n{text.strip()}\n"


def test_the_readmes_memory_figures_are_the_stores():
    """The README's first screen: Forks' peak memory over plain training's, from forks_memory's store."""
    res = json.loads(forks_memory.STORE.read_text())["res"]
    ratio = {k: res[k]["forks"]["bytes"] / res[k]["plain"]["bytes"] for k in ("full", "frozen", "lora")}
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert (f"Its peak memory is {ratio['full']:.1f}x plain training's for a model trained whole, "
            f"{ratio['frozen']:.1f}x with a frozen base (held once for every fork), "
            f"{ratio['lora']:.1f}x with LoRA-style adapters") in readme
