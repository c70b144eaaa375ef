"""The conformance suites (shipped in the package as ``lora_conformance.suites``).

Run them with ``lora-conformance certify --device ...``, ``pytest suites --device=...`` from a
checkout, or ``pytest --pyargs lora_conformance.suites --device=...`` from an installed package.
"""
