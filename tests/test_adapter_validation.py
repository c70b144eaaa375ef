"""adapters/validate.py: every malformed kind is refused with AdapterFormatError naming the file
and the field; every well-formed kind the suites use (DoRA, modules_to_save and bias included:
support is the engine's call) passes."""

from __future__ import annotations

import json

import pytest

from lora_conformance.adapters import AdapterSpec, synthesize_adapter
from lora_conformance.adapters.malformed import BAD_NAMES, MALFORMED, make_malformed
from lora_conformance.adapters.validate import validate_adapter, validate_name
from lora_conformance.engines.base import AdapterFormatError, AdapterIncompatibleError

MAX_RANK = 64


@pytest.fixture(scope="module")
def good(llama, tmp_path_factory):
    return synthesize_adapter(llama, AdapterSpec(seed=3), tmp_path_factory.mktemp("good") / "a")


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_each_malformed_kind_is_refused_naming_file_and_field(llama, good, tmp_path, kind):
    bad = make_malformed(kind, good, tmp_path / kind, MAX_RANK)
    with pytest.raises(AdapterFormatError) as exc:
        validate_adapter(bad, llama, MAX_RANK)
    err = exc.value
    assert isinstance(err, AdapterIncompatibleError)
    assert err.file.startswith(str(bad)), f"error names {err.file!r}, expected a file under {bad}"
    expected = MALFORMED[kind][1]
    assert expected in str(err), f"{kind}: expected the error to mention {expected!r}, got: {err}"


@pytest.mark.parametrize("spec", [
    AdapterSpec(targets="all-linear", rank=4, rank_pattern={"q_proj": 8}, alpha_pattern={"v_proj": 3}),
    AdapterSpec(targets="embed_tokens"), AdapterSpec(targets="lm_head"), AdapterSpec(use_dora=True),
    AdapterSpec(modules_to_save=("lm_head",)), AdapterSpec(bias="all"), AdapterSpec(layers_to_transform=(0, 2)),
], ids=["patterns", "embed_tokens", "lm_head", "dora", "modules_to_save", "bias", "layers"])
def test_well_formed_adapters_pass(llama, tmp_path, spec):
    d = synthesize_adapter(llama, spec, tmp_path / "a")
    checked = validate_adapter(d, llama, MAX_RANK)
    assert checked.tensors and checked.config["r"] == spec.rank


def test_moe_expert_adapter_passes(cache, tmp_path):
    from lora_conformance.models import resolve_base_model

    moe = resolve_base_model("synthetic:moe", cache)
    d = synthesize_adapter(moe, AdapterSpec(targets="moe_experts"), tmp_path / "m")
    assert validate_adapter(d, moe, MAX_RANK).tensors


@pytest.mark.parametrize("field,value,needle", [
    ("lora_alpha", float("nan"), "lora_alpha"), ("lora_alpha", "16", "lora_alpha"), ("r", 2.5, "r"),
    ("use_rslora", "yes", "use_rslora"), ("rank_pattern", {"q_proj": 0}, "rank_pattern.q_proj"),
    ("layers_to_transform", [0, 99], "layers_to_transform"), ("target_parameters", ["nope.param"], "target_parameters"),
    ("bias", "some", "bias"), ("peft_type", "IA3", "peft_type"),
])
def test_config_fields(llama, good, tmp_path, field, value, needle):
    d = make_malformed("config_rank_mismatch", good, tmp_path / "d", MAX_RANK)  # a copy; config rewritten below
    cfg = json.loads((good / "adapter_config.json").read_text())
    cfg[field] = value
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterFormatError) as exc:
        validate_adapter(d, llama, MAX_RANK)
    assert exc.value.field.startswith(needle) and exc.value.file.endswith("adapter_config.json"), str(exc.value)


def test_tensor_rank_disagreeing_with_config_names_the_field(llama, good, tmp_path):
    d = make_malformed("config_rank_mismatch", good, tmp_path / "d", MAX_RANK)
    with pytest.raises(AdapterFormatError) as exc:
        validate_adapter(d, llama, MAX_RANK)
    assert exc.value.field == "r" and "has rank 8" in exc.value.problem, str(exc.value)


@pytest.mark.parametrize("max_rank,wrong", [(MAX_RANK, 16), (16, 16), (8, 4)])
def test_config_rank_mismatch_stays_within_the_engines_limit(llama, good, tmp_path, max_rank, wrong):
    """Wrong in one way only: a config r over the engine's max_rank would be refused for that, and
    an engine that never compares r with its tensors would pass (vLLM at its default 16)."""
    d = make_malformed("config_rank_mismatch", good, tmp_path / "d", max_rank)
    assert json.loads((d / "adapter_config.json").read_text())["r"] == wrong
    with pytest.raises(AdapterFormatError) as exc:
        validate_adapter(d, llama, max_rank)
    assert exc.value.field == "r", str(exc.value)


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_adapter_names_are_refused(name):
    with pytest.raises(AdapterFormatError) as exc:
        validate_name(name)
    assert exc.value.field == "name"


def test_good_adapter_names_pass():
    for n in ("A", "adapter-1", "my_adapter.v2"):
        assert validate_name(n) == n
