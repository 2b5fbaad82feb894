"""`kvfleet webhook serve|certs|config`: the validating admission webhook.

serve   HTTPS AdmissionReview v1 server; reads referenced objects from the apiserver
        (--kubeconfig, $KUBECONFIG or the in-cluster service account)
certs   write a CA and a serving certificate for the given hosts
config  print the ValidatingWebhookConfiguration (failure policy: see kvfleet/webhooks/config.py)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from kvfleet.compat import MatrixError, default_matrix, load_matrix
from kvfleet.kube.credentials import Credentials, CredentialsError
from kvfleet.pki import PkiError
from kvfleet.tls import ServingCertificate
from kvfleet.webhooks.certs import make_serving_certs
from kvfleet.webhooks.config import build_validating_webhook_configuration
from kvfleet.webhooks.kube import ObjectReader
from kvfleet.webhooks.server import VALIDATE_PATH, make_app, start


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "webhook",
        help="validating admission webhook",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="webhook_command", metavar="ACTION", required=True)
    serve = sub.add_parser("serve", help="serve AdmissionReview v1 over HTTPS")
    serve.add_argument("--host", default="127.0.0.1",
                       help="listen address (in a pod: its IP, as the chart passes $(POD_IP))")
    serve.add_argument("--port", type=int, default=9443)
    serve.add_argument("--cert", type=Path, required=True, help="serving certificate (PEM)")
    serve.add_argument("--key", type=Path, required=True, help="its private key (PEM)")
    serve.add_argument("--kubeconfig", type=Path, help="default: $KUBECONFIG, else in-cluster")
    serve.add_argument("--matrix", type=Path, help="compatibility matrix (default: bundled)")
    serve.set_defaults(func=_serve)
    certs = sub.add_parser("certs", help="write ca.crt, tls.crt, tls.key")
    certs.add_argument("--dir", type=Path, required=True)
    certs.add_argument(
        "--host",
        action="append",
        required=True,
        help="DNS name or IP the apiserver uses (repeatable)",
    )
    certs.add_argument("--days", type=int, default=365)
    certs.set_defaults(func=_certs)
    config = sub.add_parser("config", help="print the ValidatingWebhookConfiguration")
    config.add_argument("--ca", type=Path, required=True, help="CA that signed the serving cert")
    where = config.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help=f"e.g. https://127.0.0.1:9443{VALIDATE_PATH}")
    where.add_argument("--service", help="NAMESPACE/NAME:PORT of the in-cluster Service")
    config.add_argument("--failure-policy", choices=["Fail", "Ignore"], default="Fail")
    config.add_argument("--timeout-seconds", type=int, default=5)
    config.set_defaults(func=_config)


async def _run(args: argparse.Namespace) -> None:
    matrix = load_matrix(args.matrix) if args.matrix else default_matrix()
    reader = ObjectReader(Credentials(args.kubeconfig))
    app = make_app(fetch=reader.get, matrix=matrix, list_objects=reader.list)
    certificate = ServingCertificate(args.cert, args.key)
    runner = await start(app, args.host, args.port, certificate.context)
    reloading = asyncio.create_task(certificate.watch(), name="certificate-reload")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(
        f"serving https://{args.host}:{args.port}{VALIDATE_PATH} "
        f"(compatibility matrix {matrix.version})",
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        reloading.cancel()
        await runner.cleanup()
        await reader.close()


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        asyncio.run(_run(args))
    except (MatrixError, CredentialsError, OSError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def _certs(args: argparse.Namespace) -> int:
    try:
        files = make_serving_certs(args.dir, args.host, days=args.days)
    except (PkiError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{files.ca_cert}\n{files.cert}\n{files.key}")
    return 0


def _config(args: argparse.Namespace) -> int:
    service = None
    if args.service:
        namespace, _, rest = args.service.partition("/")
        name, _, port = rest.partition(":")
        if not (namespace and name and port.isdigit()):
            print("error: --service must be NAMESPACE/NAME:PORT", file=sys.stderr)
            return 2
        service = (namespace, name, int(port))
    vwc = build_validating_webhook_configuration(
        ca_bundle_pem=args.ca.read_bytes(),
        url=args.url,
        service=service,
        failure_policy=args.failure_policy,
        timeout_seconds=args.timeout_seconds,
    )
    sys.stdout.write(yaml.safe_dump(vwc, sort_keys=False))
    return 0
