"""Throughput, side by side on one device: the built-in engine vs HF PEFT.

Runs (same requests, greedy, fixed length, no early stop):
  builtin-mixed   built-in engine, 8 adapters + base rows in one batch
  builtin-base    built-in engine, no adapters (its own LoRA-overhead baseline)
  peft-mixed      HF + PEFT generate(adapter_names=[...]) with "__base__" rows
  peft-single     HF + PEFT, one adapter for the whole batch
  hf-base         HF generate on the base model

Self-contained: builds a random Qwen2-shaped checkpoint, a word-level tokenizer and rank-16
all-linear PEFT adapters in a temp dir (no network).

Each run is warmed up once, then timed ``--repeat`` times on the same requests; the table shows
the median (the JSON keeps every timing). On a shared machine one timing of a sub-second run
says more about the neighbours than about the engine.

  python bench/engine_throughput.py --config cpu --json out.json
  python bench/engine_throughput.py --config gpu --device cuda --json out.json
  python bench/engine_throughput.py --config cpu --count-ops   # aten ops per decode step instead
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

CONFIGS = {
    # Qwen2-0.5B shape (~457M parameters with tied embeddings), bfloat16.
    "gpu": dict(hidden=896, layers=24, heads=14, kv_heads=2, inter=4864, vocab=32000, dtype="bfloat16",
                batch=32, prompt=128, new=64, adapters=8, rank=16),
    "cpu": dict(hidden=256, layers=4, heads=4, kv_heads=2, inter=1376, vocab=8000, dtype="float32",
                batch=8, prompt=128, new=64, adapters=8, rank=16),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_world(root: Path, c: dict):
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(c["vocab"] - 4)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", padding_side="left")
    base = root / "base"
    fast.save_pretrained(str(base))
    # Qwen2's computation as a Llama config with q/k/v biases: transformers 5 forces the Qwen2
    # tokenizer class on model_type "qwen2", which would turn our word-level prompts into one token.
    cfg = LlamaConfig(attention_bias=True, vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["inter"],
                      num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                      num_key_value_heads=c["kv_heads"], max_position_embeddings=4096, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(getattr(torch, c["dtype"])).eval()
    model.save_pretrained(str(base))
    adapters = {}
    for i in range(c["adapters"]):
        m = LlamaForCausalLM.from_pretrained(str(base), dtype=getattr(torch, c["dtype"]))
        pm = get_peft_model(m, LoraConfig(r=c["rank"], lora_alpha=2 * c["rank"], target_modules=TARGETS,
                                          init_lora_weights=False))
        with torch.no_grad():
            g = torch.Generator().manual_seed(100 + i)
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.copy_((torch.randn(p.shape, generator=g) * 0.02).to(p.dtype))
        adapters[f"ad{i}"] = root / f"ad{i}"
        pm.save_pretrained(str(adapters[f"ad{i}"]))
    return base, adapters, fast


def prompts(c: dict, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, c["vocab"], (c["batch"], c["prompt"] - 1), generator=g)  # +BOS = prompt tokens
    return [" ".join(f"w{int(t) - 4}" for t in row) for row in ids]


def routing(c: dict) -> list:
    # every 4th request on the base model, the others round-robin over the adapters
    names = [f"ad{i % c['adapters']}" for i in range(c["batch"])]
    return [None if i % 4 == 3 else n for i, n in enumerate(names)]


def timed(fn, device: str, repeat: int = 1) -> list[tuple[float, float]]:
    """(wall seconds, this process's cpu seconds) of each of ``repeat`` calls."""
    from lora_conformance import devices

    out = []
    for _ in range(repeat):
        devices.synchronize(device)
        t, p = time.perf_counter(), time.process_time()
        fn()
        devices.synchronize(device)
        out.append((time.perf_counter() - t, time.process_time() - p))
    return out


def make_builtin(base, adapters, c, device, graphs: bool, extra: dict | None = None):
    """The built-in engine sized for workload ``c``, every adapter loaded."""
    from lora_conformance.engines.builtin import BuiltinEngine

    args = {"max_loras_per_batch": str(c["adapters"]), "max_rank": str(c["rank"]), "graphs": "1" if graphs else "0",
            "max_batch_size": str(c["batch"]), "max_model_len": str(c["prompt"] + c["new"] + 16),
            "prefix_cache": "0", **(extra or {})}
    eng = BuiltinEngine(base, device, c["dtype"], args)
    for n, p in adapters.items():
        eng.load_adapter(n, p)
    return eng


def builtin_requests(c, names, seed: int, new: int | None = None) -> list:
    """Greedy, fixed-length requests: prompts(c, seed), one per routing entry of ``names``."""
    from lora_conformance.types import GenerationRequest

    return [GenerationRequest(p, a, max_new_tokens=new or c["new"], top_k=1, ignore_eos=True)
            for p, a in zip(prompts(c, seed), names)]


def bench_builtin(base, adapters, c, device, names, graphs: bool, repeat: int = 1,
                  extra: dict | None = None) -> list[tuple[float, float]]:
    eng = make_builtin(base, adapters, c, device, graphs, extra)
    # the requests are the client's work, made before the clock starts (as the HF runs' prompt texts)
    reqs = {seed: builtin_requests(c, names, seed) for seed in (1, 2)}

    def run(seed):
        res = eng.generate(reqs[seed])
        assert all(len(r.token_ids) == c["new"] for r in res)

    run(1)  # warm-up: slot loads, graph capture, allocator
    secs = timed(lambda: run(2), device, repeat)
    eng.close()
    return secs


def count_decode_ops(base, adapters, c, device, names) -> dict:
    """aten ops in one full-batch decode step of the built-in engine (eager, what graphs capture).

    Views launch no kernel, so they are counted apart: ``kernels`` is what a replayed graph runs.
    """
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
                with self:  # count what a composite op (linear, reshape, to, ...) really runs
                    out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
            self.ops[func] += 1
            return func(*args, **kwargs)

    eng = make_builtin(base, adapters, c, device, graphs=False)
    runner, seen = eng.runner, []
    forward = runner.decode_forward

    def counted(*a, **kw):
        if seen:
            return forward(*a, **kw)
        mode = Count()
        with mode:
            out = forward(*a, **kw)
        seen.append(mode.ops)
        return out

    runner.decode_forward = counted
    eng.generate(builtin_requests(c, names, 1, new=2))
    eng.close()
    ops = seen[0]
    views = sum(n for f, n in ops.items() if f.is_view or f == torch.ops.aten._unsafe_view.default)
    total = sum(ops.values())
    kernels = [(str(f), n) for f, n in ops.most_common() if not (f.is_view or f == torch.ops.aten._unsafe_view.default)]
    return {"ops": total, "kernels": total - views, "views": views,
            "per_layer_kernels": round((total - views) / c["layers"], 1), "top": kernels}


def bench_hf(base, adapters, c, device, mode: str, repeat: int = 1) -> list[tuple[float, float]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=getattr(torch, c["dtype"])).to(device).eval()
    kw = {}
    if mode != "base":
        items = list(adapters.items()) if mode == "mixed" else list(adapters.items())[:1]
        model = PeftModel.from_pretrained(model, str(items[0][1]), adapter_name=items[0][0])
        for n, p in items[1:]:
            model.load_adapter(str(p), adapter_name=n)
        model.eval()
        if mode == "mixed":
            kw["adapter_names"] = [n or "__base__" for n in routing(c)]
    model.generation_config.eos_token_id = None

    texts = {seed: prompts(c, seed) for seed in (1, 2)}  # made before the clock starts; tokenising is timed

    def run(seed):
        enc = tok(texts[seed], return_tensors="pt", padding=True).to(device)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=c["new"], min_new_tokens=c["new"], do_sample=False,
                                 pad_token_id=tok.pad_token_id, **kw)
        assert out.shape[1] - enc["input_ids"].shape[1] == c["new"]

    run(1)
    secs = timed(lambda: run(2), device, repeat)
    del model
    return secs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="cpu")
    ap.add_argument("--device", default=None, help="torch device (default: cpu for --config cpu, else auto)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--graphs", choices=("auto", "0", "1"), default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--count-ops", action="store_true",
                    help="print aten ops per decode step for builtin-mixed and builtin-base, then exit")
    ap.add_argument("--skip", default="", help="comma-separated runs to skip (e.g. peft-single)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra built-in engine arg for the builtin runs (e.g. kernels=torch), repeatable")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per engine after the warm-up (median shown)")
    a = ap.parse_args(argv)
    from lora_conformance import devices

    c = CONFIGS[a.config]
    if a.threads:
        torch.set_num_threads(a.threads)
    device = devices.resolve_device(a.device or ("cpu" if a.config == "cpu" else "auto"))
    graphs = devices.graphs_supported(device) if a.graphs == "auto" else a.graphs == "1"
    tokens = c["batch"] * c["new"]
    skip = set(filter(None, a.skip.split(",")))
    extra = dict(kv.split("=", 1) for kv in a.engine_arg)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        base, adapters, _ = build_world(Path(tmp), c)
        from transformers import AutoTokenizer

        n_prompt = len(AutoTokenizer.from_pretrained(str(base))(prompts(c, 0)[0]).input_ids)
        if n_prompt != c["prompt"]:  # every engine tokenises through AutoTokenizer: guard the workload
            raise SystemExit(f"workload error: prompts tokenise to {n_prompt} tokens, expected {c['prompt']}")
        if a.count_ops:
            for name, names in (("builtin-mixed", routing(c)), ("builtin-base", [None] * c["batch"])):
                r = count_decode_ops(base, adapters, c, device, names)
                print(f"{name:14s} {r['kernels']:6d} kernel ops/decode step ({r['per_layer_kernels']} per layer), "
                      f"{r['views']} views, {r['ops']} aten ops in all")
                for op, n in r["top"]:
                    print(f"    {n:6d}  {op}")
                results[name] = r
            if a.json:
                a.json.parent.mkdir(parents=True, exist_ok=True)
                a.json.write_text(json.dumps({"config": a.config, "count_ops": results}, indent=2))
            return 0
        runs = {
            "builtin-mixed": lambda: bench_builtin(base, adapters, c, device, routing(c), graphs, rep, extra),
            "builtin-base": lambda: bench_builtin(base, adapters, c, device, [None] * c["batch"], graphs, rep, extra),
            "peft-mixed": lambda: bench_hf(base, adapters, c, device, "mixed", rep),
            "peft-single": lambda: bench_hf(base, adapters, c, device, "single", rep),
            "hf-base": lambda: bench_hf(base, adapters, c, device, "base", rep),
        }
        rep = max(a.repeat, 1)
        for name, fn in runs.items():
            if name in skip:
                continue
            timings = fn()
            all_secs = [w for w, _ in timings]
            secs = statistics.median(all_secs)
            # cpu seconds of this process: on a shared cpu, time the neighbours took is not in it
            results[name] = {"seconds": round(secs, 4), "tokens": tokens, "tok_per_s": round(tokens / secs, 1),
                             "all_seconds": [round(x, 4) for x in all_secs],
                             "cpu_seconds": round(statistics.median(p for _, p in timings), 4)}
            runs_s = ", ".join(f"{x:.3f}" for x in all_secs)
            print(f"{name:14s} {tokens / secs:10.1f} tok/s  (median {secs:.3f} s of {runs_s})",
                  file=sys.stderr, flush=True)
    tps = {k: v["tok_per_s"] for k, v in results.items()}
    ratios = {}
    if "builtin-mixed" in tps and "peft-mixed" in tps:
        ratios["builtin_mixed_over_peft_mixed"] = round(tps["builtin-mixed"] / tps["peft-mixed"], 2)
    if "builtin-mixed" in tps and "builtin-base" in tps:
        ratios["builtin_lora_overhead"] = round(tps["builtin-base"] / tps["builtin-mixed"], 3)
    if "builtin-mixed" in tps and "hf-base" in tps:
        ratios["builtin_mixed_over_hf_base"] = round(tps["builtin-mixed"] / tps["hf-base"], 2)
    report = {"config": a.config, "device": device, "device_name": devices.device_name(device), "graphs": graphs,
              "workload": c, "builtin_engine_args": extra, "torch": torch.__version__, "results": results, "ratios": ratios}
    print(f"\nconfig={a.config} device={device} ({report['device_name']}) dtype={c['dtype']} graphs={graphs} "
          f"batch={c['batch']} prompt={c['prompt']} new={c['new']} adapters={c['adapters']} r={c['rank']} "
          f"repeat={a.repeat} (median)" + (f" builtin args: {' '.join(a.engine_arg)}" if a.engine_arg else ""))
    print(f"{'run':16s}{'tok/s':>12s}{'seconds':>10s}{'cpu s':>10s}")
    for k, v in results.items():
        print(f"{k:16s}{v['tok_per_s']:12.1f}{v['seconds']:10.3f}{v['cpu_seconds']:10.3f}")
    for k, v in ratios.items():
        print(f"{k}: {v}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
