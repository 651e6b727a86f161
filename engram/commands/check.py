"""`engram check MODEL --a JSON --b JSON`: are two configurations of one model token-for-token equal?

Loads MODEL twice, once per arm (``--a`` / ``--b``: JSON objects of ``tier``, ``dtype``, ``device``,
``engram_config``, ``table_dirs`` and EngineConfig fields such as ``max_num_batched_tokens``,
``max_num_seqs``, ``enforce_eager``; ``{}`` is the default configuration), runs the same greedy probes on
both (``serial``, ``concurrent``, ``fixed-prefix``) on natural-English prompts and compares the tokens.
Prompts are the first ``--requests`` prompts of ``--corpus FILE`` (written by ``engram bench corpus``,
SHA-256 checked), or of a corpus generated in memory from the standard library's prose (``--seed``,
``--prompt-tokens`` under the built-in tokenizer); either way the text is encoded once with the model's
tokenizer and both arms receive the same token ids.

With ``--served`` each arm (``--a``, ``--b`` and an optional ``--c``) is a real `engram serve` instead, started one at
a time and probed over HTTP (``burst``: bitwise when the arms' step traces match; ``concurrent``: near-tie rule;
commands/check_served.py, bench/served_check.py); every arm is compared with arm a.

Exit status: 0 when every request is equal or a near-tie (top-2 logprob gap below ``--near-tie`` in either
arm at the first differing token), 1 on any real divergence (each listed with its probe, request,
position, both tokens, both gaps and the Engram rows whose bytes differ between the arms' tables), 2 on a
bad option or a model / table that does not load. docs/benchmarking.md ("engram check") has the rules.
"""
from __future__ import annotations

import argparse
import sys
import time

HELP = "check that two configurations of one model generate the same tokens (greedy probes, near-tie rule)"
CONTINUATION_TOKENS = "1:32"  # the generated corpus's continuations: unused, any cut near a word is fine


def add_arguments(p: argparse.ArgumentParser) -> None:
    from engram.bench.check import PROBES
    from engram.bench.served_check import SERVED_PROBES

    p.add_argument("model", nargs="?", default="tiny",
                   help="preset (tiny, small, 4b-like, 8b-like) or checkpoint directory (default: tiny)")
    arms = p.add_argument_group("arms")
    for name in ("a", "b"):
        arms.add_argument(f"--{name}", default="{}", metavar="JSON",
                          help=f'arm {name}: e.g. \'{{"tier": "disk", "engram_config": {{"cache_rows": 1000}}}}\' '
                               f'(keys: tier, dtype, device, engram_config, table_dirs, EngineConfig fields; with '
                               f'--served: model and `engram serve` options by name)')
    arms.add_argument("--c", default=None, metavar="JSON", help="with --served: a third arm, compared with arm a")
    arms.add_argument("--served", action="store_true",
                      help="check the serving path: one real `engram serve` per arm, one at a time, probes "
                           "burst (bitwise when the batches match) and concurrent (near-tie rule) over HTTP")
    arms.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    src = p.add_argument_group("prompts")
    src.add_argument("--corpus", default=None, metavar="FILE", help="corpus file (engram bench corpus)")
    src.add_argument("--requests", type=int, default=8, help="prompts per probe (the corpus's first N)")
    src.add_argument("--seed", type=int, default=0, help="seed of the in-memory corpus (without --corpus)")
    src.add_argument("--prompt-tokens", default="16:64", help="prompt lengths LO:HI of the in-memory corpus")
    probe = p.add_argument_group("probes")
    probe.add_argument("--probes", default=None,
                       help=f"comma-separated subset of {','.join(PROBES)} (default: all; with --served: "
                            f"{','.join(SERVED_PROBES)})")
    probe.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per request")
    probe.add_argument("--prefix-tokens", type=int, default=256,
                       help="fixed-prefix: length of the shared prefix (the prompts concatenated, cut)")
    probe.add_argument("--suffix-tokens", type=int, default=8, help="fixed-prefix: each prompt's own suffix")
    probe.add_argument("--near-tie", type=float, default=1e-3,
                       help="a divergence whose top-2 logprob gap is below this in either arm is a near-tie")
    probe.add_argument("--max-rows", type=int, default=32, help="differing Engram rows listed per divergence")
    p.add_argument("--json", default=None, metavar="OUT", help="write the result as JSON (engram.bench.report)")


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name.replace("-", "_"))
        if value < 1:
            raise ValueError(f"--{name}={value} must be >= 1")


def validate(args: argparse.Namespace):
    """(arm a, arm b, probe names), or ValueError naming the option and its value."""
    from engram.bench.check import PROBES, ArmSpec, check_same_model, share_device
    from engram.bench.corpus import LengthRange

    _positive(args, "requests", "max-tokens", "prefix-tokens", "suffix-tokens", "max-rows")
    if args.threads is not None:
        _positive(args, "threads")
    if not args.near_tie >= 0.0:
        raise ValueError(f"--near-tie={args.near_tie} must be >= 0")
    if args.c is not None:
        raise ValueError("--c: a third arm needs --served (the offline check compares two arms)")
    names = [n.strip() for n in (args.probes or ",".join(PROBES)).split(",") if n.strip()]
    bad = [n for n in names if n not in PROBES]
    if bad or not names:
        raise ValueError(f"--probes={args.probes!r}: {bad or 'none given'}; choose from {list(PROBES)}")
    if args.corpus is None:
        LengthRange.parse(args.prompt_tokens, "--prompt-tokens")
    a, b = ArmSpec.parse(args.a, "a"), ArmSpec.parse(args.b, "b")
    check_same_model(a, b)
    share_device(a, b)
    return a, b, list(dict.fromkeys(names))


def prompt_texts(args: argparse.Namespace) -> tuple[list[str], dict]:
    """The prompts' text and where it came from (corpus file and SHA-256, or the generated corpus's header)."""
    from engram.bench.corpus import LengthRange, generate_corpus, load_corpus, load_tokenizer

    if args.corpus is not None:
        corpus = load_corpus(args.corpus)
        source = {"corpus": str(args.corpus), "sha256": corpus.sha256}
    else:
        corpus = generate_corpus(args.requests, args.seed, LengthRange.parse(args.prompt_tokens, "--prompt-tokens"),
                                 LengthRange.parse(CONTINUATION_TOKENS), load_tokenizer("builtin"))
        source = {"corpus": None, "generated": {k: corpus.header[k] for k in ("seed", "source", "python", "tokenizer")}}
    if len(corpus.requests) < args.requests:
        raise ValueError(f"--requests={args.requests}: the corpus {args.corpus} holds {len(corpus.requests)}")
    return [r.prompt for r in corpus.requests[:args.requests]], source


def check_fits(probes, llms: dict, max_tokens: int) -> None:
    """Every prompt plus ``max_tokens`` fits both arms' max_model_len, so both generate every token; else a
    ValueError naming the options that made the prompt."""
    for probe in probes:
        for i, p in enumerate(probe.prompts):
            for name, llm in llms.items():
                if len(p) + max_tokens > llm.engine.max_model_len:
                    made = ("--prefix-tokens + --suffix-tokens" if probe.name == "fixed-prefix"
                            else "--prompt-tokens / --corpus")
                    raise ValueError(f"--max-tokens={max_tokens}: {probe.name} prompt {i} has {len(p)} tokens "
                                     f"(from {made}); together they exceed arm {name}'s "
                                     f"max_model_len={llm.engine.max_model_len}")


def _describe(arm: dict) -> str:
    """tier, dtype and device, then every other key the arm set."""
    rest = {k: v for k, v in arm.items() if k not in ("tier", "dtype", "device") and v not in ({}, None)}
    return ", ".join([arm["tier"], arm["dtype"], arm["device"]] + [f"{k}={v}" for k, v in rest.items()])


def run(args: argparse.Namespace) -> int:
    from engram.bench import report
    from engram.bench.check import build_arm, make_probes, run_check

    def say(msg: str) -> None:
        print(f"engram check: {msg}", file=sys.stderr, flush=True)

    if args.served:
        from engram.commands.check_served import run as run_served

        return run_served(args, prompt_texts, say)
    try:
        a, b, names = validate(args)
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        texts, source = prompt_texts(args)
        t0 = time.perf_counter()
        llms = {}
        for spec in (a, b):
            say(f"loading arm {spec.name}: {spec.to_dict()}")
            llms[spec.name] = build_arm(args.model, spec)
        tokenizer = llms["a"].get_tokenizer()
        prompts = [tokenizer.encode(t).ids for t in texts]  # what the engine makes of the text; both arms get these
        probes = make_probes(prompts, names, args.prefix_tokens, args.suffix_tokens)
        check_fits(probes, llms, args.max_tokens)
        say(f"{len(names)} probes x {len(prompts)} requests x {args.max_tokens} tokens on both arms")
        result = run_check(llms["a"], llms["b"], probes, args.max_tokens, args.near_tie, args.max_rows)
    except (ValueError, OSError) as e:
        print(f"engram check: error: {e}", file=sys.stderr)
        return 2
    arms = {n: {**spec.to_dict(), "tier": llms[n].tier, "dtype": str(llms[n].dtype).removeprefix("torch."),
                "device": str(llms[n].device)} for n, spec in (("a", a), ("b", b))}
    doc = {"model": args.model, "arms": arms, "prompts": {**source, "requests": len(prompts),
                                                          "prompt_tokens": [len(p) for p in prompts]},
           "seconds": round(time.perf_counter() - t0, 3), **result.to_dict()}
    print(report.format_table(result.summary_rows()))
    if result.difference_rows():
        print()
        print(report.format_table(result.difference_rows(), floatfmt="{:.3g}"))
    print(f"\n{doc['verdict']}: arm a ({_describe(arms['a'])}) vs arm b ({_describe(arms['b'])})")
    if args.json:
        print(f"wrote {report.write_result('check', report.args_config(args), doc, out=args.json)}")
    return result.exit_code
