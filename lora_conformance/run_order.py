"""The order tests run in under pytest-xdist: longest first, by the last same-settings run's durations.

xdist's ``load`` scheduler hands tests out in collection order; a long test collected late runs
alone at the end while the other workers idle (2.4 s of a 23 s ``-n 2`` certification on a
2-core machine). Sending the long tests first and the short ones after (the classic
longest-processing-time rule) lets the short ones fill the gaps.

* The controller (or a serial run) records each test's setup + call + teardown time, per engine,
  device and dtype (and profile, base quantisation, base model and engine args where a run sets
  them: ``settings_durations_path``), in ``<cache>/durations/``, after the run (atomic replace; a
  missing or unreadable file only means collection order).
* The controller reads that file once and hands it to every worker through ``workerinput``, so all
  workers reorder identically (xdist refuses workers whose collections differ), even while
  another run rewrites the file.
* Only tests of at least ``LONG_SECONDS`` move; the rest keep collection order, so tests of one
  module still run together and share their engines.

* Under ``--dist loadfile`` (certify's choice for engines that start slowly, so that a file's tests
  share their engines) a file is the unit handed out: files go longest first by their tests'
  summed durations, and inside a file the tests that use one base model and dtype run together
  (``by_file``), so an engine closed for a newer one is not needed again a test later.
* Files whose tests asked for the same shared engine other than the run's own in the last run (each
  test's engine uses, kept beside the durations) are one unit (``file_groups``): ordered by their
  summed durations, handed to one worker by a file scheduler of ours (``make_scheduler``), so such
  an engine starts once per run.
* A test that killed its engine in the last run (an EngineFailure: every shared engine of its worker
  is then closed, ``Harness.discard_engines``) runs after every other test under ``--dist
  loadfile``, a unit of its own, so no test after it on its worker needs those engines started
  again (vLLM on cpu: its prompt-logprobs feature test kills the engine core; the next test paid
  a ~30 s restart). Its verdict does not depend on this: it runs on the same shared engine, only later.

* Under ``--dist load`` (the default) with durations from the last run, tests are handed out one at
  a time (``LongestFirst``): xdist's own load scheduling sends each worker a contiguous first chunk
  of a quarter of its share, so with the longest tests first one worker got all of them and the
  others idled at the end (the full profile on the H200, two workers: the first chunk held its 17
  longest tests, and a warm run would have taken about 630 s where 377 s were possible: replayed in
  tests/test_run_order.py). A worker runs a test only once it holds the next one, so each holds two: where both
  would be long (``FILLER_SHARE`` of a worker's share of the run or more) while a long test still
  waits, the second is a short one (the last waiting) instead, so the next long test goes to
  whichever worker frees first.

A serial run keeps collection order: there is nothing to balance.
"""

from __future__ import annotations

import functools
import json
import re
import time
from pathlib import Path
from typing import Iterable, Mapping, Optional

import pytest

WORKERINPUT_KEY = "lora_durations"
DIST_KEY = "lora_dist"  # the controller's --dist: a worker's own option reads "no" (xdist resets it)
GROUPS_KEY = "lora_file_groups"
USES_PROPERTY = "lora_engine_uses"  # a test's user property: the shared engines it asked for (JSON list)
DIED_PROPERTY = "lora_engine_died"  # a test's user property: its engine failed (its worker's engines closed)
LAST_KEY = "lora_last_tests"
LONG_SECONDS = 0.5
_DURATIONS = pytest.StashKey[dict]()  # the controller's copy of the last run's durations
_GROUPS = pytest.StashKey[dict]()  # the controller's file -> group, from the last run's engine uses
_LAST = pytest.StashKey[list]()  # the controller's tests that killed their engine in the last run


def durations_path(cache_dir: Path, engine: str, device_type: str, dtype: str, variant: str = "") -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{engine}-{device_type}-{dtype}" + (f"-{variant}" if variant else ""))
    return Path(cache_dir) / "durations" / f"{name}.json"


def settings_durations_path(settings) -> Path:
    """``durations_path`` for a run's settings. Besides engine, device type and dtype, what changes
    its tests' durations by large factors under the same test ids keeps a file of its own: the
    profile (the full profile's cases take 10-100x the fast one's), the base quantisation, and the base
    model (other than the profile's own) and engine args (a compiled mode's cases compile; a real
    checkpoint is bigger), the last two as a short hash. A fast run on its own base with no engine
    args keeps the plain name."""
    import hashlib

    from lora_conformance.models import profiles

    parts = [p for p in (settings.profile if settings.profile != "fast" else "",
                         settings.base_quant if settings.base_quant != "none" else "") if p]
    own_base = profiles.get(settings.profile).models.get("decoder")
    rest = {k: v for k, v in (("base_model", settings.base_model if settings.base_model != own_base else ""),
                              ("engine_args", dict(sorted(settings.engine_args.items())))) if v}
    if rest:
        parts.append(hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()[:10])
    return durations_path(settings.cache_dir, settings.engine, settings.device_type, settings.dtype, "-".join(parts))


def uses_path(durations: Path) -> Path:
    """Where the engine uses of a durations file's runs are kept (beside it)."""
    return Path(durations).with_suffix(".engines.json")


def deaths_path(durations: Path) -> Path:
    """Where the tests whose engine failed in the last run are kept (beside the durations)."""
    return Path(durations).with_suffix(".deaths.json")


def load_deaths(path: Path) -> list[str]:
    return sorted(str(k) for k, v in _json_object(path).items() if v is True)


def _json_object(path: Path) -> dict:
    """The JSON object in ``path``; {} when it is missing, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_uses(path: Path) -> dict[str, list[str]]:
    return {str(k): [str(x) for x in v] for k, v in _json_object(path).items() if isinstance(v, list)}


def file_groups(uses: Mapping[str, list[str]]) -> dict[str, str]:
    """file -> its group, for the files that share a shared engine (other than the run's own) with
    another file in the last run: such files go to one pytest-xdist worker under ``--dist
    loadfile``, so the engine starts once per run, not once per worker that got one of them (the
    slot-limit tests of three files share the capacity engine). A group is named by its first file
    (sorted); files in no group are absent."""
    parent: dict[str, str] = {}

    def find(f: str) -> str:
        while parent.setdefault(f, f) != f:
            f = parent[f]
        return f

    first_file: dict[str, str] = {}
    for nodeid, labels in sorted(uses.items()):
        f = nodeid.split("::", 1)[0]
        find(f)
        for label in labels:
            other = first_file.setdefault(label, f)
            a, b = find(f), find(other)
            if a != b:
                parent[max(a, b)] = min(a, b)
    members: dict[str, list[str]] = {}
    for f in parent:
        members.setdefault(find(f), []).append(f)
    return {f: min(fs) for fs in members.values() if len(fs) > 1 for f in fs}


def load(path: Path) -> dict[str, float]:
    return {str(k): float(v) for k, v in _json_object(path).items() if isinstance(v, (int, float))}


def recorded_work(durations: Path, rootdir: Path, paths: Iterable[Path]) -> Optional[float]:
    """Seconds of tests under ``paths`` (all, where none is given) that the runs with these settings
    recorded (None: none, or a record that leaves out a test file under ``paths``: after a narrow run,
    ``-k`` or one file, the rest of a whole certification is unknown, not free). The durations file
    also holds other runs' tests."""
    roots = [Path(p).resolve() for p in paths]
    total, seen = 0.0, set()
    for nodeid, seconds in load(durations).items():
        test_file = (Path(rootdir) / nodeid.split("::", 1)[0]).resolve()
        if not roots or any(test_file == r or r in test_file.parents for r in roots):
            total += seconds
            seen.add(test_file)
    files = {f.resolve() for r in roots for f in ([r] if r.is_file() else r.rglob("test_*.py"))}
    return None if files - seen else total or None


def order(items: list, durations: Mapping[str, float], long_seconds: float = LONG_SECONDS,
          by_file: bool = False, groups: Mapping[str, str] = {}, last: Iterable[str] = ()) -> list:
    """Tests that took at least ``long_seconds`` first, longest first; the others in their order.
    ``by_file``: files longest first (summed durations), each file's tests grouped by base model
    and dtype (groups in order of first appearance, collection order inside a group); files of one
    ``groups`` group (``file_groups``) are one unit, placed by their summed durations; the tests in
    ``last`` (their engine failed in the last run) after all the others."""
    if by_file:
        files: dict[str, list] = {}
        for item in items:
            files.setdefault(_file(item), []).append(item)
        total = {f: sum(durations.get(i.nodeid, 0.0) for i in its) for f, its in files.items()}
        unit_total: dict[str, float] = {}
        for f in files:
            unit_total[groups.get(f, f)] = unit_total.get(groups.get(f, f), 0.0) + total[f]
        first = {u: i for i, u in reversed(list(enumerate(groups.get(f, f) for f in files)))}
        out: list = []
        # stable: unknown files keep their order; a group's files together, its longest first
        for f in sorted(files, key=lambda f: (-unit_total[groups.get(f, f)], first[groups.get(f, f)], -total[f])):
            by_engine: dict[tuple, list] = {}
            for item in files[f]:
                by_engine.setdefault(_engine_group(item), []).append(item)
            out += [i for group in by_engine.values() for i in group]
        last = set(last)
        return [i for i in out if i.nodeid not in last] + [i for i in out if i.nodeid in last]

    def key(item) -> float:
        d = durations.get(item.nodeid, 0.0)
        return -d if d >= long_seconds else 0.0
    return sorted(items, key=key)  # stable: equal keys keep collection order


def _file(item) -> str:
    return item.nodeid.split("::", 1)[0]


def _engine_group(item) -> tuple:
    """What decides a test's engine before it runs: its base model kind and its dtype."""
    from lora_conformance.markers import base_model_kind

    callspec = getattr(item, "callspec", None)
    dtype = callspec.params.get("dtype") if callspec is not None else None
    try:
        kind = base_model_kind(item)
    except AttributeError:
        kind = None
    return (kind, str(dtype))


class DurationRecorder:
    """Registered in the controller or a serial run: records durations and the shared engines each
    test asked for (``USES_PROPERTY``), writes them at the end."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.measured: dict[str, float] = {}
        self.uses: dict[str, set[str]] = {}
        self.died: set[str] = set()
        self.began: dict[str, float] = {}  # nodeid -> its setup's start (epoch seconds)
        self.finished: set[str] = set()  # tests whose teardown reported

    def pytest_runtest_logreport(self, report) -> None:
        if report.when in ("setup", "call", "teardown"):
            self.measured[report.nodeid] = self.measured.get(report.nodeid, 0.0) + float(report.duration)
            start = getattr(report, "start", None)
            if report.when == "setup" and isinstance(start, (int, float)):
                self.began.setdefault(report.nodeid, float(start))
            if report.when == "teardown":
                self.finished.add(report.nodeid)
            used = self.uses.setdefault(report.nodeid, set())
            for name, value in getattr(report, "user_properties", None) or ():
                if name == DIED_PROPERTY:
                    self.died.add(report.nodeid)
                if name == USES_PROPERTY:
                    try:
                        used.update(str(x) for x in json.loads(value))
                    except (TypeError, ValueError):
                        pass

    def pytest_sessionfinish(self, session) -> None:
        if not self.measured:
            return
        from lora_conformance.fileio import write_json_atomic

        stored, now = load(self.path), time.time()
        measured = {}
        for nodeid, seconds in self.measured.items():
            if nodeid in self.began and nodeid not in self.finished:
                # It did not finish (the run was stopped, or its worker died): it took at least as long
                # as it ran. Its phases so far (a setup's fraction of a second) would put the longest
                # tests, the ones a stop cuts, last in the next run's order.
                seconds = max(seconds, now - self.began[nodeid], stored.get(nodeid, 0.0))
            measured[nodeid] = round(seconds, 3)
        merged = {**stored, **measured}
        uses = {**load_uses(uses_path(self.path)), **{k: sorted(v) for k, v in self.uses.items()}}
        # a test that ran again keeps its mark only if its engine failed again
        died = {k: True for k in load_deaths(deaths_path(self.path)) if k not in self.measured}
        died.update({k: True for k in self.died})
        try:
            write_json_atomic(self.path, merged, indent=0, sort_keys=True)
            write_json_atomic(uses_path(self.path), uses, indent=0, sort_keys=True)
            write_json_atomic(deaths_path(self.path), died, indent=0, sort_keys=True)
        except OSError:
            pass  # a read-only cache only costs the ordering next time


def configure(config: pytest.Config, path: Path) -> None:
    """Controller / serial side: record this run; keep the last run's durations for the workers.
    Under ``--dist loadfile`` xdist hands files out in the workers' collection order only when its
    own reordering (files with the most tests first, ``--loadscope-reorder``, on by default since
    xdist 3.6) is off: with it on, a file of one long test (tensor parallel: two engine starts)
    went last and ran alone while the other worker idled. Turned off here, so files go longest
    first as ``order`` puts them."""
    if hasattr(config, "workerinput"):
        return
    config.pluginmanager.register(DurationRecorder(path), "lora-conformance-durations")
    config.stash[_DURATIONS] = load(path)
    config.stash[_GROUPS] = file_groups(load_uses(uses_path(path)))
    config.stash[_LAST] = load_deaths(deaths_path(path))
    if config.getoption("dist", None) == "loadfile" and getattr(config.option, "loadscopereorder", False):
        config.option.loadscopereorder = False


def worker_durations(config: pytest.Config) -> Optional[dict[str, float]]:
    """The durations a worker orders by (None outside pytest-xdist workers)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return None
    try:
        return json.loads(workerinput.get(WORKERINPUT_KEY) or "{}")
    except ValueError:
        return {}


def node_input(config: pytest.Config) -> str:
    return json.dumps(config.stash.get(_DURATIONS, {}))


def groups_input(config: pytest.Config) -> str:
    return json.dumps(config.stash.get(_GROUPS, {}))


def last_input(config: pytest.Config) -> str:
    return json.dumps(config.stash.get(_LAST, []))


def _worker_json(config: pytest.Config, key: str, kind: type):
    """The controller's JSON value ``key`` in a worker's ``workerinput``: an empty ``kind()``
    outside workers, or when it is missing, unreadable or not a ``kind``."""
    try:
        value = json.loads((getattr(config, "workerinput", None) or {}).get(key) or "null")
    except ValueError:
        return kind()
    return value if isinstance(value, kind) else kind()


def worker_last(config: pytest.Config) -> list[str]:
    """The controller's tests to run last (their engine failed in the last run), on a worker."""
    return [str(x) for x in _worker_json(config, LAST_KEY, list)]


def worker_groups(config: pytest.Config) -> dict[str, str]:
    """The controller's file groups, on a worker ({} elsewhere)."""
    return _worker_json(config, GROUPS_KEY, dict)


def make_scheduler(config: pytest.Config, log):
    """Under ``--dist load`` with the last run's durations (and no ``--maxschedchunk``):
    ``LongestFirst``. Under ``--dist loadfile`` with file groups or tests to run last from the last
    run: xdist's file scheduling with a group of files as one unit (a worker gets all of its files)
    and each test to run last a unit of its own (``order`` put them at the end of the collection,
    so their units are handed out last). Else None (xdist's own)."""
    groups = config.stash.get(_GROUPS, {})
    last = set(config.stash.get(_LAST, []))
    dist = config.getoption("dist", None)
    durations = config.stash.get(_DURATIONS, {})
    if dist == "load" and durations and config.getoption("maxschedchunk", None) is None:
        return longest_first_class()(config, log, durations)
    if dist != "loadfile" or not (groups or last):
        return None
    from xdist.scheduler import LoadFileScheduling

    class GroupedFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid in last:
                return nodeid
            f = nodeid.split("::", 1)[0]
            return groups.get(f, f)

    return GroupedFiles(config, log)


@functools.cache
def longest_first_class():
    """``LongestFirst``, defined on first use (pytest-xdist is optional)."""
    from xdist.scheduler import LoadScheduling

    class LongestFirst(LoadScheduling):
        """xdist's load scheduling, one test at a time in collection order (``order``: longest
        first), each worker holding two (the one it runs and the next: a worker starts a test
        only once it holds the next one); where the next would be a second long test while a
        long test still waits, a short one (the last waiting) goes instead (see the module's
        doc). Long here: ``FILLER_SHARE`` of a worker's share of the run, at least ``LONG_SECONDS``."""

        def __init__(self, config: pytest.Config, log, durations: Mapping[str, float]):
            super().__init__(config, log)
            self.durations = dict(durations)
            self.long_seconds = LONG_SECONDS  # set from the collection's share per worker (schedule)

        def _long(self, index: int) -> bool:
            return self.durations.get(self.collection[index], 0.0) >= self.long_seconds

        def schedule(self) -> None:
            assert self.collection_is_completed
            if self.collection is None:
                if not self._check_nodes_have_same_collection():
                    self.log("**Different tests collected, aborting run**")
                    return
                self.collection = next(iter(self.node2collection.values()))
                self.pending[:] = range(len(self.collection))
                if not self.collection:
                    return
                share = sum(self.durations.get(t, 0.0) for t in self.collection) / max(1, len(self.nodes))
                self.long_seconds = max(LONG_SECONDS, FILLER_SHARE * share)
            # one test each first (longest first), so that no worker is left without one while
            # another holds two: with fewer tests than two a worker, xdist hands them round robin too
            for node in self.nodes:
                if self.pending and not self.node2pending[node] and not node.shutting_down:
                    self._hand(node, self.pending.pop(0))
            for node in self.nodes:
                self.check_schedule(node)

        def _hand(self, node, index: int) -> None:
            self.node2pending[node].append(index)
            node.send_runtest_some([index])

        def check_schedule(self, node, duration: float = 0) -> None:
            if node.shutting_down:
                return
            held = self.node2pending[node]
            while self.pending and len(held) < 2:
                filler = (bool(held) and self._long(held[-1]) and self._long(self.pending[0])
                          and not self._long(self.pending[-1]))
                self._hand(node, self.pending.pop(-1 if filler else 0))
            if not self.pending:
                node.shutdown()

    return LongestFirst


# LongestFirst holds a short test behind a long one only where both it and the next waiting test take
# at least this fraction of a worker's share of the run: a filler comes from the end of the collection,
# so a test that shares fixtures with its neighbours may set them up alone, and below this the wait it
# saves is small.
FILLER_SHARE = 0.02


def worker_dist(config: pytest.Config) -> Optional[str]:
    """The controller's ``--dist`` mode, on a worker (xdist sets a worker's own ``dist`` option to
    "no", so ``config.getoption("dist")`` cannot tell a worker that files are the unit)."""
    workerinput = getattr(config, "workerinput", None) or {}
    return workerinput.get(DIST_KEY)

