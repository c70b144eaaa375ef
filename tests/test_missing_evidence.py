"""A comparison never passes without the evidence it compares: an engine that returns tokens but
no decode logprobs fails logprob closeness, same-output and nearest-reference routing checks."""

from __future__ import annotations

import pytest

from lora_conformance.judge import assert_logprobs_close
from lora_conformance.judge.errors import ConformanceAssertionError
from lora_conformance.judge.logprobs import assert_same_output, missing_decode_logprobs
from lora_conformance.judge.routing import assert_nearest_reference_routing
from lora_conformance.types import GenerationResult


def _result(tokens, logprobs):
    return GenerationResult(token_ids=list(tokens), text="x", logprobs=logprobs)


REF = _result([5, 6, 7], [{5: -0.1, 9: -3.0}, {6: -0.2, 9: -3.0}, {7: -0.1, 9: -2.0}])
OTHER = _result([8, 8, 8], [{8: -0.1, 9: -3.0}] * 3)


@pytest.mark.parametrize("logprobs", [[], [{}, {}, {}], [{5: -0.1, 9: -3.0}]], ids=["none", "empty", "one-of-3"])
def test_no_decode_logprobs_never_pass(logprobs):
    bare = _result(REF.token_ids, logprobs)
    assert missing_decode_logprobs(bare)
    with pytest.raises(ConformanceAssertionError, match="decode logprobs for"):
        assert_logprobs_close(bare, REF, "float32")
    with pytest.raises(ConformanceAssertionError, match="decode logprobs for"):
        assert_same_output(bare, bare)
    with pytest.raises(ConformanceAssertionError, match="decode logprobs for"):
        assert_nearest_reference_routing([bare], ["A"], {"A": REF, "B": OTHER})


def test_complete_evidence_still_passes():
    assert missing_decode_logprobs(REF) is None
    assert_logprobs_close(REF, REF, "float32")
    assert_same_output(REF, REF)
