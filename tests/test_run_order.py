"""Longest tests first under pytest-xdist: the order rule, the recorded durations, and a
real two-worker run that reorders identically in both workers."""

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from lora_conformance import run_order


def items(*ids):
    return [SimpleNamespace(nodeid=i) for i in ids]


def test_long_tests_first_longest_first_the_rest_in_collection_order():
    got = run_order.order(items("a", "b", "c", "d", "e"), {"a": 0.1, "b": 3.0, "c": 0.2, "d": 5.0, "e": 0.49})
    assert [i.nodeid for i in got] == ["d", "b", "a", "c", "e"]


def test_no_durations_keeps_collection_order():
    assert [i.nodeid for i in run_order.order(items("x", "y", "z"), {})] == ["x", "y", "z"]


def test_unreadable_or_foreign_files_mean_no_durations(tmp_path):
    p = tmp_path / "d.json"
    assert run_order.load(p) == {}
    p.write_text("{not json")
    assert run_order.load(p) == {}
    p.write_text("[1, 2]")
    assert run_order.load(p) == {}
    p.write_text(json.dumps({"t::a": 1.5, "t::b": "slow"}))
    assert run_order.load(p) == {"t::a": 1.5}


def test_path_is_per_engine_device_and_dtype(tmp_path):
    a = run_order.durations_path(tmp_path, "builtin", "cpu", "float32")
    b = run_order.durations_path(tmp_path, "builtin", "cpu", "bfloat16")
    c = run_order.durations_path(tmp_path, "my.mod:Engine", "cuda", "float32")
    assert len({a, b, c}) == 3 and c.parent == tmp_path / "durations" and ":" not in c.name


def test_recorder_sums_phases_and_merges_with_the_last_run(tmp_path):
    path = tmp_path / "durations" / "x.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"old::t": 2.0, "t::a": 9.0}))
    rec = run_order.DurationRecorder(path)
    for when, d in (("setup", 0.25), ("call", 1.0), ("teardown", 0.25)):
        rec.pytest_runtest_logreport(SimpleNamespace(nodeid="t::a", when=when, duration=d))
    rec.pytest_sessionfinish(None)
    assert json.loads(path.read_text()) == {"old::t": 2.0, "t::a": 1.5}



def test_a_test_the_run_stopped_is_recorded_as_long_as_it_ran_not_as_its_setup(tmp_path):
    """A stopped run (certify at a deadline) leaves its longest tests unfinished: their setup alone
    (a fraction of a second) would put them last in the next run, the place a stop cuts again. An
    unfinished test is recorded as at least as long as it ran, and never shorter than before."""
    import time

    path = tmp_path / "durations" / "x.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"t::known": 300.0}))
    rec = run_order.DurationRecorder(path)
    now = time.time()
    for nodeid, began in (("t::new", now - 120), ("t::known", now - 50), ("t::done", now - 10)):
        rec.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, when="setup", duration=0.001, start=began))
    for when, d in (("call", 2.0), ("teardown", 0.5)):
        rec.pytest_runtest_logreport(SimpleNamespace(nodeid="t::done", when=when, duration=d, start=now))
    rec.pytest_sessionfinish(None)
    got = json.loads(path.read_text())
    assert 120 <= got["t::new"] < 130  # stopped after running 120 s
    assert got["t::known"] == 300.0  # stopped sooner than it ran before: the longer record stays
    assert got["t::done"] == 2.501  # finished: its phases, as before

SLEEPS = """
import os, time, pytest

@pytest.mark.parametrize("n", range(6))
def test_t(n):
    with open(os.environ["ORDER_LOG"], "a") as f:  # on starting
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "serial") + " " + str(n) + "\\n")
    time.sleep(0.6 if n == 5 else 0.01)
"""


def _runner(tmp_path, name, source):
    """run(*pytest args) of the test file ``name`` (``source``) under the plugin, in a subprocess;
    each test appends its worker and name to ``order.log`` as it starts. The cache is
    ``tmp_path / "cache"``: the tests' own durations, and (fixture ``cache_with_own_durations``)
    the session's models and adapters."""
    pytest.importorskip("xdist")
    (tmp_path / name).write_text(textwrap.dedent(source))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(LORA_CONFORMANCE_LORA_CACHE=str(tmp_path / "cache"), ORDER_LOG=str(tmp_path / "order.log"))

    def run(*args):
        out = subprocess.run([sys.executable, "-m", "pytest", name, "-p", "no:cacheprovider",
                              "-p", "lora_conformance.plugin", "--device=cpu", *args], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return run


@pytest.mark.usefixtures("cache_with_own_durations")
def test_two_workers_run_the_long_test_first(tmp_path):
    run = _runner(tmp_path, "test_s.py", SLEEPS)
    run("-p", "no:xdist")  # serial: collection order, durations recorded
    first = (tmp_path / "order.log").read_text().split()
    assert first[1::2] == ["0", "1", "2", "3", "4", "5"]
    recorded = json.loads(run_order.durations_path(tmp_path / "cache", "builtin", "cpu", "float32").read_text())
    assert recorded["test_s.py::test_t[5]"] >= 0.6
    (tmp_path / "order.log").unlink()
    run("-n", "2")  # both workers collected test_t[5] first (else xdist would refuse them), so it ran first
    lines = [line.split() for line in (tmp_path / "order.log").read_text().splitlines()]
    assert sorted(n for _, n in lines) == ["0", "1", "2", "3", "4", "5"]
    # test_t[5] was each worker's first item, so the worker that got it started with it
    worker = next(w for w, n in lines if n == "5")
    assert [n for w, n in lines if w == worker][0] == "5", lines


TWO_LONG = """
import os, time, pytest

@pytest.mark.parametrize("n", range(8))
def test_t(n):
    with open(os.environ["ORDER_LOG"], "a") as f:  # on starting
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "serial") + " " + str(n) + "\\n")
    time.sleep({6: 0.8, 7: 0.7}.get(n, 0.01))
"""


@pytest.mark.usefixtures("cache_with_own_durations")
def test_two_workers_each_start_with_one_of_the_two_long_tests(tmp_path):
    """xdist's own load scheduling would send both long tests to one worker (its first chunk: the
    two first tests of the collection); one test at a time, each worker starts with one of them."""
    run = _runner(tmp_path, "test_l.py", TWO_LONG)
    run("-p", "no:xdist")  # serial: durations recorded
    (tmp_path / "order.log").unlink()
    run("-n", "2")
    lines = [line.split() for line in (tmp_path / "order.log").read_text().splitlines()]
    assert sorted(n for _, n in lines) == [str(n) for n in range(8)]
    firsts = {w: next(n for v, n in lines if v == w) for w, _ in lines}
    assert sorted(firsts.values()) == ["6", "7"], lines


def _item(nodeid, kind=None, dtype="float32"):
    marker = SimpleNamespace(args=(kind,)) if kind else None
    return SimpleNamespace(nodeid=nodeid, callspec=SimpleNamespace(params={"dtype": dtype}),
                           get_closest_marker=lambda name: marker if name == "base_model" else None)


def test_under_loadfile_files_go_longest_first_and_tests_of_one_engine_run_together():
    its = [_item("a.py::x"), _item("b.py::q2", "qwen2"), _item("b.py::hd", "llama-hd128"), _item("b.py::q2b", "qwen2"),
           _item("b.py::y"), _item("a.py::bf", dtype="bfloat16"), _item("a.py::z"), _item("c.py::w")]
    durations = {"a.py::x": 5.0, "a.py::bf": 20.0, "a.py::z": 1.0, "b.py::q2": 9.0, "b.py::hd": 9.0,
                 "b.py::q2b": 9.0, "b.py::y": 1.0}
    got = [i.nodeid for i in run_order.order(its, durations, by_file=True)]
    # b (28 s) before a (26 s) before c (unknown); in a file, one engine's tests together, in collection order
    assert got == ["b.py::q2", "b.py::q2b", "b.py::hd", "b.py::y", "a.py::x", "a.py::z", "a.py::bf", "c.py::w"]


GROUPS = """
import os, time, pytest

def log(name):
    with open(os.environ["ORDER_LOG"], "a") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "serial") + " " + name + "\\n")

@pytest.mark.base_model("qwen2")
def test_q1():
    log("q1"); time.sleep(0.7)

@pytest.mark.base_model("llama-hd128")
def test_h():
    log("h"); time.sleep(0.6)

@pytest.mark.base_model("qwen2")
def test_q2():
    log("q2")
"""


@pytest.mark.usefixtures("cache_with_own_durations")
def test_two_workers_under_loadfile_run_a_files_tests_of_one_engine_together(tmp_path):
    """Longest first alone would run q1, h, q2 (closing the qwen2 engine for h's, then starting it
    again); under --dist loadfile the workers group by engine: q1, q2, h. (xdist resets a worker's
    own dist option to "no": the controller's mode travels in workerinput.)"""
    pytest_run = _runner(tmp_path, "test_g.py", GROUPS)

    def run(*args):
        pytest_run(*args)
        log = tmp_path / "order.log"
        lines = [line.split() for line in log.read_text().splitlines()]
        log.unlink()
        return lines

    assert [n for _, n in run("-p", "no:xdist")] == ["q1", "h", "q2"]  # serial: collection order, durations recorded
    assert [n for _, n in run("-n", "2", "--dist", "loadfile")] == ["q1", "q2", "h"]




LOGGED = """import os, time, pytest

def log(name):
    with open(os.environ["ORDER_LOG"], "a") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "serial") + " " + name + "\\n")

@pytest.mark.parametrize("n", range({n}))
def test_x(n):
    log("{name}"); time.sleep({sleep})
"""


@pytest.mark.usefixtures("cache_with_own_durations")
def test_under_loadfile_xdist_hands_files_out_longest_first_not_most_tests_first(tmp_path):
    """xdist's own reordering (files with the most tests first) would hand out the file of one long
    test last, to run alone at the end: the plugin turns it off, so the workers' order (files
    longest first by the recorded durations) is the order files are handed out in."""
    for name, n, sleep in (("many", 4, 0.2), ("few", 3, 0.2)):
        (tmp_path / f"test_{name}.py").write_text(LOGGED.format(name=name, n=n, sleep=sleep))
    run = _runner(tmp_path, "test_one.py", LOGGED.format(name="one", n=1, sleep=1.0))
    log = tmp_path / "order.log"
    run("-p", "no:xdist", "test_many.py", "test_few.py")  # serial: durations recorded
    log.unlink()
    run("-n", "2", "--dist", "loadfile", "test_many.py", "test_few.py")
    names = [line.split()[1] for line in log.read_text().splitlines()]
    assert sorted(names) == ["few"] * 3 + ["many"] * 4 + ["one"], names
    # one (1.0 s) and many (0.8 s) go out first, few (0.6 s) when a worker runs low; with xdist's
    # reordering (many, few, one) the long test went out last
    assert names.index("one") < names.index("few"), names


def test_files_that_shared_an_engine_form_one_group():
    uses = {"s/a.py::t1": ["m, float32, cap"], "s/a.py::t2": [], "s/b.py::t": ["m, bfloat16, none"],
            "s/c.py::t[x]": ["m, float32, cap", "m, float32, chunk"], "s/d.py::t": ["m, float32, chunk"],
            "s/e.py::t": []}
    groups = run_order.file_groups(uses)
    # a and c share cap, c and d share chunk: one group named by its first file; b and e share nothing
    assert groups == {"s/a.py": "s/a.py", "s/c.py": "s/a.py", "s/d.py": "s/a.py"}


def test_a_groups_files_run_together_placed_by_their_summed_durations():
    its = [_item("a.py::x"), _item("b.py::y"), _item("c.py::z"), _item("d.py::w")]
    durations = {"a.py::x": 3.0, "b.py::y": 5.0, "c.py::z": 4.0, "d.py::w": 1.0}
    got = [i.nodeid for i in run_order.order(its, durations, by_file=True, groups={"a.py": "a.py", "d.py": "a.py"})]
    # units: {a, d} 4.0 (a first: longer), b 5.0, c 4.0 (ties keep collection order: a's unit first)
    assert got == ["b.py::y", "a.py::x", "d.py::w", "c.py::z"]


SHARED = """
import os, time

def log(name):
    with open(os.environ["ORDER_LOG"], "a") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "serial") + " " + name + "\\n")

def test_{name}(lora):
    {use}
    log("{name}"); time.sleep({sleep})
"""


@pytest.mark.usefixtures("cache_with_own_durations")
def test_under_loadfile_files_that_shared_an_engine_run_on_one_worker(tmp_path):
    """Files a and c asked for the same non-default engine (max_rank=16) in the last run: under
    --dist loadfile they go to one worker, so that engine starts once. Without the groups, files
    longest first (b 0.9 s, d 0.8 s, a, c) give each worker one of a and c."""
    files = {"a": ("lora.engine_with(max_rank=16)", 0.3), "b": ("pass", 0.9), "c": ("lora.engine_with(max_rank=16)", 0.2),
             "d": ("pass", 0.8)}
    for name, (use, sleep) in files.items():
        (tmp_path / f"test_{name}.py").write_text(SHARED.format(name=name, use=use, sleep=sleep))
    run = _runner(tmp_path, "test_a.py", SHARED.format(name="a", use=files["a"][0], sleep=files["a"][1]))
    log = tmp_path / "order.log"
    others = ["test_b.py", "test_c.py", "test_d.py"]
    run("-p", "no:xdist", *others)  # serial: durations and engine uses recorded
    uses = run_order.load_uses(run_order.uses_path(run_order.durations_path(tmp_path / "cache", "builtin", "cpu",
                                                                            "float32")))
    assert uses["test_a.py::test_a"] == uses["test_c.py::test_c"] != [] and uses["test_b.py::test_b"] == []
    log.unlink()
    run("-n", "2", "--dist", "loadfile", *others)
    worker = {n: w for w, n in (line.split() for line in log.read_text().splitlines())}
    assert sorted(worker) == ["a", "b", "c", "d"]
    assert worker["a"] == worker["c"], worker


def test_a_test_whose_engine_failed_is_marked_until_it_runs_without_failing(tmp_path):
    path = tmp_path / "durations" / "x.json"
    path.parent.mkdir()
    deaths = run_order.deaths_path(path)
    deaths.write_text(json.dumps({"old::t": True, "t::b": True}))

    def run(died: set):
        rec = run_order.DurationRecorder(path)
        for nodeid in ("t::a", "t::b"):
            props = [(run_order.DIED_PROPERTY, "1")] if nodeid in died else []
            rec.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, when="call", duration=0.1,
                                                         user_properties=props))
        rec.pytest_sessionfinish(None)
        return run_order.load_deaths(deaths)

    assert run({"t::a"}) == ["old::t", "t::a"]  # t::b ran and its engine held: no longer marked
    assert run(set()) == ["old::t"]  # a test not run this time keeps its mark


def test_under_loadfile_tests_whose_engine_failed_go_after_every_other():
    its = [_item("a.py::x"), _item("a.py::kill"), _item("a.py::y"), _item("b.py::z")]
    durations = {"a.py::x": 3.0, "a.py::kill": 1.0, "a.py::y": 1.0, "b.py::z": 2.0}
    got = [i.nodeid for i in run_order.order(its, durations, by_file=True, last=["a.py::kill"])]
    assert got == ["a.py::x", "a.py::y", "b.py::z", "a.py::kill"]


KILLS = """
import os, time
from lora_conformance.engines.base import EngineFailure

def log(name):
    with open(os.environ["ORDER_LOG"], "a") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "serial") + " " + name + "\\n")

def test_kill(lora):
    log("kill")
    if os.environ.get("KILL") == "1":
        raise EngineFailure("the engine core died")

def test_after(lora):
    lora.engine
    log("after"); time.sleep(0.3)
"""


@pytest.mark.usefixtures("cache_with_own_durations")
def test_under_loadfile_a_test_whose_engine_failed_runs_last_on_its_worker(tmp_path, monkeypatch):
    """test_kill's engine failed in the last run (every shared engine of its worker was closed, and
    test_after started the run's engine again): under --dist loadfile it now runs after every other
    test, on whichever worker is free last, so no test after it needs the engine again."""
    monkeypatch.setenv("KILL", "1")
    run = _runner(tmp_path, "test_k.py", KILLS)
    # test_l logs as it starts (no engine to start first): the log's order is the order tests were handed
    # out, not how long their engine starts took on a busy machine (test_after's start comes before its log).
    (tmp_path / "test_l.py").write_text(SHARED.format(name="l", use="pass", sleep=0.5))
    with pytest.raises(AssertionError):  # test_kill fails, and is recorded
        run("-p", "no:xdist", "test_l.py")
    durations = run_order.durations_path(tmp_path / "cache", "builtin", "cpu", "float32")
    assert run_order.load_deaths(run_order.deaths_path(durations)) == ["test_k.py::test_kill"]
    (tmp_path / "order.log").unlink()
    with pytest.raises(AssertionError):
        run("-n", "2", "--dist", "loadfile", "test_l.py")
    lines = [line.split() for line in (tmp_path / "order.log").read_text().splitlines()]
    assert sorted(n for _, n in lines) == ["after", "kill", "l"]
    killer = next(w for w, n in lines if n == "kill")
    assert [n for w, n in lines if w == killer][-1] == "kill", lines
    assert lines[-1][1] == "kill", f"the test handed out last: {lines}"


def test_the_checked_in_file_times_name_test_files_and_yield_to_the_last_run():
    """tests/durations.json orders a run that has no recorded durations (tests/conftest.py): every
    file it names exists (a renamed file fails here), and a file the last run timed takes the last
    run's times, not the checked-in one."""
    from pathlib import Path

    from _file_order import item_durations, seed_durations

    seed = seed_durations()
    root = Path(__file__).resolve().parents[1]
    assert seed and all((root / f).is_file() for f in seed), [f for f in seed if not (root / f).is_file()]
    items = [SimpleNamespace(nodeid=n) for n in ("tests/a.py::x", "tests/a.py::y", "tests/b.py::z", "tests/b.py::w",
                                                 "tests/c.py::v")]
    got = item_durations(items, {"tests/a.py::y": 2.0}, {"tests/a.py": 50.0, "tests/b.py": 9.0})
    assert got == {"tests/a.py::y": 2.0, "tests/b.py::z": 9.0}


def test_settings_keep_a_durations_file_per_profile_quantisation_base_and_engine_args(tmp_path):
    """The same test ids take 10-100x longer at the full profile, on a quantised base or in a compiled
    mode: each keeps its own durations (so -n auto and the longest-first order read their own); the
    default fast run keeps the plain per engine, device and dtype name."""
    from dataclasses import replace

    from lora_conformance.settings import Settings

    base = Settings(device="cpu", device_spec="cpu", engine="builtin", engine_args={}, base_model="synthetic:llama",
                    dtype="float32", reference_device="cpu", reference_dtype="float32", cache_dir=tmp_path,
                    refresh_references=False, report_dir=None, expectations=None)
    plain = run_order.settings_durations_path(base)
    assert plain == run_order.durations_path(tmp_path, "builtin", "cpu", "float32")
    variants = [replace(base, profile="full", base_model="synthetic:qwen2.5-1.5b"), replace(base, base_quant="int8"),
                replace(base, engine_args={"exec_mode": "compile"}), replace(base, engine_args={"exec_mode": "graphs"}),
                replace(base, base_model="synthetic:moe"),
                replace(base, profile="full", base_model="synthetic:llama")]
    paths = [run_order.settings_durations_path(s) for s in variants]
    assert len({plain, *paths}) == len(paths) + 1 and all(p.parent == plain.parent for p in paths)
    assert "-full" in paths[0].name and paths[0].name == "builtin-cpu-float32-full.json"
    assert paths[1].name == "builtin-cpu-float32-int8.json"
    # the same settings, the same file: engine args in any order
    again = replace(base, engine_args={"b": "2", "a": "1"})
    assert run_order.settings_durations_path(again) == run_order.settings_durations_path(
        replace(base, engine_args={"a": "1", "b": "2"}))


# The H200's warm full-profile run, two workers: each test's seconds (its report; the three tests the
# 600 s call cut off and the one it stopped in, from the cold run): 143 tests, 755 s.
FULL_PROFILE_SECONDS = [
    284.2, 89.7, 53.6, 40.7, 23.9, 20.4, 19.2, 19.1, 16.2, 14.3, 10.7, 9.2, 8.6, 7.6, 4.7, 4.6, 4.4, 4.4,
    4.4, 4.1, 4.0, 3.8, 3.7, 3.7, 3.7, 3.6, 3.6, 3.3, 3.3, 3.0, 2.8, 2.7, 2.5, 2.5, 2.5, 2.2, 2.2, 1.8, 1.6,
    1.6, 1.3, 1.3, 1.2, 1.1, 1.1, 0.9, 0.9] + [0.8] * 7 + [0.7] * 17 + [0.6] * 19 + [0.5] * 11 + [0.4] * 20 \
    + [0.3] * 5 + [0.2] * 2 + [0.1] * 2 + [0.0] * 12


class _Node:
    """What a scheduler sees of a pytest-xdist worker; ``queue`` is the worker's own."""

    def __init__(self, i: int):
        self.gateway = SimpleNamespace(id=f"gw{i}")
        self.queue, self.shutting_down = [], False

    def send_runtest_some(self, indices):
        self.queue.extend(indices)

    def shutdown(self):
        self.shutting_down = True


def _makespan(scheduler, seconds: dict, workers: int) -> float:
    """Replays a run: the collection is ``order``'s (as every worker's); a worker runs the first test
    it holds once it holds the next one too (or was told to shut down), as xdist's worker does, and
    reports it done ``seconds`` later; the scheduler decides what each worker gets."""
    collection = [i.nodeid for i in run_order.order(items(*seconds), seconds)]
    nodes = [_Node(i) for i in range(workers)]
    for node in nodes:
        scheduler.add_node(node)
    for node in nodes:
        scheduler.add_node_collection(node, collection)
    scheduler.schedule()
    clock = {node: 0.0 for node in nodes}
    while True:
        ready = [n for n in nodes if len(n.queue) >= 2 or (n.queue and n.shutting_down)]
        if not ready:
            break
        # the next completion in time (a worker's clock: when its running test started)
        node = min(ready, key=lambda n: clock[n] + seconds[collection[n.queue[0]]])
        index = node.queue.pop(0)
        clock[node] += seconds[collection[index]]
        scheduler.mark_test_complete(node, index, seconds[collection[index]])
    assert not scheduler.pending and not any(n.queue for n in nodes), "a test was never run"
    return max(clock.values())


def _config(workers: int):
    options = {"tx": [f"{workers}*popen"], "maxschedchunk": None, "dist": "load"}
    return SimpleNamespace(getvalue=options.get, getoption=lambda name, default=None: options.get(name, default))


@pytest.mark.parametrize("workers", [2, 4, 16])
def test_longest_first_keeps_the_long_tests_apart_where_xdists_first_chunks_stack_them(workers):
    """xdist's load scheduling sends each worker a contiguous first chunk (a quarter of its share);
    with the longest tests first, the first worker's chunk held the 17 longest of the full profile's
    143 tests (2 workers): 631 s replayed here (the H200's warm run was cut at 573 s with four tests,
    about 60 s, left), where 377 s were possible. One test at a time, a short test held behind a
    long one: within a second of the bound (the longest test, or the work shared evenly)."""
    pytest.importorskip("xdist")
    from xdist.scheduler import LoadScheduling

    seconds = {f"t::{i}": s for i, s in enumerate(FULL_PROFILE_SECONDS)}
    bound = max(max(seconds.values()), sum(seconds.values()) / workers)
    ours = _makespan(run_order.longest_first_class()(_config(workers), None, seconds), seconds, workers)
    theirs = _makespan(LoadScheduling(_config(workers), None), seconds, workers)
    assert ours <= bound + 1.0, (ours, bound)
    if workers == 2:
        assert theirs > 1.4 * bound, (theirs, bound)  # why the scheduler exists



def test_longest_first_gives_every_worker_a_test_before_any_worker_a_second():
    """Two tests, two workers: one each (a worker holding both would run the short one only after
    the long one; an interrupted certification then never started it)."""
    pytest.importorskip("xdist")
    seconds = {"t::long": 5.0, "t::short": 0.1}
    assert _makespan(run_order.longest_first_class()(_config(2), None, seconds), seconds, 2) == 5.0
