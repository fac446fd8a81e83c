"""``ngram-corpus``: serve | upload FILE --name NAME | ls | rm NAME | stats.

``serve`` flags mirror ``ServiceConfig`` fields and each reads ``NGRAM_CORPUS_<FIELD>``; the admin
commands talk to the REST admin (``--admin-url`` / ``NGRAM_CORPUS_ADMIN_URL``, ``--token`` /
``NGRAM_CORPUS_ADMIN_TOKEN``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

from corpus_service.service_config import ENV_PREFIX, ServiceConfig

_HELP = {
    "host": "address to bind (beyond loopback an admin token is required)",
    "grpc_port": "gRPC port (0 = ephemeral)",
    "admin_port": "REST admin port (0 = ephemeral, -1 = off)",
    "data_dir": "snapshots and uploads; unset = nothing persists",
    "namespaces": "NAME[:key=value,...], repeatable (env: ';'-separated), e.g. smollm2:vocab=49152,tokenizer=smollm2",
    "client_tokens": "JSON file of client tokens (name, namespaces, role); set = every gRPC call and /v1 route needs one",
    "tls_cert": "PEM certificate: gRPC and the admin serve TLS (with --tls-key)",
    "tls_client_ca": "PEM CA: require client certificates it signed (mutual TLS)",
    "admin_rate_per_s": "mutating admin calls per caller and second (0 = no limit)",
    "put_rate_per_s": "BatchPut calls per caller and second (0 = no limit)",
}


def _env(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(ServiceConfig):
        if not f.init:
            continue
        env = _env(f.name)
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{_HELP.get(f.name, f.name.replace('_', ' '))} (env {env}; default {f.default!r})"
        if f.name == "namespaces":
            default = os.environ.get(env)
            p.add_argument(flag, "--namespace", action="append", default=None, help=help_text)
            p.set_defaults(_namespaces_env=default)
            continue
        kind = type(f.default) if f.default is not None else str
        value = os.environ.get(env)
        try:
            default = kind(value) if value is not None else f.default
        except ValueError:
            raise SystemExit(f"{env}={value!r}: expected {kind.__name__}") from None
        p.add_argument(flag, type=kind, default=default, help=help_text)


def _config_from(args: argparse.Namespace) -> ServiceConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServiceConfig) if f.init and f.name != "namespaces"}
    if args.namespaces:
        values["namespaces"] = tuple(args.namespaces)
    elif args._namespaces_env:
        values["namespaces"] = args._namespaces_env
    return ServiceConfig(**values)


def _serve(args: argparse.Namespace) -> int:
    try:
        config = _config_from(args)
    except ValueError as e:
        print(f"ngram-corpus serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    from corpus_service.service import serve  # grpc/uvicorn are imported only for serving

    asyncio.run(serve(config))
    return 0


def _admin(args: argparse.Namespace):
    from corpus_service.admin_client import AdminClient

    return AdminClient(args.admin_url, args.token, tls_ca=args.tls_ca)


def _guess_format(path: Path) -> str:
    return {".jsonl": "jsonl", ".json": "jsonl", ".txt": "text", ".md": "text", ".ids": "ids"}.get(path.suffix, "text")


def _upload(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    path = Path(args.file)
    if not path.is_file():
        print(f"ngram-corpus upload: no file at {path}", file=sys.stderr)
        return 2
    fmt = args.format or _guess_format(path)
    with _admin(args) as admin:
        with tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=f"upload {args.name}",
                  disable=args.quiet) as bar:
            job = admin.upload(args.namespace, args.name, path, fmt, on_bytes=bar.update)
        if not args.wait:
            print(json.dumps(job))
            return 0
        with tqdm(total=job["bytes_total"], unit="B", unit_scale=True, desc=f"build {args.name}",
                  disable=args.quiet) as bar:
            def progress(j: dict) -> None:
                bar.update(j["bytes_done"] - bar.n)

            job = admin.wait_job(job["id"], on_progress=progress)
    print(json.dumps(job))
    return 0 if job["state"] == "done" else 1


def _ls(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        rows = admin.corpora(args.namespace)
    print(f"{'NAME':32} {'STATE':12} {'TOKENS':>12} SOURCE")
    for r in rows:
        print(f"{r['name']:32} {r['state']:12} {r['tokens']:>12} {r['source']}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        admin.delete(args.namespace, args.name)
    print(f"removed {args.namespace}/{args.name}")
    return 0


def _stats(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        print(json.dumps(admin.stats(), indent=2, sort_keys=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ngram-corpus", description="The shared n-gram draft corpus service.")
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the corpus (gRPC + REST admin)")
    _add_serve_flags(serve)
    serve.set_defaults(run=_serve)
    for name, run, help_text in (("upload", _upload, "upload an external corpus"), ("ls", _ls, "list corpora"),
                                 ("rm", _rm, "remove a corpus"), ("stats", _stats, "engine statistics")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--admin-url", default=os.environ.get(_env("admin_url"), "http://127.0.0.1:8080"),
                       help=f"REST admin base URL (env {_env('admin_url')})")
        p.add_argument("--token", default=os.environ.get(_env("admin_token")) or os.environ.get(_env("token")),
                       help=f"bearer token: the admin token or a client token (env {_env('admin_token')}, then {_env('token')})")
        p.add_argument("--tls-ca", default=os.environ.get(_env("tls_ca")),
                       help=f"PEM CA bundle to verify an https admin URL (env {_env('tls_ca')})")
        p.add_argument("--namespace", default=os.environ.get(_env("namespace"), "default"),
                       help=f"namespace (env {_env('namespace')})")
        p.set_defaults(run=run)
        if name == "upload":
            p.add_argument("file")
            p.add_argument("--name", required=True)
            p.add_argument("--format", choices=("jsonl", "text", "ids"), help="default: from the file extension")
            p.add_argument("--no-wait", dest="wait", action="store_false", help="return once the upload is acknowledged")
            p.add_argument("--quiet", action="store_true", help="no progress bars")
        elif name == "rm":
            p.add_argument("name")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "serve":
        import httpx

        from corpus_service.admin_client import AdminError

        try:
            return args.run(args)
        except AdminError as e:
            print(f"ngram-corpus {args.command}: {e}", file=sys.stderr)
            return 1
        except (OSError, httpx.TransportError) as e:  # connection refused and friends
            print(f"ngram-corpus {args.command}: cannot reach {args.admin_url}: {e}", file=sys.stderr)
            return 1
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
