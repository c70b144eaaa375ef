"""MoE expert LoRA (PEFT ``target_parameters`` on fused 3-D expert weights) against the PEFT reference."""

import pytest

from lora_conformance.adapters import AdapterSpec
from lora_conformance.engines import UnsupportedFeatureError
from lora_conformance.outcomes import REFUSED, not_certified
from lora_conformance.ci import register_cpu_ci, register_cuda_ci, register_npu_ci, register_xpu_ci

register_cpu_ci(est_time=15, suite="per-commit")
register_cuda_ci(est_time=10, suite="per-commit")
register_xpu_ci(est_time=20, suite="per-commit")
register_npu_ci(est_time=20, suite="per-commit")

pytestmark = [pytest.mark.base_model("moe"), pytest.mark.requires("moe")]

# down_proj's LoRA (PEFT's un-nested ``experts.lora_B``) 4x the default B std: an expert LoRA output
# weighted otherwise than the expert's base output (the routing weight) must show in bfloat16.
DOWN_B_STD = {"experts.lora_B": 0.12}
EXPERTS = {"M1": AdapterSpec(seed=501, targets="moe_experts", b_std_pattern=DOWN_B_STD),
           "M2": AdapterSpec(seed=502, targets="moe_experts", b_std_pattern=DOWN_B_STD)}
ATTENTION = AdapterSpec(seed=503, targets="attention")


@pytest.mark.feature("moe/expert_lora_matches_reference",
                      "MoE expert LoRA (target_parameters on fused experts) matches the reference")
@pytest.mark.parametrize("name", list(EXPERTS))
def test_expert_lora_matches_reference(lora, device, dtype, name):
    engine = lora.engine
    lora.load(engine, name, EXPERTS[name])
    lora.assert_conforms(engine, [name] * 6, EXPERTS, prompts=lora.prompts[:6], label=name)


@pytest.mark.feature("moe/attention_lora_on_moe_model", "attention LoRA on an MoE model matches the reference")
def test_attention_lora_on_moe_model(lora, device, dtype):
    engine = lora.engine
    lora.load(engine, "MA", ATTENTION)
    lora.assert_conforms(engine, ["MA"] * 6, {"MA": ATTENTION}, prompts=lora.prompts[:6], label="MA")


@pytest.mark.feature("moe/expert_lora_mixed_batch",
                      "MoE expert adapters and base rows in one batch", requires=("mixed_batch",))
def test_expert_lora_mixed_batch(lora, device, dtype):
    """PEFT cannot batch these; the reference is each request alone, which is what must come out."""
    engine = lora.engine
    for name, spec in EXPERTS.items():
        lora.load(engine, name, spec)
    labels = ["M1", None, "M2", "M1", None, "M2", "M1", "M2"]
    try:
        engine.generate(lora.requests(labels, max_new_tokens=1))
    except UnsupportedFeatureError as exc:  # e.g. PEFT: no adapter_names with target_parameters
        not_certified(REFUSED, f"engine refused a mixed batch of MoE expert adapters ({exc})")
    lora.assert_conforms(engine, labels, EXPERTS, label="experts mixed")
