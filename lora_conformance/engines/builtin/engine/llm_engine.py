"""The serving loop: requests -> sequences -> scheduler steps -> model runner -> results."""

from __future__ import annotations

from typing import Sequence as Seq

from lora_conformance.engines.builtin.engine.adapter_pool import AdapterPool
from lora_conformance.engines.builtin.engine.block_manager import BlockManager
from lora_conformance.engines.builtin.engine.model_runner import ModelRunner
from lora_conformance.engines.builtin.engine.scheduler import Scheduler
from lora_conformance.engines.builtin.engine.sequence import Sequence, Status
from lora_conformance.types import GenerationRequest, GenerationResult


class LLMEngine:
    def __init__(self, runner: ModelRunner, pool: AdapterPool, blocks: BlockManager, tokenizer, args, eos_ids, plan):
        self.runner, self.pool, self.blocks, self.tokenizer = runner, pool, blocks, tokenizer
        self.scheduler = Scheduler(blocks, pool, args.max_batch_size, max(args.max_model_len, 8192),
                                   args.chunked_prefill_size)
        self.eos_ids = set(eos_ids)
        self.reverse = plan.reverse_order
        self.steps = {"prefill": 0, "decode": 0}

    def make_sequences(self, requests: Seq[GenerationRequest]) -> list[Sequence]:
        seqs = []
        identities = ["base" if req.adapter is None else self.pool.check(req.adapter).identity for req in requests]
        # One tokenizer call for the batch (the same ids as one call per prompt, a fraction of the time).
        all_ids = self.tokenizer([req.prompt for req in requests])["input_ids"] if requests else []
        for i, (req, identity, ids) in enumerate(zip(requests, identities, all_ids)):
            seqs.append(Sequence(list(ids), req.adapter, identity, req.max_new_tokens, req.top_k,
                                 req.prompt_logprobs, req.ignore_eos, index=i))
        return seqs

    def add(self, requests: Seq[GenerationRequest]) -> list[Sequence]:
        """Sequences for ``requests`` (adapters checked now), queued for scheduling."""
        seqs = self.make_sequences(requests)
        # Canonical admission order: results do not depend on the order of the caller's list.
        # (Variant reverse: the opposite order, a benign variation of the batch's row order.)
        for s in sorted(seqs, key=lambda s: (s.identity, s.prompt_ids, s.max_new_tokens, s.top_k,
                                             s.want_prompt_logprobs, s.ignore_eos, s.index),
                        reverse=self.reverse):
            if s.max_new_tokens > 0 or s.want_prompt_logprobs:
                self.scheduler.add(s)
            else:
                s.status = Status.FINISHED  # nothing to compute
        return seqs

    def step(self) -> bool:
        """One prefill or decode step of whatever is scheduled; False when there is nothing to run."""
        if not self.scheduler.has_work():
            return False
        batch, is_prefill = self.scheduler.schedule()
        if not batch:
            return False
        self.runner.load_slots(self.pool.pending_copies())
        outs = self.runner.prefill(batch) if is_prefill else self.runner.decode(batch)
        self.steps["prefill" if is_prefill else "decode"] += 1
        for s in batch:
            tok, top, prompt_lp = outs[s.seq_id]
            if is_prefill:
                s.num_computed = s.chunk_end
                self.blocks.publish_prompt(s)
                if prompt_lp is not None:
                    s.prompt_rows += [dict(r) for r in prompt_lp]
                if tok is None:
                    continue  # more chunks of this prefill to come
                s.prefilled = True
                if s.want_prompt_logprobs and s.prompt_logprobs is None:
                    s.prompt_logprobs = s.prompt_rows
            else:
                s.num_computed += 1
            if s.max_new_tokens > len(s.output_ids):
                s.output_ids.append(tok)
                s.logprobs.append(dict(top))
            stop = not s.ignore_eos and tok in self.eos_ids
            if len(s.output_ids) >= s.max_new_tokens or stop:
                self.scheduler.finish(s)
        return True

    def in_use(self, adapter: str) -> int:
        """Queued or running sequences that name ``adapter``."""
        return sum(1 for s in [*self.scheduler.waiting, *self.scheduler.running] if s.adapter == adapter)

    def results(self, seqs: list[Sequence]) -> list[GenerationResult]:
        texts = self.tokenizer.batch_decode([s.output_ids for s in seqs], skip_special_tokens=True) if seqs else []
        return [self._result(s, t) for s, t in zip(seqs, texts)]

    def generate(self, requests: Seq[GenerationRequest]) -> list[GenerationResult]:
        seqs = self.add(requests)
        while self.step():
            pass
        return self.results(seqs)

    def _result(self, s: Sequence, text: str) -> GenerationResult:
        return GenerationResult(token_ids=list(s.output_ids), text=text, logprobs=list(s.logprobs),
                                prompt_token_ids=list(s.prompt_ids), prompt_logprobs=s.prompt_logprobs,
                                cached_tokens=s.cached_reported)
