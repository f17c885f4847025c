"""Offline throughput: our engine vs HF transformers `generate` (static batches, left padding)
vs vLLM's CPU build when one is installed, on ShareGPT prompts, same weights, same run, in one
dtype or both, with the GEMM floor: the time the model's own linear layers alone take on this
machine for the run's tokens (the weights timed at a 256-row batch, the faster of F.linear and
oneDNN on packed weights).

    .venv/bin/python bench/engine_throughput.py [--dtype both|auto|float32|bfloat16] [--num-prompts 200]
        [--output-len 128] [--hf-prompts 32] [--repeat 1] [--vllm-python ~/.cache/cascade/vllm-venv/bin/python]

Every system generates exactly --output-len tokens per prompt (EOS ignored), greedy. HF is run
on the first --hf-prompts prompts only (it is slow); its rate is what is compared. vLLM runs in
its own virtualenv (it pins its own torch) as a subprocess given the same HF directory our
engine converted from the GGUF, with this process's environment (the same OpenMP wait policy as
ours). --repeat N runs ours and vLLM N times each, alternating (ours first in even rounds), and
reports each one's median time: this project's VMs share their cores' matrix units and memory with
neighbours, and the same GEMM was seen to take 3x longer from one minute to the next. For the same
reason the GEMM floor is timed right after each of our runs, and ours over it is given by round.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cascade.eval.sharegpt import sample_requests

# before torch loads (lazily, in main): its OpenMP threads read this once
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

# run as a file: vLLM starts its engine core with multiprocessing spawn (needs a __main__ guard)
VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams


def main():
    args = json.loads(sys.argv[1])
    prompts = json.load(open(args["prompts"]))
    llm = LLM(model=args["model"], dtype=args["dtype"], max_model_len=2048, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args["output_len"], ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:2], SamplingParams(max_tokens=4))
    start = time.perf_counter()
    outs = llm.generate(inputs, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"seconds": elapsed, "tokens": tokens}))


if __name__ == "__main__":
    main()
"""


FLOOR = "GEMM floor (estimate)"


def run_ours(engine, prompts: list[list[int]], output_len: int) -> dict:
    from cloud_tier.engine import SamplingParams

    engine.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    # every run from a cold prefix cache, as each vLLM run (a new process) starts: a later run of
    # the same prompts would otherwise skip most of their prefill (fp32 here: 82 s cold, 52 s warm)
    engine.kv.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(len(o.token_ids) for o in outs),
            "prompts": len(prompts), "preemptions": engine.scheduler.num_preemptions,
            "cached_tokens": sum(max(o.num_cached_tokens, 0) for o in outs)}


def run_hf(model_dir: Path, dtype: str, prompts: list[list[int]], output_len: int,
           batch: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
        tokens += (out.shape[1] - width) * len(group)
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "prompts": len(prompts)}


def run_vllm(python: str, model_dir: Path, dtype: str, prompts: list[list[int]],
             output_len: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    (work / "prompts.json").write_text(json.dumps(prompts))
    (work / "run_vllm.py").write_text(VLLM_SCRIPT)
    args = json.dumps({"model": str(model_dir), "dtype": dtype,
                       "prompts": str(work / "prompts.json"), "output_len": output_len})
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"}
    proc = subprocess.run([python, str(work / "run_vllm.py"), args], capture_output=True,
                          text=True, env=env, timeout=3600, cwd=work)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"error": " | ".join(tail)[:400]}
    return {**json.loads(line[len("RESULT "):]), "prompts": len(prompts)}


def gemm_floor(model, prompts: list[list[int]], output_len: int, rows: int = 256) -> float:
    """Seconds the run's GEMMs alone would take: every prompt token and fed-back output token
    through each layer's linear weights, every output token through the LM head, each weight
    timed (best of 5) on a ``rows``-row batch in the model's dtype, the faster of F.linear and
    oneDNN on a packed copy (the two products the engine picks between) where this torch has it."""
    import torch
    import torch.nn.functional as F

    from cloud_tier.engine.models.layers import packed_product

    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    on_cpu = model.embed_tokens.weight.device.type == "cpu"
    packs = reorder is not None and torch.backends.mkldnn.is_available() and on_cpu

    def per_row(weight: torch.Tensor) -> float:
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        ways = [(F.linear, (x, weight))]
        if packs:
            ways.append((packed_product, (x, reorder(weight, rows))))
        best = float("inf")
        for product, args in ways:
            product(*args)
            for _ in range(5):
                start = time.perf_counter()
                product(*args)
                best = min(best, time.perf_counter() - start)
        return best / rows

    with torch.inference_mode():
        layer = sum(per_row(m.weight) for m in model.layers[0].modules() if isinstance(m, torch.nn.Linear))
        head = per_row(model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight)
    fed = sum(map(len, prompts)) + len(prompts) * (output_len - 1)
    return fed * layer * len(model.layers) + len(prompts) * output_len * head


def floor_run(model, prompts: list[list[int]], output_len: int) -> dict:
    return {"seconds": gemm_floor(model, prompts, output_len), "tokens": len(prompts) * output_len,
            "prompts": len(prompts)}


def main() -> int:
    from cloud_tier.engine_config import resolve_dtype

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="both", choices=["both", "auto", "float32", "bfloat16"],
                    help="both: float32 then bfloat16, each system in each; auto: what the engine picks here")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-prompts", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--vllm-python",
                    default=str(Path.home() / ".cache/cascade/vllm-venv/bin/python"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of ours and of vLLM each, alternating; the median time is reported")
    ap.add_argument("--device", default="cpu", help="our engine's device: cpu, cuda, cuda:1 ... (scripts/gpu-check.sh)")
    ap.add_argument("--systems", default="ours,hf,vllm",
                    help="comma-separated subset of ours,ours-int8 (weight-only INT8),hf,vllm")
    args = ap.parse_args()
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [resolve_dtype(args.dtype)]
    systems = set(args.systems.split(","))
    results: dict[str, dict[str, dict]] = {}
    for dtype in dtypes:
        results[dtype] = run_dtype(args, dtype, systems)
    print_table(results)
    return 0


def run_dtype(args, dtype: str, systems: set[str]) -> dict[str, dict]:
    from cloud_tier.engine import LLMEngine

    engine = LLMEngine.from_model(args.model, dtype=dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  kv_cache_memory_bytes=4 << 30)
    sampled = sample_requests(args.num_prompts, args.seed, engine.tokenizer,
                              max_prompt_tokens=1024)
    prompts = [engine.tokenizer.encode(r.prompt) for r in sampled]
    print(f"{len(prompts)} ShareGPT prompts, mean {sum(map(len, prompts)) / len(prompts):.0f} "
          f"tokens; {args.output_len} output tokens each; {args.model} {dtype}; "
          f"{os.cpu_count()} cores", flush=True)
    results = {}
    rounds: dict[str, list[dict]] = {"cascade engine": [], "vLLM CPU": [], FLOOR: []}
    if "vllm" in systems and not Path(args.vllm_python).exists():
        rounds["vLLM CPU"] = [{"error": f"not installed ({args.vllm_python} missing)"}]
        systems = systems - {"vllm"}
    for rnd in range(max(1, args.repeat)):
        for system in (["ours", "vllm"] if rnd % 2 == 0 else ["vllm", "ours"]):
            if system == "ours" and "ours" in systems:
                rounds["cascade engine"].append(run_ours(engine, prompts, args.output_len))
                # the floor timed right after each of our runs, in the same spell of this VM's speed
                rounds[FLOOR].append(floor_run(engine.model, prompts, args.output_len))
                ratio = rounds["cascade engine"][-1]["seconds"] / rounds[FLOOR][-1]["seconds"]
                print(f"cascade engine round {rnd}", rounds["cascade engine"][-1],
                      f"GEMM floor {rounds[FLOOR][-1]['seconds']:.1f} s (ours {ratio:.2f}x it)", flush=True)
            elif system == "vllm" and "vllm" in systems:
                rounds["vLLM CPU"].append(run_vllm(args.vllm_python, engine.model_dir, dtype, prompts,
                                                   args.output_len))
                print(f"vLLM round {rnd}", rounds["vLLM CPU"][-1], flush=True)
    if not rounds[FLOOR]:  # ours not run: the floor alone
        rounds[FLOOR].append(floor_run(engine.model, prompts, args.output_len))
    floor = rounds.pop(FLOOR)
    for name, rs in rounds.items():
        if rs:
            results[name] = median_run(rs)
    model_dir = engine.model_dir
    del engine  # its KV cache freed before HF runs
    gc.collect()
    if "ours-int8" in systems:  # the same engine with weight-only INT8 (a second load: the weights are replaced)
        from cloud_tier.engine import LLMEngine

        int8 = LLMEngine.from_model(args.model, dtype=dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    kv_cache_memory_bytes=4 << 30, weight_dtype="int8")
        runs = [run_ours(int8, prompts, args.output_len) for _ in range(max(1, args.repeat))]
        print("cascade engine, INT8 weights", runs, flush=True)
        results["cascade engine, INT8 weights"] = median_run(runs)
        del int8
        gc.collect()
    if "hf" in systems and args.hf_prompts:
        results[f"HF generate (batch {args.hf_batch})"] = run_hf(
            model_dir, dtype, prompts[:args.hf_prompts], args.output_len, args.hf_batch)
    results[FLOOR] = median_run(floor)
    ours = rounds["cascade engine"]
    if ours and "error" not in ours[0]:  # per round: each of our runs over the floor timed beside it
        results[FLOOR]["ours_over_floor"] = [round(o["seconds"] / f["seconds"], 2)
                                             for o, f in zip(ours, floor, strict=True)]
    return results


def median_run(runs: list[dict]) -> dict:
    """The run of median time (an error if any run failed), with every run's seconds."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    ordered = sorted(runs, key=lambda r: r["seconds"])
    return {**ordered[(len(ordered) - 1) // 2], "all_seconds": [round(r["seconds"], 1) for r in runs]}


def print_table(results: dict[str, dict[str, dict]]) -> None:
    print(f"\n{'dtype':<9} {'system':<24} {'prompts':>7} {'out tokens':>10} {'seconds':>8} {'out tok/s':>10} "
          f"{'ours / it':>9}")
    for dtype, rows in results.items():
        base = rows.get("cascade engine")
        ours = base["tokens"] / base["seconds"] if base else None
        for name, r in rows.items():
            if "error" in r:
                print(f"{dtype:<9} {name:<24} {'-':>7} {'-':>10} {'-':>8} {'-':>10} {'-':>9}   {r['error']}")
                continue
            rate = r["tokens"] / r["seconds"]
            ratio = f"{ours / rate:>8.2f}x" if ours else f"{'-':>9}"
            runs = f"   runs: {r['all_seconds']} s" if len(r.get("all_seconds", [])) > 1 else ""
            if "ours_over_floor" in r:
                runs += f"   ours / floor by round: {r['ours_over_floor']}"
            print(f"{dtype:<9} {name:<24} {r['prompts']:>7} {r['tokens']:>10} {r['seconds']:>8.1f} {rate:>10.1f} "
                  f"{ratio}{runs}")


if __name__ == "__main__":
    sys.exit(main())
