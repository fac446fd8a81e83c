"""``ngram-corpus``: serve | upload FILE --name NAME | ls | rm NAME | stats | policy-version N.

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

from corpus_service.server.config import ENV_PREFIX, ServiceConfig

# Help of the serve flags whose ServiceConfig field carries none in its metadata
# (``field(metadata={"help": ...})``, which wins); every flag has one (tests/corpus_service/test_cli.py).
# Each says what the value means and which values are allowed ('%%' is a literal percent sign).
_HELP = {
    "host": "address to bind, an IP or host name (beyond loopback an admin token is required)",
    "grpc_port": "gRPC port, int in [0, 65535] (0 = ephemeral, reported in the log and --ports-file)",
    "admin_port": "REST admin port, int in [-1, 65535] (0 = ephemeral, -1 = no REST admin)",
    "data_dir": "directory for snapshots and acknowledged uploads (created if missing; one server per directory); "
                "unset = $XDG_DATA_HOME/ngram-corpus or ~/.local/share/ngram-corpus; '' = nothing persists "
                "(warned at start)",
    "admin_token": "bearer token of at least 16 characters for the admin actions: REST writes, gRPC Reset and "
                   "external corpora; required beyond loopback (prefer the environment: flags show in ps)",
    "namespaces": "NAME[:key=value,...], repeatable (env: ';'-separated); NAME: 1-64 letters, digits, '_', '.', "
                  "'-'; keys: tokenizer (smollm2, a tokenizer.json or a .gguf path), vocab, or any CorpusConfig "
                  "field, e.g. smollm2:vocab=49152,tokenizer=smollm2",
    "max_batch": "requests per draft, BatchGet, BatchPut or step, int in [1, 2**20]",
    "max_budget": "draft nodes per tree, int in [1, 1024]",
    "max_tokens_per_message": "tokens in one message, int in [1, 2**30]; beyond, RESOURCE_EXHAUSTED",
    "max_message_bytes": "gRPC receive limit in bytes, int in [1024, 2**31-1]",
    "max_live_requests_per_session": "live requests one Session stream may hold, int in [1, 2**24]",
    "max_upload_bytes": "size of one REST upload in bytes, int in [1, 2**50]; beyond, 413",
    "snapshot_interval_s": "seconds between snapshots, number >= 0 (0 = only at shutdown and POST /v1/snapshot)",
    "drain_timeout_s": "seconds open streams may finish after SIGTERM before the snapshot, number >= 0",
    "worker_threads": "threads running engine calls, int in [0, 1024] (0 = one per CPU, at least 2)",
    "inline_work": "steps drafting at most this many nodes run on the event loop itself, int in [0, 2**20]",
    "ports_file": "file written with {\"grpc_port\", \"admin_port\", \"pid\"} (JSON) once both ports are bound",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "client_tokens": "JSON file of client tokens {\"clients\": [{name, token | token_sha256, namespaces, role: "
                     "read | draft | admin}]}; set = every gRPC call, /v1 route and /metrics needs a token",
    "tls_cert": "PEM certificate chain: gRPC and the admin serve TLS on their ports (needs --tls-key)",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM CA: clients must present a certificate it signed (mutual TLS, both ports)",
    "admin_rate_per_s": "mutating admin calls (REST and gRPC) per caller and second, number >= 0 (0 = no limit)",
    "admin_rate_burst": "burst of mutating admin calls per caller, int in [1, 2**30]",
    "put_rate_per_s": "BatchPut calls per caller and second, number >= 0 (0 = no limit)",
    "put_rate_burst": "burst of BatchPut calls per caller, int in [1, 2**30]",
}


def _env(name: str) -> str:
    return ENV_PREFIX + name.upper()


def flag_help(f: dataclasses.Field) -> str:
    """The help of a serve flag: its field's ``metadata["help"]`` first, else ``_HELP``; "" if neither."""
    return f.metadata.get("help") or _HELP.get(f.name, "")


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(ServiceConfig):
        if not f.init:
            continue
        env = _env(f.name)
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{flag_help(f)} (env {env}; default {f.default!r})"
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
    # Replicas fork their snapshot writers (replication/snapshots.py); the child never touches gRPC,
    # so gRPC's own fork handlers (which would pause its threads around every fork) stay off. gRPC
    # reads this when it is first imported (the config's validation may import it), hence first.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    try:
        config = _config_from(args)
    except ValueError as e:
        print(f"ngram-corpus serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    from corpus_service.admin.persistence import DataDirInUse
    from corpus_service.server.main import serve  # grpc/uvicorn are imported only for serving

    try:
        asyncio.run(serve(config))
    except DataDirInUse as e:
        print(f"ngram-corpus serve: {e}", file=sys.stderr)
        return 1
    return 0


def _admin(args: argparse.Namespace):
    from corpus_service.admin.client import AdminClient

    return AdminClient(args.admin_url, args.token, tls_ca=args.tls_ca)


def _guess_format(path: Path) -> str:
    return {".jsonl": "jsonl", ".json": "jsonl", ".txt": "text", ".md": "text", ".ids": "ids"}.get(path.suffix, "text")


def _upload(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from corpus_service.names import check_corpus_name, check_namespace_name

    path = Path(args.file)
    if not path.is_file():
        print(f"ngram-corpus upload: no file at {path}", file=sys.stderr)
        return 2
    try:  # the server's name rule, before anything is sent
        check_namespace_name(args.namespace)
        check_corpus_name(args.name)
    except ValueError as e:
        print(f"ngram-corpus upload: {e}", file=sys.stderr)
        return 2
    fmt = args.format or _guess_format(path)
    with _admin(args) as admin:
        # The token, namespace, name, format and size are checked by the server before the file
        # is streamed: a refusal costs one small request, not the whole upload.
        admin.check_upload(args.namespace, args.name, fmt, replace=args.replace, size=path.stat().st_size)
        with tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=f"upload {args.name}",
                  disable=args.quiet) as bar:
            job = admin.upload(args.namespace, args.name, path, fmt, on_bytes=bar.update, replace=args.replace)
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


def _corpus_row(r: dict) -> str:
    problem = f"  {r['error']}" if r["state"] in ("failed", "damaged") and r.get("error") else ""
    return f"{r['name']:32} {r['state']:12} {r['tokens']:>12} {r['source']}{problem}"


def _ls(args: argparse.Namespace) -> int:
    """One namespace's corpora with --namespace; else every namespace the token may read, each
    with its corpora (a namespace without any is listed too)."""
    with _admin(args) as admin:
        if args.namespace is not None:
            rows = admin.corpora(args.namespace)
            print(f"{'NAME':32} {'STATE':12} {'TOKENS':>12} SOURCE")
            for r in rows:
                print(_corpus_row(r))
            return 0
        listing = [(ns["name"], admin.corpora(ns["name"])) for ns in admin.namespaces()]
    print(f"{'NAMESPACE':24} {'NAME':32} {'STATE':12} {'TOKENS':>12} SOURCE")
    for ns, rows in listing:
        if not rows:
            print(f"{ns:24} {'(no corpora)':32}")
        for r in rows:
            print(f"{ns:24} {_corpus_row(r)}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    """Removes NAME from --namespace; without one, from the namespace that holds it (of those the
    token may read), refusing a name that several hold (it names them: --namespace says which)."""
    from corpus_service.names import check_corpus_name

    try:
        check_corpus_name(args.name)
    except ValueError as e:
        print(f"ngram-corpus rm: {e}", file=sys.stderr)
        return 2
    with _admin(args) as admin:
        namespace = args.namespace
        if namespace is None:
            names = [ns["name"] for ns in admin.namespaces()]
            holders = [ns for ns in names if any(c["name"] == args.name for c in admin.corpora(ns))]
            if len(holders) != 1:
                why = (f"corpus '{args.name}' is in namespaces {', '.join(holders)}: say which with --namespace"
                       if holders else f"no corpus '{args.name}' in any namespace ({', '.join(names) or 'none'})")
                print(f"ngram-corpus rm: {why}", file=sys.stderr)
                return 1
            namespace = holders[0]
        admin.delete(namespace, args.name)
    print(f"removed {namespace}/{args.name}")
    return 0


def _stats(args: argparse.Namespace) -> int:
    """Engine statistics (counters as integers) of every namespace, or of --namespace."""
    with _admin(args) as admin:
        stats = admin.stats() if args.namespace is None else {args.namespace: admin.namespace(args.namespace)["stats"]}
    print(json.dumps(stats, indent=2, sort_keys=True))
    return 0


def _policy_version(args: argparse.Namespace) -> int:
    """Announces that the policy's weights changed: the namespace's version moves forward."""
    from corpus_service.names import check_namespace_name

    try:
        check_namespace_name(args.namespace)
    except ValueError as e:
        print(f"ngram-corpus policy-version: {e}", file=sys.stderr)
        return 2
    with _admin(args) as admin:
        version = admin.announce_policy_version(args.namespace, args.version)
    print(json.dumps({"namespace": args.namespace, "policy_version": version}))
    return 0


def _non_negative(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative int, got {text!r}") from None
    if not 0 <= v < 1 << 62:
        raise argparse.ArgumentTypeError(f"expected an int in [0, 2**62), got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ngram-corpus", description="The shared n-gram draft corpus service.")
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the corpus (gRPC + REST admin)")
    _add_serve_flags(serve)
    serve.set_defaults(run=_serve)
    for name, run, help_text in (("upload", _upload, "upload an external corpus"), ("ls", _ls, "list corpora"),
                                 ("rm", _rm, "remove a corpus"), ("stats", _stats, "engine statistics"),
                                 ("policy-version", _policy_version, "announce that the policy's weights changed "
                                  "(an RL step): the namespace's policy version moves forward")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--admin-url", default=os.environ.get(_env("admin_url"), "http://127.0.0.1:8080"),
                       help=f"REST admin base URL (env {_env('admin_url')})")
        p.add_argument("--token", default=os.environ.get(_env("admin_token")) or os.environ.get(_env("token")),
                       help=f"bearer token: the admin token or a client token (env {_env('admin_token')}, then {_env('token')})")
        p.add_argument("--tls-ca", default=os.environ.get(_env("tls_ca")),
                       help=f"PEM CA bundle to verify an https admin URL (env {_env('tls_ca')})")
        if name in ("ls", "stats"):  # without one, every namespace
            p.add_argument("--namespace", default=os.environ.get(_env("namespace")),
                           help=f"this namespace only (env {_env('namespace')}); default: every namespace the "
                                "token may read")
        elif name == "rm":  # without one, the namespace holding the name
            p.add_argument("--namespace", default=os.environ.get(_env("namespace")),
                           help=f"the corpus' namespace (env {_env('namespace')}); default: the one namespace "
                                "that holds a corpus of this name (several: refused, naming them)")
        else:
            p.add_argument("--namespace", default=os.environ.get(_env("namespace"), "default"),
                           help=f"namespace: 1-64 letters, digits, '_', '.', '-' (env {_env('namespace')}; default "
                                "'default')")
        p.set_defaults(run=run)
        if name == "upload":
            p.add_argument("file", help="the file to upload: JSONL ({\"text\": ...} or {\"ids\": [...]} lines), "
                                        "UTF-8 text (documents separated by blank lines), or lines of token ids")
            p.add_argument("--name", required=True,
                           help="corpus name: 1-64 letters, digits, '_', '.', '-', not starting with a symbol")
            p.add_argument("--format", choices=("jsonl", "text", "ids"),
                           help="jsonl, text or ids; default: from the file extension (.jsonl/.json, .txt/.md, .ids; "
                                "else text)")
            p.add_argument("--replace", action="store_true",
                           help="replace an existing corpus of this name atomically (drafts use the old one until "
                                "the new one is built); without it an existing name is refused")
            p.add_argument("--no-wait", dest="wait", action="store_false", help="return once the upload is acknowledged")
            p.add_argument("--quiet", action="store_true", help="no progress bars")
        elif name == "rm":
            p.add_argument("name", help="the corpus to remove (whatever loaded it: upload or gRPC; damaged ones too)")
        elif name == "policy-version":
            p.add_argument("version", type=_non_negative,
                           help="the new policy version, an int in [0, 2**62), not older than the current one; "
                                "prompt history the namespace's history_max_age versions older is dropped")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "serve":
        import httpx

        from corpus_service.admin.client import AdminError

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
