"""``ngram-verifier serve|demo|generate`` (also ``python -m verifier``)."""

from __future__ import annotations

import argparse
import sys

# The verifier's own dependencies are the package's "verifier" extra: a plain `pip install
# ngram-corpus` serves the corpus, and this command then says what to install instead of a traceback.
VERIFIER_EXTRA_MODULES = ("torch", "jinja2", "llguidance")


def main(argv: list[str] | None = None) -> int:
    try:
        from .config import VerifierConfig, add_config_flags, config_from_args
    except ModuleNotFoundError as e:
        if e.name not in VERIFIER_EXTRA_MODULES:
            raise
        print(f"ngram-verifier: error: {e.name} is not installed; the verifier needs the extra: "
              'pip install "ngram-corpus[verifier]"', file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="ngram-verifier", description="speculative decoding verifier")
    sub = parser.add_subparsers(dest="command", required=True)
    add_config_flags(sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API"), VerifierConfig)
    from .demo import DemoConfig

    add_config_flags(sub.add_parser("demo", help="corpus + verifier on the CPU: acceptance and tokens/s"), DemoConfig)
    from .generate.cli import GenerateConfig

    add_config_flags(sub.add_parser("generate", help="offline rollouts: n samples of every prompt of a JSONL file, "
                                    "completions with token ids and logprobs to a JSONL file"), GenerateConfig)
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            from .service import serve

            serve(config_from_args(args, VerifierConfig))
        elif args.command == "generate":
            from .generate.cli import run_generate

            return run_generate(config_from_args(args, GenerateConfig))
        else:
            from .demo import run_demo

            return run_demo(config_from_args(args, DemoConfig))
    except (ValueError, FileNotFoundError) as e:
        print(f"ngram-verifier: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
