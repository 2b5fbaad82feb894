"""`kvfleet check FILE...`: the admission webhook's verdict, offline.

Every object in the files is checked as if created, with the same rules as the webhook;
references (a pool's artifact, a rollout's pool) are looked up among the same
files. Prints one line per problem; exits 1 if any object would be refused.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from kvfleet.api import DocumentError, load_yaml_documents
from kvfleet.compat import MatrixError, default_matrix, load_matrix
from kvfleet.webhooks.admission import admit


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "check", help="validate kvfleet objects as the webhook would", description=__doc__
    )
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE")
    parser.add_argument("--matrix", type=Path, help="compatibility matrix (default: bundled)")
    parser.set_defaults(func=_check)


def _key(doc: dict[str, Any]) -> tuple[str, str, str]:
    meta = doc.get("metadata") or {}
    return (str(doc.get("kind")), str(meta.get("namespace") or "default"), str(meta.get("name")))


def _check(args: argparse.Namespace) -> int:
    try:
        matrix = load_matrix(args.matrix) if args.matrix else default_matrix()
    except MatrixError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    documents: list[tuple[str, dict[str, Any]]] = []
    failed = False
    for path in args.files:
        try:
            text = path.read_text(encoding="utf-8")
            documents += [(str(path), d) for d in load_yaml_documents(text, str(path))]
        except (OSError, DocumentError) as error:
            print(f"error: {error}", file=sys.stderr)
            failed = True
    store = {_key(doc): doc for _, doc in documents}

    async def fetch(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return store.get((kind, namespace, name))

    for source, doc in documents:
        kind, namespace, name = _key(doc)
        decision = asyncio.run(
            admit(kind, doc, None, fetch=fetch, matrix=matrix, namespace=namespace)
        )
        where = f"{source}: {kind} {namespace}/{name}"
        for warning in decision.warnings:
            print(f"{where}: warning: {warning}")
        for problem in decision.errors:
            print(f"{where}: {problem}")
            if problem.rule == "reference":
                print(f"{where}: hint: pass the file that defines it too")
        if decision.allowed:
            print(f"{where}: ok")
        failed = failed or not decision.allowed
    print(f"(compatibility matrix {matrix.version})")
    return 1 if failed else 0
