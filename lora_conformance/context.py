"""The ``lora`` fixture: what a suite test sees.

``TestContext`` gives a test its base model and dtype, engines from the session's pool
(``lora_conformance.harness``), the adapters it loads (unloaded again at teardown, so tests do not
leak state into each other), requests and the reference's outputs; its ``assert_*`` methods hand
the engine's outputs and the reference's to the test's ``Judge`` (``lora_conformance.judge``),
which owns every verdict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import pytest

from lora_conformance.harness import Harness, item_dtype
from lora_conformance.judge import paired
from lora_conformance.judge.checks import Judge
from lora_conformance.judge.paired import Alternatives
from lora_conformance.judge.tolerances import scale_of_model
from lora_conformance.markers import base_model_kind
from lora_conformance.types import GenerationRequest, GenerationResult

# The feature that certifies prompt logprobs; other tests use them only where a probe shows them
# working (TestContext.prompt_logprobs_shown_to_work).
PROMPT_LOGPROBS_FEATURE = "accuracy/prefill_logprobs_with_adapter"
# How long an xdist worker waits for another worker's probe answer before probing itself (s).
SHARED_PROBE_WAIT = 900


# ---- the engine's declared limits ------------------------------------------------------


def tests_eviction(node: pytest.Item) -> bool:
    """The test certifies eviction past ``max_loaded_loras`` (it requires ``max_loaded``): loading
    more adapters than the engine holds is then the point, not a mistake."""
    from lora_conformance.features import required_capabilities

    return "max_loaded" in required_capabilities(node)


def check_loaded_limit(engine, needed: int, evicting: bool = False) -> None:
    """Not certified (outcomes.LIMIT) when a test needs more adapters loaded at once than the
    engine's declared ``max_loaded_loras``: on such an engine the test would fail for its own
    reason, not the engine's. ``evicting``: the test is about evicting past the limit."""
    from lora_conformance.outcomes import limit_too_small

    allowed = engine.limits.max_loaded_loras
    if needed > allowed and not evicting:
        limit_too_small("loaded adapters", needed, allowed)


AdapterRef = Union[str, Path, Any]  # a DEFAULT_ADAPTERS name, a PEFT directory, or an AdapterSpec


def _adapter_names(labels: Sequence[Optional[str]]) -> list[str]:
    """The adapters of a batch's labels (None: a base row), each once, in order."""
    return [n for n in dict.fromkeys(labels) if n]


def activations_of(harness: Harness, model_dir: Path, dtype: Optional[str] = None) -> Optional[str]:
    """The activation scheme of the engine's quantised-base matmuls on this model (``Engine.declared_activations``;
    None: the run's dtype). The first one a run meets goes into its report's environment, with the rows it widens."""
    scheme = harness.declared_activations(model_dir, dtype)
    if scheme and "activations" not in harness.environment:
        from lora_conformance.judge.tolerances import ACTIVATIONS, SAME_ENGINE, activation_class
        from lora_conformance.models.quant import ACTIVATION_SCHEMES

        row = activation_class(scheme)
        harness.environment["activations"] = {
            "scheme": scheme, "description": ACTIVATION_SCHEMES.get(scheme, scheme), "tolerance_class": row,
            "rows": ACTIVATIONS[row], "same_engine_rows": SAME_ENGINE.get(row, {}),
            "declared_by": f"{harness.settings.engine}'s declared_activations"}
    return scheme


class TestContext:
    """The ``lora`` fixture."""

    __test__ = False  # not a pytest test class

    def __init__(self, harness: Harness, request: pytest.FixtureRequest):
        self.harness = harness
        self.settings = harness.settings
        self.request = request
        self.dtype = item_dtype(request, self.settings)
        self.device = self.settings.device
        self.model_dir = harness.workspace.model_dir(harness.workspace.model_spec(base_model_kind(request.node)))
        self._loaded: list[tuple[Any, str]] = []
        self._own_engines: list[Any] = []
        self._reset: set[int] = set()  # shared engines this test has reset already
        self._paths: dict[tuple[int, str], Path] = {}  # (engine, adapter name) -> the directory loaded
        # The reference results this test got, each with the adapter directory it was made with (None:
        # the base), so a comparison can ask the reference about them (``_reference_scorer``).
        self._made: list[tuple[GenerationResult, Optional[Path]]] = []
        self.judge = Judge(self.dtype, harness.workspace.reference(self.model_dir), self._record_effects,
                           scale_of_model(self.model_dir), activations_of(harness, self.model_dir, self.dtype))

    # ---- engines -----------------------------------------------------------------------

    @property
    def engine(self):
        """The shared engine for this test's model and dtype, with the user's engine args; no
        adapter is loaded in it when the test first gets it."""
        return self.engine_with()

    def declares(self, capability: str) -> bool:
        """Whether the engine under test declares ``capability`` for this test's model: the engine
        class answers where it can (nothing starts), else the shared engine."""
        return not self.harness.missing_capabilities(self.request, [capability])

    def require(self, *capabilities: str) -> None:
        """Not certified unless the engine declares every one of ``capabilities`` for this test's
        model; the report shows the plugin's evidence for each one it does not declare (what a
        feature marker's ``requires`` does, for a capability only a parametrisation needs)."""
        from lora_conformance.outcomes import missing_capabilities

        missing = self.harness.missing_capabilities(self.request, capabilities)
        if missing:
            missing_capabilities(missing, self.harness.not_declared_reasons(self.request))

    def engine_with(self, **args):
        """A shared engine with these engine args on top of the user's (started once per
        process for a model, dtype and args); no adapter is loaded in it when the test first
        gets it (Harness.reset_adapters)."""
        engine = self.harness.shared_engine(self.model_dir, self.dtype, args)
        if id(engine) not in self._reset:
            engine = self.harness.reset_adapters(engine, self.note)
            self._reset.add(id(engine))
        return engine

    # The highest adapter rank a test asks of a shared engine (adapter_semantics/rank at 64): an
    # engine whose default limit is lower (vLLM's 16) is asked for this limit, so those tests share
    # one engine.
    HIGH_RANK = 64

    def engine_for_rank(self, rank: int):
        """The shared engine when it accepts adapters of ``rank``; else the shared engine with the
        standard arg ``max_rank`` raised to ``max(rank, HIGH_RANK)``, as a user serving such
        adapters raises the limit. An engine without a ``max_rank`` arg, or whose own limit the
        user set explicitly (an engine's own arg wins over a standard one), is returned as it is:
        its ``limits.max_rank`` then tells the test what it cannot serve."""
        engine = self.engine
        if rank <= engine.limits.max_rank:
            return engine
        cls, _ = self.harness.parsed_engine_args({})
        if "max_rank" not in (cls.standard_args or {}):
            # an engine whose own arg is named max_rank (the builtin's) is raised the same way, unless
            # the user set it
            from lora_conformance.engines.args import arg_specs

            own = {s.name for s in arg_specs(cls.Args)} if getattr(cls, "Args", None) else set()
            if "max_rank" not in own or "max_rank" in self.harness.settings.engine_args:
                return engine
        return self.engine_with(max_rank=max(rank, self.HIGH_RANK))

    # The one small capacity of every test about slot limits (pinning, eviction, more adapters than
    # slots): two adapters per batch, four held. One setting, so these tests share one engine (an
    # engine that starts in half a minute, vLLM's on cpu, starts it once per worker, not once per
    # test); each test sizes its adapters to it (more than the slots, more than the held ones).
    CAPACITY = {"max_loras_per_batch": 2, "max_loaded_loras": 4}

    def capacity_engine(self, **args):
        """The shared engine with ``CAPACITY`` (and ``args``) on top of the user's engine args."""
        return self.engine_with(**self.CAPACITY, **args)

    def cold_engine(self, **args):
        """An engine with these args, no adapter loaded and an empty prefix cache: the shared one
        when the engine can empty its cache itself (``Engine.reset_prefix_cache``), else a fresh
        one for this test alone."""
        engine = self.engine_with(**args)
        if engine.reset_prefix_cache():
            return engine
        return self.fresh_engine(**args)

    def fresh_engine(self, **args):
        """A new engine for this test alone (closed at teardown): for a test that needs an engine
        that has never served anything (cold caches, a baseline untouched by adapters)."""
        engine = self.harness.create_engine(self.model_dir, self.dtype, args, "a fresh engine for this test")
        self._own_engines.append(engine)
        return engine

    def release(self, engine) -> None:
        """Close one of this test's own engines now (``fresh_engine``), before the test ends: on an
        accelerator the close finishes first (the next engine finds the device memory free), on cpu
        it runs on a thread while the test goes on (``Harness.retire``)."""
        self._own_engines.remove(engine)
        self._loaded = [(e, name) for e, name in self._loaded if e is not engine]  # nothing to unload at the end
        self.harness.retire(engine)

    # ---- adapters ----------------------------------------------------------------------

    def adapter_path(self, ref: AdapterRef) -> Path:
        from lora_conformance.adapters import DEFAULT_ADAPTERS

        if isinstance(ref, Path):
            return ref
        if isinstance(ref, str):
            if ref not in DEFAULT_ADAPTERS:
                raise KeyError(f"no default adapter {ref!r}; defaults: {', '.join(DEFAULT_ADAPTERS)}")
            ref = DEFAULT_ADAPTERS[ref]
        return self.harness.workspace.adapter_path(self.model_dir, ref)

    def load(self, engine, name: str, ref: Optional[AdapterRef] = None, pinned: bool = False) -> Path:
        """Load adapter ``ref`` (default: the default adapter called ``name``) as ``name``.
        Past the engine's ``max_loaded_loras`` the test is not certified (check_loaded_limit)."""
        path = self.adapter_path(name if ref is None else ref)
        self.require_loaded(engine, len(set(engine.list_adapters()) | {name}))
        engine.load_adapter(name, path, pinned=pinned)
        self._loaded.append((engine, name))
        self._paths[(id(engine), name)] = path
        return path

    def require_loaded(self, engine, needed: int) -> None:
        """The test needs ``needed`` adapters loaded at once on ``engine``: not certified when
        the engine holds fewer, unless the test is about eviction past that limit."""
        check_loaded_limit(engine, needed, tests_eviction(self.request.node))

    # ---- requests, references, comparisons ---------------------------------------------

    @property
    def prompts(self) -> list[str]:
        from lora_conformance.models import default_prompts

        return default_prompts()

    def requests(self, adapters: Sequence[Optional[str]], prompts: Optional[Sequence[str]] = None,
                 max_new_tokens: int = 16, prompt_logprobs: bool = False, top_k: int = 5) -> list[GenerationRequest]:
        """One request per adapter label (None = base), prompts taken in turn."""
        ps = list(prompts or self.prompts)
        return [GenerationRequest(prompt=ps[i % len(ps)], adapter=a, max_new_tokens=max_new_tokens,
                                  top_k=top_k, prompt_logprobs=prompt_logprobs) for i, a in enumerate(adapters)]

    def reference(self, requests: Sequence[GenerationRequest],
                  adapters: Mapping[str, AdapterRef] = {}) -> list[GenerationResult]:
        """Isolated HF+PEFT outputs; ``adapters`` maps request adapter names to their refs
        (names absent from it are taken from DEFAULT_ADAPTERS)."""
        names = {r.adapter for r in requests if r.adapter is not None}
        paths = {n: self.adapter_path(adapters.get(n, n)) for n in names}
        results = self.reference_runner.generate(requests, paths)
        self._made.extend((res, None if req.adapter is None else paths[req.adapter])
                          for req, res in zip(requests, results))
        return results

    def _reference_scorer(self, references: Sequence[GenerationResult]):
        """``Judge.matches_reference``'s ``score``: the reference's logprobs of given ids at a decode step
        of ``references[i]``, teacher-forced on its prompt and its tokens before that step (the engine
        chose the same ones: the step is the first divergence), for results this test's ``reference``
        made; None for any other (an engine's output used as the reference, say)."""
        made = {id(res): path for res, path in self._made}
        runner = self.reference_runner

        def score(i: int, step: int, ids: list[int]):
            ref = references[i]
            return runner.step_logprobs(ref, step, ids, made[id(ref)]) if id(ref) in made else None

        return score

    @property
    def reference_runner(self):
        """The HF + PEFT reference runner of this test's base model."""
        return self.harness.workspace.reference(self.model_dir)

    def decode(self, token_id: int) -> str:
        return self.judge.decode(token_id)

    def prompt_of_tokens(self, n: int) -> Optional[str]:
        """A prompt of the default prompts' words that the reference makes exactly ``n`` prompt tokens
        (special tokens included), or None where no run of their words has that count."""
        runner = self.reference_runner
        for prompt in self.prompts[5:] + self.prompts[:5]:
            words = " ".join([prompt] + self.prompts).split()
            for end in range(1, len(words) + 1):
                text = " ".join(words[:end])
                count = runner.token_count(text)
                if count == n:
                    return text
                if count > n:
                    break
        return None

    @property
    def tolerance(self):
        return self.judge.tolerance

    @property
    def same_engine_tolerance(self):
        """The bound for an engine compared with itself (``Judge.same_engine_tolerance``)."""
        return self.judge.same_engine_tolerance

    def assert_adapter_visible(self, references: Sequence[GenerationResult], requests: Sequence[GenerationRequest],
                               label: str = "", factor: float = 2.0,
                               others: Optional[Sequence[GenerationResult]] = None, tolerance=None) -> None:
        """The test's own power (``Judge.adapter_visible``): the references with the adapters must
        differ from the base model's (same prompts, no adapter; or from ``others``, outputs an engine
        with the bug under test would give) by more than ``factor`` x the tolerance somewhere."""
        from dataclasses import replace

        if others is None:
            others = self.reference([replace(r, adapter=None) for r in requests])
        self.judge.adapter_visible(references, others, label=label, factor=factor, tolerance=tolerance)

    def note(self, text: str) -> None:
        """A remark the report shows beside this test's verdict (what the test could not establish)."""
        from lora_conformance import evidence

        evidence.add(self.request.node, evidence.NOTE, text)

    def prompt_logprobs_shown_to_work(self, engine) -> bool:
        """Whether this test may ask ``engine`` (the one under test) for prompt logprobs, a feature it
        does not certify (``PROMPT_LOGPROBS_FEATURE`` does): the engine declares them, and a probe,
        once per run, got answers that match the reference. Otherwise the test checks what it can
        without them and the report notes the weaker check: a bug of prompt logprobs turns only their
        own feature red. The probe decides, never another test's outcome nor the expectations file
        (expectations say how an outcome is reported, never which checks run), so the answer is the
        same in every worker, every order and every expectations file."""
        if not engine.supports("prompt_logprobs"):
            self.note("without prompt_logprobs (the engine does not declare it): a weaker check")
            return False
        key = (str(self.model_dir), self.dtype)
        if key not in self.harness.prompt_logprobs_probes:
            self.harness.prompt_logprobs_probes[key] = self._run_shared(key, lambda: self._probe_prompt_logprobs(engine))
        broken = self.harness.prompt_logprobs_probes[key]
        if broken:
            self.note(f"without prompt_logprobs: {broken}; a weaker check ({PROMPT_LOGPROBS_FEATURE} certifies them)")
        return not broken

    def _run_shared(self, key: tuple, probe) -> str:
        """``probe()``'s answer, computed once per run: under pytest-xdist the first worker to ask
        computes it and the others read its answer (``fileio.once_per_run`` in the folder the run's
        workers share), so a probe that starts an engine starts one per run, not one per worker."""
        from lora_conformance.harness import shared_run_dir

        run_dir = shared_run_dir(self.request.config)
        if run_dir is None:
            return probe()
        from lora_conformance.fileio import once_per_run

        return once_per_run(run_dir / "lora-shared-probes", repr(key), probe, SHARED_PROBE_WAIT)

    def _probe_prompt_logprobs(self, caller) -> str:
        """'' when a mixed batch (adapter A and base rows) with prompt logprobs matches the reference;
        else what went wrong. It runs on the shared engine of this model and dtype with the user's
        engine args (its prefix cache emptied first where the engine can, so the answer does not depend
        on what ran before), which most tests start anyway; on an engine of its own where that engine
        is ``caller``'s, which the probe must not disturb. A probe that breaks the shared engine
        (EngineFailure) closes it: the next test to ask for it starts it again, and says why."""
        from lora_conformance.engines import EngineFailure
        from lora_conformance.outcomes import NotCertified

        own = shared = None
        try:
            shared = self.harness.shared_engine(self.model_dir, self.dtype, {})
            if shared is caller:
                shared = None
                engine = own = self.harness.create_engine(self.model_dir, self.dtype, {},
                                                          "the prompt-logprobs probe's own engine")
            else:
                engine = shared = self.harness.reset_adapters(shared)
                shared.reset_prefix_cache()
        except (Exception, NotCertified) as exc:  # noqa: BLE001 - any start failure means: do not rely on the probe
            return f"the probe engine did not start ({type(exc).__name__})"
        try:
            engine.load_adapter("A", self.adapter_path("A"))
            reqs = self.requests(["A", None], max_new_tokens=2, prompt_logprobs=True)
            outs = engine.generate(reqs)
            if any(o.prompt_logprobs is None for o in outs):
                return "a probe with prompt logprobs returned none"
            self.assert_matches_reference(outs, self.reference(reqs), reqs, label="prompt-logprobs probe")
            return ""
        except Exception as exc:  # noqa: BLE001 - the probe's only question: does it work?
            if shared is not None and isinstance(exc, EngineFailure):
                self.harness.drop(shared, "the prompt-logprobs probe broke it")
                shared = None
            return f"a probe with prompt logprobs failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
        finally:
            if own is not None:
                self.harness.retire(own, swallow=True)
            elif shared is not None:
                try:
                    shared.unload_adapter("A")
                except Exception:  # noqa: BLE001 - the next test's reset unloads it, or replaces the engine
                    pass

    def assert_conforms(self, engine, labels: Sequence[Optional[str]], adapters: Mapping[str, AdapterRef] = {},
                        prompts: Optional[Sequence[str]] = None, *,
                        alternatives: Alternatives = Alternatives(), label: str = "") -> list:
        """The paired, teacher-forced verdict (``Judge.effects``), then the free-running decode check.
        For each adapter label the engine's effect (adapter minus base, both from the engine) must
        match the reference's and be nearest the correct hypothesis among the alternatives
        (``judge.hypotheses.standard``, "served as" each other adapter of the test, and what
        ``alternatives`` adds). Requests are made in the order of ``labels`` (None = a base row),
        prompts taken in turn, so a test's batch composition is what the engine sees; ``adapters``
        maps labels to their refs (others are default adapters). Every alternative must be separable
        at this dtype (else a suite defect), except single modules dropped, which only
        ``Alternatives(modules=True)`` tests must separate (elsewhere they are judged where separable
        and reported otherwise). Returns the analyses; raises SuiteDefectError when the test cannot
        separate a hypothesis."""
        free = self._free_running_requests(labels, prompts)  # the contexts are read from these decodes
        plan = self._paired_plan(labels, adapters, prompts, alternatives,
                                 decode=(free[0].max_new_tokens, free[0].top_k) if free else None)
        analyses = self.judge.effects(plan, engine, label or ", ".join(_adapter_names(labels)) or "base")
        self.assert_free_running_matches(engine, labels, {**adapters, **alternatives.old}, prompts, label=label)
        return analyses

    def assert_prompt_logprobs_conform(self, engine, labels: Sequence[Optional[str]],
                                       adapters: Mapping[str, AdapterRef] = {},
                                       prompts: Optional[Sequence[str]] = None, *, label: str = "") -> list:
        """``assert_conforms``' paired verdict on the engine's *prompt* logprobs (``Judge.prompt_effects``):
        every prompt position is a teacher-forced context. Returns the analyses."""
        plan = self._paired_plan(labels, adapters, prompts, Alternatives())
        return self.judge.prompt_effects(plan, engine,
                                         label or "prompt logprobs " + (", ".join(_adapter_names(labels)) or "base"))

    def assert_free_running_matches(self, engine, labels: Sequence[Optional[str]],
                                    adapters: Mapping[str, AdapterRef] = {}, prompts: Optional[Sequence[str]] = None,
                                    *, label: str = "") -> None:
        """The greedy decode of one request per label (prompts taken in turn) against the reference, at
        the gross bounds (``Judge.free_running``): tie-aware tokens and ROUGE-L, the decode path."""
        reqs = self._free_running_requests(labels, prompts)
        outputs = engine.generate(reqs)
        self._offer_to_audit(engine, reqs, outputs)
        references = self.reference(reqs, adapters)
        self.judge.free_running(outputs, references, reqs, label=label, score=self._reference_scorer(references))

    def _free_running_requests(self, labels: Sequence[Optional[str]],
                               prompts: Optional[Sequence[str]]) -> list[GenerationRequest]:
        """The free-running check's requests: one per label, prompts taken in turn (``requests``'
        defaults). ``assert_conforms`` reads the paired contexts from the reference's decodes of these."""
        return self.requests(list(labels), prompts=list(prompts or self.prompts))

    def _offer_to_audit(self, engine, reqs: Sequence[GenerationRequest], outputs: Sequence[GenerationResult]) -> None:
        """This decode, for the end-of-run audit (``judge.audit``): where a fresh engine can be given
        the same settings (a shared engine's) and the same adapters (loaded through ``load``)."""
        from lora_conformance.judge.audit import AuditCase

        engine_args = self.harness.engine_args_of(engine)
        names = _adapter_names([r.adapter for r in reqs])
        if engine_args is None or any((id(engine), n) not in self._paths for n in names):
            return
        self.harness.audit_cases.setdefault(self.request.node.nodeid, AuditCase(
            self.request.node.nodeid, self.model_dir, self.dtype, dict(engine_args),
            {n: self._paths[(id(engine), n)] for n in names}, list(reqs), list(outputs)))

    @property
    def free_running_tolerance(self):
        return self.judge.free_running_tolerance

    def _paired_plan(self, labels: Sequence[Optional[str]], adapters: Mapping[str, AdapterRef],
                     prompts: Optional[Sequence[str]], alternatives: Alternatives,
                     decode: Optional[tuple[int, int]] = None) -> paired.Plan:
        paths = {n: self.adapter_path(adapters.get(n, n)) for n in _adapter_names(labels)}
        old = {n: self.adapter_path(ref) for n, ref in alternatives.old.items()}
        return paired.plan(labels, list(prompts or self.prompts), paths, old, alternatives.modules, decode)

    def _record_effects(self, analyses_evidence: list) -> None:
        from lora_conformance import evidence

        evidence.add(self.request.node, evidence.EFFECTS, analyses_evidence)

    def assert_matches_reference(self, outputs: Sequence[GenerationResult], references: Sequence[GenerationResult],
                                 requests: Sequence[GenerationRequest], label: str = "", tolerance=None) -> None:
        """``Judge.matches_reference``: prompt logprobs (pooled), decode logprobs (tie-aware) and ROUGE-L."""
        self.judge.matches_reference(outputs, references, requests, label=label, tolerance=tolerance,
                                     score=self._reference_scorer(references))

    def close(self) -> None:
        from lora_conformance.engines.base import EngineError

        for engine, name in reversed(self._loaded):
            if engine in self._own_engines:
                continue
            try:
                if name in engine.list_adapters():
                    engine.unload_adapter(name)
            except EngineError:
                pass  # the test itself may have unloaded or replaced it
        for engine in self._own_engines:
            self.harness.retire(engine)


def audit_at_end(config, harness, seed: int, run_audit, keep_audit) -> None:
    """The end-of-run audit of this process's passed cases (``run_audit``, its result given to
    ``keep_audit``). The shared engines close first: the audit starts fresh ones, and a real-shape base
    held twice beside the reference ran a 24 GiB cpu host out of memory there (no report). The
    references' loaded models go too (the audit compares with the run's own outputs): with them, the
    fresh engine's load still ran that host out of memory (bfloat16, 24 GB resident, no report). Then
    the audit's own engines close."""
    harness.close()
    harness.workspace.release_reference_models()
    keep_audit(config, run_audit(harness, seed))
    harness.close()


def run_audit(harness: Harness, seed: int) -> dict:
    """The audit of this process's passed cases (``judge.audit``): each sampled case on a fresh
    engine of the pool's, judged by its model's and dtype's Judge."""
    from lora_conformance.judge import audit

    def start(case):
        return harness.create_engine(case.model_dir, case.dtype, case.engine_args,
                                     f"the audit's fresh engine for {case.nodeid}")

    def judge_for(case):
        return Judge(case.dtype, harness.workspace.reference(case.model_dir), lambda evidence: None,
                     scale_of_model(case.model_dir), activations_of(harness, case.model_dir, case.dtype))

    return audit.run(list(harness.audit_cases.values()), seed, start, judge_for).as_dict()
