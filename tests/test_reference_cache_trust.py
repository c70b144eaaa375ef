"""The reference cache is trusted only as far as it checks out: each entry's value carries its
sha256 (a flipped digit is detected, warned about and recomputed), a cache that cannot be written
is an error of the run (never a failed engine), and a killed writer's temp files are cleaned."""

from __future__ import annotations

import errno
import json
import os
import re
import time

import pytest

from lora_conformance.reference import ReferenceCache, ReferenceRunner
from lora_conformance.reference.cache import (CacheEnvironmentError, check_writable_dir, remove_stale_temps,
                                              write_json_atomic)
from lora_conformance.types import GenerationRequest

REQ = [GenerationRequest("the old man", max_new_tokens=3)]


def test_a_flipped_digit_in_a_token_id_is_detected_and_recomputed(llama, tmp_path):
    first = ReferenceRunner(llama, cache=ReferenceCache(tmp_path)).generate(REQ)
    (entry,) = tmp_path.rglob("*.json")
    text = entry.read_text()
    tok = first[0].token_ids[1]
    flipped = int(str(tok)[:-1] + str((int(str(tok)[-1]) + 1) % 10))
    bad = re.sub(rf'("token_ids": \[\d+, ){tok}\b', rf"\g<1>{flipped}", text, count=1)
    assert bad != text
    entry.write_text(bad)
    runner = ReferenceRunner(llama, cache=ReferenceCache(tmp_path))
    with pytest.warns(UserWarning, match="corrupt.*does not match its sha256"):
        again = runner.generate(REQ)
    assert again[0].token_ids == first[0].token_ids and runner.forward_passes > 0
    assert runner.cache.discarded == 1


def test_entries_without_a_digest_are_recomputed_silently(tmp_path):
    cache = ReferenceCache(tmp_path)
    cache.put("cd" * 32, {"rows": []})
    (entry,) = tmp_path.rglob("*.json")
    entry.write_text(json.dumps({"rows": []}))  # the layout before entries carried a digest
    assert cache.get("cd" * 32) is None and cache.discarded == 0


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC, errno.EACCES])
def test_an_unwritable_cache_is_an_environment_error(tmp_path, monkeypatch, code):
    import lora_conformance.reference.cache as cache_mod

    def fail(*a, **k):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(cache_mod, "write_json_atomic", fail)
    with pytest.raises(CacheEnvironmentError, match=os.strerror(code)) as exc:
        ReferenceCache(tmp_path).put("ab" * 32, {"rows": []})
    assert "--lora-cache" in str(exc.value) and str(tmp_path) in str(exc.value)


def test_check_writable_dir_refuses_a_path_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CacheEnvironmentError, match="the cache"):
        check_writable_dir(blocker / "cache", "the cache")
    check_writable_dir(tmp_path / "new" / "cache", "the cache")
    assert (tmp_path / "new" / "cache").is_dir() and not list((tmp_path / "new" / "cache").iterdir())


def test_the_plugin_stops_at_once_on_an_unwritable_cache_or_report(pytester, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    pytester.makepyfile("def test_x():\n    pass\n")
    for opt, needle in ((f"--lora-cache={blocker / 'c'}", "--lora-cache"), (f"--lora-report={blocker / 'r'}",
                                                                              "--lora-report")):
        result = pytester.runpytest_subprocess("--device=cpu", opt)
        assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
        assert needle in result.stderr.str() and "Not a directory" in result.stderr.str()


def test_a_killed_writers_temp_files_are_cleaned(tmp_path):
    stale = tmp_path / ".tmp-dead.json"
    stale.write_text("{")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    fresh = tmp_path / ".tmp-live.json"  # a writer that is still at work
    fresh.write_text("{")
    write_json_atomic(tmp_path / "x.json", {"a": 1})
    assert not stale.exists() and fresh.exists() and json.loads((tmp_path / "x.json").read_text()) == {"a": 1}
    dead_dir = tmp_path / ".tmp-dir"
    dead_dir.mkdir()
    os.utime(dead_dir, (old, old))
    assert remove_stale_temps(tmp_path) == 1 and not dead_dir.exists()
