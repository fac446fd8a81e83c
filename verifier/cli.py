"""``ngram-verifier serve|demo`` (also ``python -m verifier``)."""

from __future__ import annotations

import argparse
import sys

from .config import VerifierConfig, add_config_flags, config_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ngram-verifier", description="speculative decoding verifier")
    sub = parser.add_subparsers(dest="command", required=True)
    add_config_flags(sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API"), VerifierConfig)
    from .demo import DemoConfig

    add_config_flags(sub.add_parser("demo", help="corpus + verifier on the CPU: acceptance and tokens/s"), DemoConfig)
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            from .service import serve

            serve(config_from_args(args, VerifierConfig))
        else:
            from .demo import run_demo

            return run_demo(config_from_args(args, DemoConfig))
    except (ValueError, FileNotFoundError) as e:
        print(f"ngram-verifier: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
