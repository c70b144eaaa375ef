"""The stream race detector: happens-before bookkeeping, and its torch dispatch side on cpu tensors.

On cpu there are no streams, so the dispatch side is driven with a stand-in trace whose
"current stream" the test switches; the ordering events are fed as the device hooks would.
"""

import pytest
import torch

from lora_conformance import devices
from lora_conformance.races import HappensBefore, RaceDetector

COMPUTE, SIDE = 7, 9
POOL = 1000  # a storage address


def _slot(i, width=100):
    return (POOL, i * width, (i + 1) * width)


def test_unordered_write_then_read_is_a_race():
    hb = HappensBefore()
    hb.launch(SIDE, [], [_slot(1)], "copy_", "load")
    hb.launch(COMPUTE, [(POOL, 0, 400)], [], "index_select", "forward")
    assert hb.race_count == 1
    race = hb.races[0]
    assert (race.earlier.kind, race.later.kind) == ("write", "read")
    assert "bytes [100, 200)" in race.describe() and "copy_" in race.describe()


def test_event_wait_orders_the_read_after_the_copy():
    hb = HappensBefore()
    hb.launch(COMPUTE, [(POOL, 0, 400)], [], "index_select", "previous step")
    hb.event_record(1, COMPUTE)
    hb.event_wait(1, SIDE)  # side.wait_stream(compute): the copy may not overtake queued reads
    hb.launch(SIDE, [], [_slot(1)], "copy_", "load")
    hb.event_record(2, SIDE)
    hb.event_wait(2, COMPUTE)
    hb.launch(COMPUTE, [(POOL, 0, 400)], [], "index_select", "forward")
    assert hb.race_count == 0


def test_a_copy_that_does_not_wait_for_queued_reads_is_a_race():
    hb = HappensBefore()
    hb.launch(COMPUTE, [(POOL, 0, 400)], [], "index_select", "previous step")
    hb.launch(SIDE, [], [_slot(2)], "copy_", "load")  # write-after-read across streams
    assert hb.race_count == 1 and hb.races[0].earlier.kind == "read"


def test_host_synchronisation_orders_everything_before_it():
    for sync in ("stream", "device", "event"):
        hb = HappensBefore()
        hb.launch(SIDE, [], [_slot(1)], "copy_", "load")
        if sync == "stream":
            hb.stream_synchronize(SIDE)
        elif sync == "device":
            hb.device_synchronize()
        else:
            hb.event_record(3, SIDE)
            hb.event_synchronize(3)
        hb.launch(COMPUTE, [(POOL, 0, 400)], [], "index_select", "forward")
        assert hb.race_count == 0, sync


def test_synchronising_another_stream_orders_nothing():
    hb = HappensBefore()
    hb.launch(SIDE, [], [_slot(1)], "copy_", "load")
    hb.stream_synchronize(COMPUTE)
    hb.launch(COMPUTE, [(POOL, 0, 400)], [], "index_select", "forward")
    assert hb.race_count == 1


def test_disjoint_ranges_reads_and_same_stream_never_race():
    hb = HappensBefore()
    hb.launch(SIDE, [], [_slot(1)], "copy_", "load")
    hb.launch(COMPUTE, [_slot(0), _slot(2)], [_slot(3)], "mm", "other slots")  # disjoint bytes
    hb.launch(SIDE, [_slot(1)], [], "sum", "same stream")
    hb.launch(COMPUTE, [(POOL + 1, 0, 10)], [], "mm", "another allocation")
    hb.launch(SIDE, [(POOL + 1, 0, 10)], [], "mm", "read-read")
    assert hb.race_count == 0


def test_freed_memory_forgets_its_accesses():
    hb = HappensBefore()
    hb.launch(SIDE, [], [_slot(1)], "copy_", "load")
    hb.freed(POOL)
    hb.launch(COMPUTE, [(POOL, 0, 400)], [], "index_select", "new tensor at the same address")
    assert hb.race_count == 0


def test_pruning_keeps_conflicts_visible():
    hb = HappensBefore()
    for _ in range(50):  # a long same-stream history collapses to the latest access
        hb.launch(COMPUTE, [(POOL, 0, 400)], [(POOL, 0, 400)], "add_", "step")
    assert len(hb.accesses[POOL]) <= 2
    hb.launch(SIDE, [], [_slot(1)], "copy_", "load")
    assert hb.race_count == 1


class _Trace:
    """A stand-in for devices.StreamTrace that treats cpu tensors as device memory."""

    device_type = "cpu"

    def __init__(self):
        self.stream = COMPUTE
        self.module = None

    def activate(self):
        pass

    def stream_id(self):
        return self.stream

    def capturing(self):
        return False


@pytest.fixture
def watched(monkeypatch):
    trace = _Trace()
    monkeypatch.setattr(RaceDetector, "_hooked", {"cpu"})  # no real hooks to register
    detector = RaceDetector(trace)
    return detector, trace


def test_dispatch_side_sees_slot_copies_and_pool_reads(watched):
    detector, trace = watched
    pool = torch.zeros(4, 8, 16)
    new = torch.randn(8, 16)
    rows = torch.tensor([0, 2])
    with detector.watching():
        trace.stream = SIDE
        pool[2].copy_(new)  # writes slot 2 only
        trace.stream = COMPUTE
        pool[0].sum()  # slot 0: untouched by the copy
        assert detector.race_count == 0
        pool.index_select(0, rows).sum()  # a gather over the whole pool
    assert detector.launches >= 4
    assert detector.race_count == 1, detector.describe()
    race = detector.races[0]
    assert race.earlier.op == "aten::copy_" and race.later.op == "aten::index_select"
    assert "test_races.py" in race.earlier.where and "test_races.py" in race.later.where
    start = 2 * 8 * 16 * 4
    assert f"bytes [{start}, {start + 8 * 16 * 4})" in race.describe()


def test_dispatch_side_with_the_wait_reports_nothing(watched):
    detector, trace = watched
    pool = torch.zeros(4, 8, 16)
    with detector.watching():
        trace.stream = SIDE
        pool[1].copy_(torch.ones(8, 16))
        detector.event_record(5, SIDE)
        detector.event_wait(5, COMPUTE)
        trace.stream = COMPUTE
        out = pool.index_select(0, torch.tensor([1])).sum()
    assert float(out) == 8 * 16
    assert detector.launches >= 2 and detector.race_count == 0, detector.describe()


def test_views_are_not_accesses_and_nesting_is_refused(watched):
    detector, trace = watched
    pool = torch.zeros(4, 8)
    with detector.watching():
        trace.stream = SIDE
        pool.view(2, 16).t()  # views only: nothing read or written
        assert detector.launches == 0
        with pytest.raises(RuntimeError, match="already watching"):
            with detector.watching():
                pass


def test_no_detector_where_the_device_has_no_streams():
    assert RaceDetector.for_device("cpu") is None
    assert devices.stream_trace("cpu") is None
