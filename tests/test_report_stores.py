"""The report commands write a section of docs/benchmarks.md from stored results (under ``runs/``,
gitignored, which a fresh clone has none of, or committed, where a store is missing until its
command has run). From a store that is missing, empty or short of a task they
must exit naming the store and the command that makes it, and leave the docs byte for byte as
they were; and the bar's cost row reads the optimizer steps the cost command stores.

Nothing here trains: every store is a temporary file, hand-made or absent.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("transformers")
pytest.importorskip("pydoc_data.topics")

from benchmarks.lr import __main__ as suite
from benchmarks.lr import bar, carve, noise, probesize, warmup
from benchmarks.lr.run import Run
from benchmarks.lr.tasks import HELD_OUT, TASKS

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


@pytest.fixture
def lr_stores(tmp_path, monkeypatch):
    """The suite's stores in an empty temporary directory, and docs/benchmarks.md a copy there."""
    runs = tmp_path / "runs"
    doc = tmp_path / "benchmarks.md"
    shutil.copy(DOCS, doc)
    monkeypatch.setattr(suite, "RUNS", runs)
    monkeypatch.setattr(suite, "STORED", runs)  # the committed stores' folder too
    monkeypatch.setattr(suite, "DOC", doc)
    monkeypatch.setattr(bar, "COST", runs / "cost.json")
    monkeypatch.setattr(bar, "COEXPLORE", runs / "coexplore.json")
    monkeypatch.setattr(noise, "PATH", runs / "noise.json")
    monkeypatch.setattr(probesize, "STORE", runs / "probesize.json")
    return runs, doc


def _refused(fn, *words: str) -> str:
    """Run ``fn``; it must exit non-zero with a message holding each of ``words``."""
    with pytest.raises(SystemExit) as e:
        fn()
    message = e.value.code
    assert isinstance(message, str), message  # a message, which exits with status 1
    for w in words:
        assert w in message, (w, message)
    assert "was left as it is" in message
    return message


def _suite_store(runs: Path, method: str, tasks: list[str]) -> None:
    """A store holding a run (empty) of every cell of ``tasks``: what the refusal checks for."""
    grids = suite._load(suite.GRIDS)
    keys = [Run(t, method, lr, s).key for t in tasks for lr in suite.cells(t, grids).values()
            for s in suite.SEEDS]
    runs.mkdir(exist_ok=True)
    (runs / f"{method}.json").write_text(json.dumps({key: {} for key in keys}))


def test_the_suite_report_refuses_a_missing_empty_or_short_store(lr_stores):
    runs, doc = lr_stores
    before = doc.read_bytes()
    report = lambda: suite.main(["report", "--method", "Forks"])  # noqa: E731
    _refused(report, "Forks.json is missing", "`python -m benchmarks.lr eval --method Forks`",
             "hours on two cores", str(doc))
    assert doc.read_bytes() == before
    runs.mkdir()
    (runs / "Forks.json").write_text("{}")
    _refused(report, "Forks.json holds no results:", "`python -m benchmarks.lr eval --method Forks`")
    assert doc.read_bytes() == before
    # every task but one: the report names it, and the command that runs it alone
    last = list(TASKS)[-1]
    _suite_store(runs, "Forks", list(TASKS)[:-1])
    _refused(report, f"Forks.json holds no results for {last}:",
             f"`python -m benchmarks.lr eval --method Forks --tasks {last}`")
    assert doc.read_bytes() == before
    # each method of a two-method report is checked, the second as well as the first
    _suite_store(runs, "Forks", list(TASKS))
    _refused(lambda: suite.main(["report", "--method", "Forks", "autolr"]), "autolr.json is missing",
             "`python -m benchmarks.lr eval --method autolr`")
    assert doc.read_bytes() == before


def test_the_bar_refuses_each_store_it_reads_until_all_hold_runs(lr_stores, capsys):
    runs, doc = lr_stores
    before = doc.read_bytes()
    write = lambda: bar.main(["--method", "Forks"])  # noqa: E731
    _refused(write, "Forks.json is missing", "`python -m benchmarks.lr eval --method Forks`")
    assert doc.read_bytes() == before and not runs.exists()
    assert capsys.readouterr().out == ""  # nothing printed as if it were the bar
    _suite_store(runs, "Forks", list(TASKS))
    for name, command in (("coexplore.json", "python -m benchmarks.lr.coexplore"),
                          ("cost.json", "python -m benchmarks.lr.cost"),
                          ("noise.json", "python -m benchmarks.lr.noise")):
        _refused(write, f"{name} is missing", f"`{command}`")
        assert doc.read_bytes() == before
        (runs / name).write_text("{}")
        _refused(write, f"{name} holds no results", f"`{command}`")
        assert doc.read_bytes() == before
        (runs / name).write_text(json.dumps({"some run": {}}))
    bar.require_stores("Forks")  # every store holds runs: the section would be written


def _ran_nothing(module, monkeypatch) -> list:
    """``module``'s runs and its numerics check replaced by a record of their calls (none expected)."""
    ran: list = []
    monkeypatch.setattr(module, "_run_all", lambda *a, **k: ran.append(a))
    monkeypatch.setattr(module, "numerics_problem", lambda *a, **k: ran.append(a))
    return ran

def test_probesize_refuses_before_it_runs_anything_without_the_suites_runs(lr_stores, monkeypatch):
    _, doc = lr_stores
    before = doc.read_bytes()
    ran = _ran_nothing(probesize, monkeypatch)
    _refused(lambda: probesize.main(["--tasks", "digits_mlp"]), "Forks.json is missing",
             "`python -m benchmarks.lr eval --method Forks`")
    assert ran == [] and doc.read_bytes() == before


def test_probesize_report_only_runs_nothing_and_refuses_a_store_short_of_a_task(lr_stores, monkeypatch):
    runs, doc = lr_stores
    before = doc.read_bytes()
    ran = _ran_nothing(probesize, monkeypatch)
    tasks = ["char_mlp", "clusters_long"]
    _suite_store(runs, "Forks", tasks)
    grids = suite._load(suite.GRIDS)  # char_mlp's cut runs are stored, clusters_long's are not
    (runs / "probesize.json").write_text(json.dumps({
        Run(f"char_mlp@probe{n}", "Forks", lr, s).key: {} for n in (200, 100)
        for lr in suite.cells("char_mlp", grids).values() for s in suite.SEEDS}))
    message = _refused(lambda: probesize.main(["--tasks", *tasks, "--sizes", "200", "100", "--report-only"]),
                       "probesize.json holds no results for clusters_long", probesize.COMMAND)
    assert "char_mlp" not in message
    assert ran == [] and doc.read_bytes() == before


def test_carve_report_only_runs_nothing_and_refuses_a_store_short_of_a_task(lr_stores, monkeypatch):
    runs, doc = lr_stores
    before = doc.read_bytes()
    ran = _ran_nothing(carve, monkeypatch)
    monkeypatch.setattr(carve, "STORE", runs / "carve.json")
    grids = suite._load(suite.GRIDS)  # wine_short's runs are stored, iris_short's are not
    runs.mkdir(exist_ok=True)
    stored = {r.key: {"val": 1.0} for pair in carve._runs("wine_short", grids) for r in pair}
    (runs / "carve.json").write_text(json.dumps(stored))
    message = _refused(lambda: carve.main(["--tasks", "wine_short", "iris_short", "--report-only"]),
                       "carve.json holds no results for iris_short", carve.COMMAND)
    assert "wine_short" not in message
    assert ran == [] and doc.read_bytes() == before


def _warmup_in(runs, monkeypatch) -> tuple[list, dict]:
    """benchmarks.lr.warmup with its store in ``runs`` and its grid and runs replaced by a record of
    their calls (none expected); and the committed store, to take runs from."""
    ran: list = []
    monkeypatch.setattr(warmup, "_run_all", lambda *a, **k: ran.append(a))
    monkeypatch.setattr(warmup, "run_grid", lambda *a, **k: ran.append(a))
    monkeypatch.setattr(warmup, "STORE", runs / "warmup.json")
    runs.mkdir(exist_ok=True)
    return ran, suite._load(warmup.STORED / "warmup.json")


def test_warmup_report_only_runs_nothing_and_refuses_a_store_short_of_a_task(lr_stores, monkeypatch, capsys):
    runs, doc = lr_stores
    before = doc.read_bytes()
    ran, committed = _warmup_in(runs, monkeypatch)
    # wine_short: its grid and every search's runs; digits_mlp: its grid alone; digits_lstm: its grid
    # stopped part way (one seed's run missing); cancer_dropout: nothing
    held = {k: v for k, v in committed.items() if k.startswith(("wine_short|", "digits_mlp|plain|"))
            or (k.startswith("digits_lstm|") and not k.endswith("|plain|0.03|1"))}
    assert len(held) < len([k for k in committed if k.startswith(("wine_short|", "digits_mlp|plain|",
                                                                    "digits_lstm|"))])
    (runs / "warmup.json").write_text(json.dumps(held))
    tasks = ["wine_short", "digits_mlp", "digits_lstm", "cancer_dropout"]
    message = _refused(lambda: warmup.main(["--tasks", *tasks, "--report-only"]),
                       "warmup.json holds no results for digits_mlp, digits_lstm, cancer_dropout",
                       f"{warmup.COMMAND} --tasks digits_mlp digits_lstm cancer_dropout")
    assert "wine_short" not in message
    assert ran == [] and doc.read_bytes() == before
    # the tasks' runs in place, the same command prints the section without running anything
    (runs / "warmup.json").write_text(json.dumps({k: v for k, v in committed.items()
                                                  if k.split("|")[0] in ("wine_short", "digits_mlp")}))
    capsys.readouterr()
    assert warmup.main(["--tasks", "wine_short", "digits_mlp", "--report-only"]) == 0
    assert "| design (2) | hpx.Forks" in capsys.readouterr().out
    assert ran == [] and doc.read_bytes() == before


def test_warmup_refuses_to_resume_a_store_whose_grid_this_machine_does_not_repeat(lr_stores, monkeypatch):
    """The store's grid and the searches must share one machine's kernels: a grid run that does not
    repeat here (as if made elsewhere) stops the command before it runs anything."""
    runs, doc = lr_stores
    before = doc.read_bytes()
    ran, committed = _warmup_in(runs, monkeypatch)
    grid = {k: v for k, v in committed.items() if k.startswith("wine_short|plain|")}
    for r in grid.values():  # every run as if another machine's kernels had made it
        r["val"] = None if r["val"] is None else r["val"] * 1.3
    (runs / "warmup.json").write_text(json.dumps(grid))
    with pytest.raises(SystemExit, match="does not repeat on this machine"):
        warmup.main(["--tasks", "wine_short"])
    assert ran == [] and doc.read_bytes() == before


def test_the_benchmarks_report_only_refuses_a_missing_or_empty_results_file(tmp_path, monkeypatch):
    import benchmarks.__main__ as bench

    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "benchmarks.md"
    shutil.copy(DOCS, doc)
    before = doc.read_bytes()
    monkeypatch.setattr(bench, "ROOT", tmp_path)  # the default results file and docs, under tmp_path
    report = lambda: bench.main(["--full", "--report-only"])  # noqa: E731
    _refused(report, str(Path("benchmarks", "stored", "full.json")) + " is missing",
             "`python -m benchmarks --full`", str(doc))
    results = tmp_path / "benchmarks" / "stored" / "full.json"
    results.parent.mkdir(parents=True)
    results.write_text("{}")
    _refused(report, "full.json holds no results", "`python -m benchmarks --full`")
    assert doc.read_bytes() == before and not (tmp_path / "docs" / "img").exists()


def _cost_store(path: Path, steps: float | None, held: bool = False, skip: int = 0) -> None:
    """Every task of one set measured: Forks at 3x plain's seconds and ``steps`` times its steps."""
    names = [t for t in TASKS if (t in HELD_OUT) == held][skip:]
    row = {"plain": 2.0, "Forks": 6.0, "autolr": 3.0}
    if steps is not None:
        row["Forks steps"] = steps
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(dict.fromkeys(names, row)))


def test_the_bars_cost_row_reads_the_stored_optimizer_steps_against_2x(lr_stores):
    runs, _ = lr_stores
    cost = runs / "cost.json"
    assert dict(bar.BAR)["cost"] == "at most 2.0x plain training's optimizer steps at the defaults"
    n = sum(t not in HELD_OUT for t in TASKS)
    wall = "wall time median 3.00x plain's, 3.00-3.00 (not judged)"
    _cost_store(cost, 2.9)  # Forks at its defaults
    assert bar._cost_row("Forks", held=False) == (
        f"2.90x plain training's optimizer steps over {n} tasks (not met); {wall}")
    _cost_store(cost, 1.9)  # 3x plain's seconds: the wall time is beside the bar, not judged
    assert bar._cost_row("Forks", held=False) == (
        f"1.90x plain training's optimizer steps over {n} tasks (met); {wall}")
    assert bar._cost_row("Forks", held=True) == "no runs: `python -m benchmarks.lr.cost`"
    # a task not measured leaves the row unmet, however few its steps
    _cost_store(cost, 1.9, skip=1)
    assert bar._cost_row("Forks", held=False).startswith(
        f"1.90x plain training's optimizer steps over {n - 1} tasks (1 not measured: "
        "`python -m benchmarks.lr.cost`) (not met); ")
    # seconds without steps (a store from before they were kept, or a method that counts none)
    _cost_store(cost, None)
    for method in ("Forks", "autolr"):
        row = bar._cost_row(method, held=False)
        assert row.startswith(f"optimizer steps not stored for {n} of {n} tasks: `python -m "
                              "benchmarks.lr.cost` stores those")
        assert "(met)" not in row and "(not met)" not in row  # no verdict without the steps


@pytest.mark.parametrize("name", ["vmap_probe", "bench_step", "scaling", "forks_memory", "bench_dist"])
def test_an_engine_study_report_only_refuses_a_missing_or_empty_store(name, tmp_path, monkeypatch):
    import importlib

    module = importlib.import_module(f"benchmarks.{name}")
    doc = tmp_path / "benchmarks.md"
    shutil.copy(DOCS, doc)
    before = doc.read_bytes()
    store = tmp_path / "stored" / f"{name}.json"
    monkeypatch.setattr(module, "STORE", store)
    monkeypatch.setattr(module, "DOC", doc)
    report = lambda: module.main(["--report-only"])  # noqa: E731
    _refused(report, f"{name}.json is missing", f"`{module.COMMAND}`", str(doc))
    assert doc.read_bytes() == before
    store.parent.mkdir()
    store.write_text("{}")
    _refused(report, f"{name}.json holds no results", f"`{module.COMMAND}`")
    assert doc.read_bytes() == before
