"""`engram generate [MODEL] --prompt ... | --prompts-file F`: offline batch generation with a throughput summary.

Loads MODEL (a preset name or a checkpoint directory; default ``tiny``), runs every prompt through the
continuous-batching engine with a progress bar, prints each completion (or JSON lines with ``--json``)
and ends with requests, prompt/generated tokens, wall time and tokens per second.
"""
from __future__ import annotations

import argparse
import json
import sys

from engram.commands.options import add_engine_arguments, add_model_arguments, build_llm, run_torchrun_rank

HELP = "generate completions for prompts offline (continuous batching) and report throughput"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    src = parser.add_argument_group("prompts")
    src.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    src.add_argument("--prompts-file", help="a file with one prompt per line (blank lines skipped)")
    src.add_argument("--repeat", type=int, default=1, help="run every prompt this many times (load tests)")
    samp = parser.add_argument_group("sampling")
    samp.add_argument("--max-tokens", type=int, default=32)
    samp.add_argument("--temperature", type=float, default=0.0)
    samp.add_argument("--top-p", type=float, default=1.0)
    samp.add_argument("--top-k", type=int, default=0)
    samp.add_argument("--seed", type=int, default=None)
    samp.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    samp.add_argument("--ignore-eos", action="store_true")
    add_engine_arguments(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object per completion, then the summary")
    out.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError("no prompts: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    if args.repeat < 1:
        raise ValueError(f"--repeat={args.repeat} must be >= 1")
    return prompts * args.repeat


def run(args: argparse.Namespace) -> int:
    import time

    from engram.engine.sampling_params import SamplingParams

    if run_torchrun_rank(args):  # a torchrun rank other than 0: it served rank 0's steps
        return 0
    try:
        prompts = read_prompts(args)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
        t0 = time.perf_counter()
        llm = build_llm(args)
    except (ValueError, OSError) as e:
        print(f"engram generate: error: {e}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t0
    from engram.engine.heap import freeze_startup_heap, thaw_heap

    freeze_startup_heap()  # full collections skip the start-up heap while generating (engine/heap.py)
    t1 = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
        stats = llm.engine.stats()
    finally:
        thaw_heap()  # the command may run inside another program's process (tests call main())
        # other ranks stopped and the process group left before exit (torch.distributed torn down at interpreter
        # exit can abort the process)
        llm.engine.close()
    gen_s = time.perf_counter() - t1
    for out in outputs:
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"request_id": out.request_id, "prompt": out.prompt, "text": c.text,
                              "token_ids": c.token_ids, "finish_reason": c.finish_reason}))
        else:
            print(f"--- {out.prompt!r}\n{c.text}")
    prompt_toks = sum(len(o.prompt_token_ids) for o in outputs)
    gen_toks = sum(len(o.outputs[0].token_ids) for o in outputs)
    summary = {"model": args.model, "tier": llm.tier, "dtype": str(llm.dtype).removeprefix("torch."),
               "device": str(llm.device), "requests": len(outputs), "prompt_tokens": prompt_toks,
               "generated_tokens": gen_toks, "load_s": round(load_s, 3), "generate_s": round(gen_s, 3),
               "output_tokens_per_s": round(gen_toks / gen_s, 2) if gen_s > 0 else None,
               "total_tokens_per_s": round((prompt_toks + gen_toks) / gen_s, 2) if gen_s > 0 else None,
               "kv_blocks": stats["kv_blocks_total"], "preemptions": stats["preemptions"]}
    if "speculative" in stats:
        summary["speculative"] = stats["speculative"]
    if args.json:
        print(json.dumps({"summary": summary}))
    else:
        print(f"\n{len(outputs)} requests, {prompt_toks} prompt + {gen_toks} generated tokens in {gen_s:.2f} s: "
              f"{summary['output_tokens_per_s']} generated tok/s, {summary['total_tokens_per_s']} total tok/s "
              f"({summary['device']}, {summary['dtype']}, tier {summary['tier']}; load {load_s:.2f} s, "
              f"{summary['preemptions']} preemptions)")
        if "speculative" in summary:
            spec = summary["speculative"]
            print(f"speculative decoding ({spec['method']}, K={spec['num_speculative_tokens']}): acceptance length "
                  f"{spec['mean_acceptance_length']:.2f}, {spec['accepted_tokens']} of {spec['draft_tokens']} drafts "
                  "accepted")
    return 0
