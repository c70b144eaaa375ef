"""Conformance suites: run with `pytest suites --device=... --engine=...`.

This conftest activates the lora-conformance plugin (options, fixtures, report header) for runs of
the suites: installed, the plugin does nothing in other projects' pytest runs.

Suites that draw examples with hypothesis import ``given`` from ``lora_conformance.hypothesis_profile``,
which loads the suites' profile first.

Shapes that depend on the certification profile (``--profile``, lora_conformance/models/profiles.py)
are parametrised here: ``@pytest.mark.profile_param(argname, values_of_profile, ids=None)`` gives
``argname`` the values ``values_of_profile(profile)`` returns for the run's profile.
"""

pytest_plugins = ["lora_conformance.plugin"]


def pytest_configure(config):
    config.addinivalue_line("markers", "profile_param(argname, values_of_profile, ids=None): parametrise argname "
                                       "by the run's certification profile (--profile)")


def pytest_generate_tests(metafunc):
    for mark in metafunc.definition.iter_markers("profile_param"):
        from lora_conformance.models import profiles

        argname, values_of = mark.args
        values = list(values_of(profiles.active(metafunc.config)))
        ids = mark.kwargs.get("ids")
        metafunc.parametrize(argname, values, ids=[ids(v) for v in values] if ids else None)


def pytest_report_header(config):
    """The profile's shapes, and on cpu what the full profile would take (printed before any test)."""
    from lora_conformance.models import profiles
    from lora_conformance.settings import SETTINGS_KEY

    profile = profiles.active(config)
    if profile.name == "fast":
        return None
    settings = config.stash.get(SETTINGS_KEY, None)
    lines = [f"lora-conformance profile {profile.name}: bases {', '.join(profile.models.values())}; ranks "
             f"{', '.join(map(str, profile.ranks))}; {profile.loaded_adapters} adapters loaded, "
             f"{profile.batch_adapters} in one batch; prompts to {max(t for t, _ in profile.long_prompts)} tokens"]
    if settings is not None and settings.device_type == "cpu":
        lines.append(f"lora-conformance profile {profile.name} on cpu: {profile.cpu_hours}")
    return lines
