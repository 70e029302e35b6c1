"""A report command given part of what its section of docs/benchmarks.md shows (some of its methods,
tasks, routes, sizes, replica counts or variants) rewrites that part alone or nothing, or refuses
before anything runs, naming the command that writes the section whole: every other section, table
and row stays byte for byte as it was (the issue: ``report --method Forks`` took autolr's table out).

Each test works on a copy of docs/benchmarks.md in which the parts a report could rewrite are made
stale first, so a report that rewrites them shows, and one that leaves them alone shows too.
Nothing here trains or measures: reports read the committed stores, and a measurement is a stub.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("transformers")
pytest.importorskip("pydoc_data.topics")

from benchmarks import __main__ as bench
from benchmarks import bench_dist, bench_step
from benchmarks.lr import __main__ as suite
from benchmarks.lr import bar, carve, ceiling, coexplore, cost, probesize, warmup
from benchmarks.lr.tasks import TASKS

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
COMMITTED = DOCS.read_text()


def blocks(text: str) -> dict[str | None, str]:
    """Each marked section's text by its marker, and (``None``) the page with every one taken out."""
    found = re.compile(r"<!-- ([\w-]+) -->(.*?)<!-- /\1 -->", re.S)
    out: dict[str | None, str] = {m.group(1): m.group(2) for m in found.finditer(text)}
    out[None] = found.sub(lambda m: f"<!-- {m.group(1)} -->", text)
    return out


def section(text: str, marker: str) -> str:
    return blocks(text)[marker]


def stale(text: str, marker: str, old: str, new: str) -> str:
    """``text`` with ``old`` made ``new`` once, inside section ``marker`` alone."""
    body = section(text, marker)
    assert old in body, (marker, old)
    return text.replace(body, body.replace(old, new, 1), 1)


def only_changed(before: str, after: str, marker: str) -> None:
    """Every section but ``marker``, and the page around them, as they were, byte for byte."""
    a, b = blocks(before), blocks(after)
    assert a.keys() == b.keys()
    for key in a:
        if key != marker:
            assert a[key] == b[key], f"section {key} changed"


@pytest.fixture
def doc(tmp_path, monkeypatch):
    """docs/benchmarks.md a copy in ``tmp_path``, where every report command writes."""
    path = tmp_path / "benchmarks.md"
    shutil.copy(DOCS, path)
    for module in (suite, ceiling, coexplore, cost, bench_step, bench_dist):
        monkeypatch.setattr(module, "DOC", path)
    return path


def _left(fn, path: Path, capsys) -> str:
    """Run ``fn`` (a report of part of a section); it must leave ``path`` as it was and say so."""
    before = path.read_bytes()
    assert fn() == 0
    assert path.read_bytes() == before
    return capsys.readouterr().err


def _refused(fn, path: Path, *words: str) -> str:
    """Run ``fn``; it must exit naming each of ``words``, ``path`` left as it was."""
    before = path.read_bytes()
    with pytest.raises(SystemExit) as e:
        fn()
    message = e.value.code
    assert isinstance(message, str), message
    for w in words:
        assert w in message, (w, message)
    assert "was left as it is" in message
    assert path.read_bytes() == before
    return message


# ----------------------------------------------------------------------------- python -m benchmarks.lr report

_ON = re.search(r"two runs at a time, on (.+?)\.\n", section(COMMITTED, "lr-suite")).group(1)


def _stale_tables(text: str) -> str:
    """Both methods' tables in the suite's section made stale (one line each)."""
    for method in suite.REPORTED:
        head = f"### `{method}`\n\n#### Design tasks\n\n"
        text = stale(text, "lr-suite", head, head + f"(stale {method})\n")
    return text


@pytest.mark.parametrize("method", suite.REPORTED)
def test_a_suite_report_of_one_method_rewrites_its_table_and_leaves_the_others(doc, method, monkeypatch):
    monkeypatch.setattr(suite, "machine", lambda: "another machine")  # the section keeps the one it names
    doc.write_text(_stale_tables(COMMITTED))
    before = doc.read_text()
    assert suite.main(["report", "--method", method]) == 0
    after = doc.read_text()
    only_changed(before, after, "lr-suite")
    assert f"(stale {method})" not in after  # its table: rewritten from its store
    (other,) = [m for m in suite.REPORTED if m != method]
    head = f"### `{other}`\n\n#### Design tasks\n\n"  # the other's: as it was, stale line and all
    assert after == before.replace(f"### `{method}`\n\n#### Design tasks\n\n(stale {method})\n",
                                   f"### `{method}`\n\n#### Design tasks\n\n")
    assert f"{head}(stale {other})\n" in after
    assert f"report --method {' '.join(suite.REPORTED)}`" in after and _ON in after


def test_a_suite_report_of_one_method_refuses_where_the_shared_text_is_not_its_own(doc, monkeypatch):
    """The grids' table above both methods' tables is not what the report would write now (the grid
    changed since): a report of one method refuses, naming the full command, which rewrites it all."""
    monkeypatch.setattr(suite, "machine", lambda: _ON)
    doc.write_text(stale(_stale_tables(COMMITTED), "lr-suite", "| digits_mlp |", "| digits_mlp (stale) |"))
    full = f"python -m benchmarks.lr report --method {' '.join(suite.REPORTED)}"
    for method in suite.REPORTED:
        _refused(lambda m=method: suite.main(["report", "--method", m]), doc, f"`{full}`",
                 "lr-suite section", "shared text")
    before = doc.read_text()
    assert suite.main(["report", "--method", *reversed(suite.REPORTED)]) == 0  # the full command, any order
    only_changed(before, doc.read_text(), "lr-suite")
    assert doc.read_text() == COMMITTED  # byte for byte the committed section


def test_a_suite_report_of_a_method_the_section_lacks_adds_its_table_after_the_others(doc, monkeypatch):
    monkeypatch.setattr(suite, "machine", lambda: "another machine")
    committed = suite.section_tables(section(COMMITTED, "lr-suite").split("\n\n", 1)[1], list(suite.REPORTED))
    first, second = suite.REPORTED
    suite.write_section("lr-suite", suite.SUITE_TITLE,  # a section of the second method alone
                        suite.suite_section([second], suite._load(suite.GRIDS), [committed[second]], _ON))
    before = doc.read_text()
    assert suite.main(["report", "--method", first]) == 0
    after = doc.read_text()
    only_changed(before, after, "lr-suite")
    body = section(after, "lr-suite").split("\n\n", 1)[1]
    assert suite.section_methods(body) == [second, first]  # the command that writes it whole
    assert suite.section_tables(body, [second, first]) == {second: committed[second], first: committed[first]}


def test_a_suite_report_of_some_tasks_or_of_an_uncommitted_method_writes_nothing(doc, tmp_path, monkeypatch,
                                                                                  capsys):
    _left(lambda: suite.main(["report", "--method", "Forks", "--tasks", "iris_short"]), doc, capsys)
    # a method whose runs are not committed: its table is printed, the docs left as they are
    method = "halving-end-cool-z2-lost-last"
    monkeypatch.setattr(suite, "RUNS", tmp_path / "runs")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / f"{method}.json").write_text(
        suite.store_path("Forks").read_text().replace("|Forks|", f"|{method}|"))
    err = _left(lambda: suite.main(["report", "--method", "Forks", method]), doc, capsys)
    assert "not committed" in err and "python -m benchmarks.lr report --method Forks autolr" in err


# ----------------------------------------------------------------------------- the lr studies' sections

_CEILING = ["--chunks", *map(str, ceiling.SECTION_CHUNKS), "--val-halves", "--report-only"]
_PROBESIZE = ["--method", probesize.METHOD, "--sizes", *map(str, probesize.SIZES), "--report-only"]


@pytest.mark.parametrize("module, argv", [
    (ceiling, ["--report-only"]), (ceiling, ["--report-only", "--val-halves"]),
    (ceiling, ["--val-halves", "--report-only", "--tasks", "iris_short", "wine_short"]),
    (probesize, ["--report-only"]), (probesize, ["--report-only", "--sizes", "200"]),
    (probesize, ["--report-only", "--sizes", "100", "200"]),
    (probesize, [*_PROBESIZE, "--tasks", "char_mlp", "clusters_long"]),
])
def test_a_ceiling_or_probesize_report_of_part_of_its_section_writes_nothing(doc, module, argv, capsys):
    err = _left(lambda: module.main(argv), doc, capsys)
    assert f"`{module.COMMAND} --report-only`" in err


@pytest.mark.parametrize("module, argv, marker, old, new", [
    (ceiling, _CEILING, "lr-ceiling", "#### The probe cut smaller", "#### (stale) The probe cut"),
    (probesize, _PROBESIZE, "lr-probesize", "| char_mlp |", "| char_mlp (stale) |"),
])
def test_the_ceiling_or_probesize_sections_own_command_rewrites_it_alone(doc, module, argv, marker, old, new):
    doc.write_text(stale(COMMITTED, marker, old, new))
    before = doc.read_text()
    assert module.main(argv) == 0
    only_changed(before, doc.read_text(), marker)
    assert doc.read_text() == COMMITTED


@pytest.mark.parametrize("module, task, marker", [(carve, "wine_short", "lr-carve"),
                                                  (warmup, "wine_short", "lr-warmup")])
def test_a_carve_or_warmup_report_of_some_tasks_writes_nothing_and_of_all_its_section_alone(
        doc, module, task, marker, capsys):
    err = _left(lambda: module.main(["--tasks", task, "--report-only"]), doc, capsys)
    assert f"`{module.COMMAND} --report-only`" in err
    doc.write_text(stale(COMMITTED, marker, "Produced by", "(stale) Produced by"))
    before = doc.read_text()
    assert module.main(["--report-only"]) == 0
    only_changed(before, doc.read_text(), marker)
    assert doc.read_text() == COMMITTED


def test_the_bar_of_another_method_writes_nothing_and_forks_its_section_alone(doc, capsys):
    _left(lambda: bar.main(["--method", "autolr"]), doc, capsys)
    doc.write_text(stale(COMMITTED, "lr-bar", "| criterion |", "| (stale) criterion |"))
    before = doc.read_text()
    assert bar.main(["--method", "Forks"]) == 0
    only_changed(before, doc.read_text(), "lr-bar")
    assert doc.read_text() == COMMITTED


def _stale_routes(text: str) -> str:
    for route in coexplore.ROUTES:
        head = f"\n### {route}\n\n| task |"
        text = stale(text, "coexplore", head, f"\n### {route}\n\n| (stale {route}) task |")
    return text


@pytest.mark.parametrize("route", coexplore.ROUTES)
def test_a_coexplore_run_of_one_route_rewrites_its_table_and_leaves_the_others(doc, route, monkeypatch):
    monkeypatch.setattr(coexplore, "_execute", lambda *a, **k: None)  # the committed store holds every run
    doc.write_text(_stale_routes(COMMITTED))
    before = doc.read_text()
    assert coexplore.main(["--route", route]) == 0
    after = doc.read_text()
    only_changed(before, after, "coexplore")
    assert after == before.replace(f"| (stale {route}) task |", "| task |", 1)
    assert coexplore.main([]) == 0  # both routes: both tables
    assert doc.read_text() == COMMITTED


# ----------------------------------------------------------------------------- python -m benchmarks.lr.cost

_SHARED = cost.recorded(COMMITTED)  # (--repeats, machine) of the committed section's rows
TASK = "iris_short"  # a design task


@pytest.fixture
def cost_store(tmp_path, monkeypatch):
    """cost.json a copy in ``tmp_path``, and the measurement a stub that records the tasks it is given."""
    path = tmp_path / "cost.json"
    shutil.copy(cost.COST, path)
    monkeypatch.setattr(cost, "COST", path)
    measured: list[list[str]] = []

    def measure(names, repeats, methods):
        measured.append(list(names))
        for n in names:
            cost._STEPS[(n, "Forks")] = 1.5
        return [(n, 1.0, [2.0, 4.0][:len(methods)]) for n in names]

    monkeypatch.setattr(cost, "measure", measure)
    monkeypatch.setattr(cost, "_STEPS", {})
    return path, measured


def test_a_cost_report_from_the_store_alone_keeps_the_sections_repeats_and_machine(doc, cost_store,
                                                                                  monkeypatch, capsys):
    monkeypatch.setattr(cost, "machine", lambda: "another machine")
    for argv in (["--tasks"], ["--tasks", "--repeats", "1"]):
        _left(lambda a=argv: cost.main(a), doc, capsys)  # the section as it was, byte for byte
        assert cost.recorded(doc.read_text()) == _SHARED  # the committed repeats and machine, not these


def test_a_cost_run_of_some_tasks_refuses_other_repeats_or_another_machine(doc, cost_store, monkeypatch):
    store, measured = cost_store
    before = store.read_bytes()
    monkeypatch.setattr(cost, "machine", lambda: _SHARED[1])
    _refused(lambda: cost.main(["--tasks", TASK, "--repeats", "1"]), doc,
             f"measured with --repeats {_SHARED[0]} on {_SHARED[1]}",
             "`python -m benchmarks.lr.cost --repeats 1 --method Forks autolr`")
    monkeypatch.setattr(cost, "machine", lambda: "another machine")
    _refused(lambda: cost.main(["--tasks", TASK]), doc, f"on {_SHARED[1]}")
    assert measured == [] and store.read_bytes() == before


def test_a_cost_run_of_one_task_rewrites_its_row_and_leaves_the_others(doc, cost_store, monkeypatch, capsys):
    store, measured = cost_store
    monkeypatch.setattr(cost, "machine", lambda: _SHARED[1])
    old = section(COMMITTED, "lr-cost").splitlines()
    assert cost.main(["--tasks", TASK, "--repeats", str(_SHARED[0])]) == 0
    assert measured == [[TASK]]
    after = doc.read_text()
    only_changed(COMMITTED, after, "lr-cost")
    new = section(after, "lr-cost").splitlines()
    rows = [line for line in old if line.startswith("| ") and not line.startswith(f"| {TASK} |")]
    assert all(line in new for line in rows)  # every other task's row, as it was
    assert [line for line in new if line.startswith(f"| {TASK} |")] == [
        f"| {TASK} |  | {TASKS[TASK].steps} | 1.00 | 2.00 | 2.00 | 4.00 | 4.00 |"]  # its row: measured now
    assert old[:8] == new[:8]  # its "Produced by" line and the prose under it
    # another method than the section's: measured and printed, neither store nor docs written
    before = store.read_bytes()
    _left(lambda: cost.main(["--tasks", TASK, "--method", "Forks"]), doc, capsys)
    assert store.read_bytes() == before


# ----------------------------------------------------------------------------- the engine study's commands


def test_a_bench_step_run_of_fewer_replica_counts_refuses_before_it_measures(doc, tmp_path, monkeypatch):
    store = tmp_path / "bench_step.json"
    shutil.copy(bench_step.STORE, store)
    monkeypatch.setattr(bench_step, "STORE", store)
    measured: list = []
    monkeypatch.setattr(bench_step, "measure", lambda *a: measured.append(a))
    before = store.read_bytes()
    _refused(lambda: bench_step.main(["--replicas", "2"]), doc, "the rows of 4, 8 replicas",
             f"`{bench_step.COMMAND}`", "--no-write")
    _refused(lambda: bench_step.main(["--replicas", "2,16"]), doc,
             f"`{bench_step.COMMAND} --replicas 2,4,8,16`")
    assert measured == [] and store.read_bytes() == before
    doc.write_text(stale(COMMITTED, "bench_step", "| replicas |", "| (stale) replicas |"))
    written = doc.read_text()
    bench_step.main(["--report-only"])  # from the store: the section whole
    only_changed(written, doc.read_text(), "bench_step")
    assert doc.read_text() == COMMITTED


def test_a_bench_dist_run_of_fewer_variants_refuses_before_it_runs(doc, monkeypatch):
    ran: list = []

    def run(*a, **k):
        ran.append(a)
        raise RuntimeError("ran")

    monkeypatch.setattr(bench_dist.subprocess, "run", run)
    _refused(lambda: bench_dist.main(["--variants", "ddp,hpx"]), doc,
             "the rows of ddp+hook, hpx-noguard, independent", f"`{bench_dist.COMMAND}`")
    _refused(lambda: bench_dist.main(["--variants", "ddp,hpx,ddp+pyhook"]), doc,
             f"`{bench_dist.COMMAND} --variants {','.join(bench_dist.VARIANTS)},ddp+pyhook`")
    assert ran == []
    with pytest.raises(RuntimeError, match="ran"):  # printed only: runs
        bench_dist.main(["--variants", "ddp,hpx", "--no-write"])
    assert len(ran) == 1


@pytest.fixture
def engine_root(tmp_path, monkeypatch):
    """``python -m benchmarks`` rooted in ``tmp_path`` (docs/benchmarks.md a copy there, no store),
    and nothing run: a run is recorded and stops the command."""
    (tmp_path / "docs").mkdir()
    shutil.copy(DOCS, tmp_path / "docs" / "benchmarks.md")
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    ran: list = []

    def run(*a, **k):
        ran.append(a)
        raise RuntimeError("ran")

    monkeypatch.setattr(bench, "run_suite", run)
    monkeypatch.setattr(bench, "run_overhead", run)
    return tmp_path / "docs" / "benchmarks.md", ran


def test_the_engine_benchmark_of_some_tasks_refuses_before_it_runs(engine_root, tmp_path, monkeypatch):
    path, ran = engine_root
    _refused(lambda: bench.main(["--full", "--report-only", "--tasks", "mlp"]), path,
             "bench_quality section", "figures of charlm, cnn", "`python -m benchmarks --full --report-only`")
    _refused(lambda: bench.main(["--full", "--tasks", "mlp,cnn"]), path, "figures of charlm",
             "`python -m benchmarks --full`")
    _refused(lambda: bench.main(["--overhead-only", "--tasks", "mlp"]), path, "bench_overhead section",
             "`python -m benchmarks --overhead-only`")
    assert ran == []
    # every task (named, or by default), from the committed store: the sections whole, the rest alone
    monkeypatch.undo()
    monkeypatch.setattr(bench.report, "plot_all", lambda *a, **k: [])
    out = tmp_path / "out"
    out.mkdir()
    written = out / "benchmarks.md"
    written.write_text(stale(COMMITTED, "bench_quality", "### Quality", "### (stale) Quality"))
    before = written.read_text()
    assert bench.main(["--full", "--report-only", "--tasks", "mlp,charlm,cnn", "--out", str(out),
                       "--results", str(bench.results_path("full"))]) == 0
    only_changed(before, written.read_text(), "bench_quality")
    assert written.read_text() == COMMITTED
