"""The comparison library: used by the suites, usable in engine teams' own tests.

    from lora_conformance.judge import assert_logprobs_close, assert_nearest_reference_routing
"""

from lora_conformance.judge.embeddings import assert_embeddings_close, cosine
from lora_conformance.judge.errors import ConformanceAssertionError
from lora_conformance.judge.logprobs import (
    Agreement,
    assert_logprobs_close,
    assert_prompt_logprobs_close,
    assert_same_output,
    assert_tokens_equal,
    margin,
)
from lora_conformance.judge.rouge import assert_rouge_l, rouge_l
from lora_conformance.judge.routing import (
    BASE,
    IndistinctReferencesError,
    assert_nearest_reference_routing,
    output_distance,
)
from lora_conformance.judge.tolerances import TOLERANCES, Tolerance, tolerance_for

__all__ = [
    "Agreement", "BASE", "ConformanceAssertionError", "IndistinctReferencesError", "TOLERANCES", "Tolerance",
    "assert_embeddings_close", "assert_logprobs_close", "assert_nearest_reference_routing",
    "assert_prompt_logprobs_close", "assert_rouge_l",
    "assert_same_output", "assert_tokens_equal", "cosine", "margin", "output_distance", "rouge_l",
    "tolerance_for",
]
