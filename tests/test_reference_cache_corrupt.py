"""A cached reference entry of the wrong shape ({} , [1]) or not UTF-8 is discarded with a warning
naming the file, and recomputed; it must not crash every rerun (KeyError 'token_ids',
UnicodeDecodeError) without naming the file."""

from __future__ import annotations

import pytest

from lora_conformance.reference import ReferenceCache, ReferenceRunner
from lora_conformance.types import GenerationRequest

REQ = [GenerationRequest("the old man", max_new_tokens=3)]


@pytest.mark.parametrize("content", [b"{}", b"[1]", b"\xff\xfe{not utf8", b'{"token_ids": "x", "text": ""}',
                                     b'{"token_ids": [1], "text": "", "logprobs": [7]}', b"null"],
                         ids=["empty-object", "list", "not-utf8", "bad-ids", "bad-logprobs", "null"])
def test_malformed_entry_is_discarded_naming_the_file(llama, tmp_path, content):
    first = ReferenceRunner(llama, cache=ReferenceCache(tmp_path)).generate(REQ)
    entries = list(tmp_path.rglob("*.json"))
    assert len(entries) == 1
    entries[0].write_bytes(content)
    runner = ReferenceRunner(llama, cache=ReferenceCache(tmp_path))
    with pytest.warns(UserWarning, match=str(entries[0].name)) as rec:
        again = runner.generate(REQ)
    assert "discarded" in str(rec[0].message)
    assert again[0].to_dict() == first[0].to_dict() and runner.forward_passes > 0
    third = ReferenceRunner(llama, cache=ReferenceCache(tmp_path))
    assert third.generate(REQ)[0].to_dict() == first[0].to_dict() and third.forward_passes == 0, "recomputed entry cached"


def test_malformed_embedding_entry_is_discarded(tmp_path):
    cache = ReferenceCache(tmp_path)
    cache.put("ab" * 32, {"embedding": "nope"})
    from lora_conformance.reference.runner import _embedding_entry

    with pytest.warns(UserWarning, match="malformed"):
        assert cache.get("ab" * 32, _embedding_entry) is None
    assert not list(tmp_path.rglob("*.json")), "the malformed entry is deleted"
