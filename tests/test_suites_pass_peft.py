"""The suites are right: PEFT passes what it declares against the reference (the built-in
engine's run and the shared runner are in tests/test_suites_pass.py; a file of its own so that the
two runs, the longest tests of the project's own run, can go to two pytest-xdist workers)."""

from test_suites_pass import _run


def test_peft_engine_passes_what_it_declares(suite_runner, lora_settings):
    passed, skipped = _run(suite_runner, lora_settings, "peft")
    assert len(passed) >= 30, f"only {len(passed)} suite tests passed on PEFT"
