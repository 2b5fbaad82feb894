"""`kvfleet serve`: the OpenAI-compatible engine server (what every GPU pod runs).

`kvfleet serve` with no arguments serves the embedded SmolLM2-135M-Instruct on
127.0.0.1:8000. Engine flags use vLLM's names where vLLM has the same knob.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl
import sys
from pathlib import Path
from typing import Any

from kvfleet.engine.admission import AdmissionLimits
from kvfleet.engine.config import MIB, SchedulingPolicy
from kvfleet.engine.faults import FAULTS_ENV, faults_for
from kvfleet.engine.protocol import SAMPLING_DEFAULTS_ENV, SamplingDefaults
from kvfleet.engine.request_log import configure_json_logging
from kvfleet.engine.router_token import MIN_LENGTH, RouterTokens
from kvfleet.engine.runtime import RuntimeOptions, run_server
from kvfleet.engine.server import ServerSettings
from kvfleet.tls import ServingCertificate


def _csv(value: str) -> frozenset[str]:
    return frozenset(part.strip() for part in value.split(",") if part.strip())


def _weights(value: str) -> dict[str, float]:
    weights: dict[str, float] = {}
    for item in _csv(value):
        tenant, sep, weight = item.partition("=")
        try:
            weights[tenant] = float(weight)
        except ValueError:
            sep = ""
        if not sep or not tenant:
            raise argparse.ArgumentTypeError(
                f"--tenant-weights: {item!r} is not TENANT=WEIGHT (e.g. a=2,b=1)")
    return weights


def _positive_int(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def _prefill_cap(value: str) -> int | None:
    """--max-prefill-tokens-per-step: a positive count, 0 for no cap, or auto (None)."""
    if value.strip().lower() == "auto":
        return None
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be auto, 0 (no cap) or a positive integer, "
                                         f"got {value!r}")
    return number


def _sha256_list(value: str) -> tuple[str, ...]:
    digests = tuple(part.strip().lower() for part in value.split(",") if part.strip())
    for digest in digests:
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise argparse.ArgumentTypeError(
                f"expected 64 hex characters per sha256, got {digest!r}")
    return digests


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="serve a model over the OpenAI-compatible HTTP API",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None,
                   help="a .gguf file or HF Llama checkpoint dir (default: embedded SmolLM2)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the file/dir name)")
    p.add_argument("--revision", default=os.environ.get("KVFLEET_MANIFEST_HASH"),
                   help="the model revision to report (default: $KVFLEET_MANIFEST_HASH, set by "
                        "the operator to the artifact's manifest hash, else the weights' sha256)")
    p.add_argument("--expected-sha256", type=_sha256_list,
                   default=_sha256_list(os.environ.get("KVFLEET_EXPECTED_SHA256", "")),
                   help="comma-separated sha256 of the weight files (default: "
                        "$KVFLEET_EXPECTED_SHA256, set by the operator from the ModelArtifact); "
                        "the server refuses to start on any difference")
    p.add_argument("--expected-tokenizer-sha256",
                   default=os.environ.get("KVFLEET_EXPECTED_TOKENIZER_SHA256") or None,
                   help="the tokenizer's sha256 as the ModelArtifact records it (default: "
                        "$KVFLEET_EXPECTED_TOKENIZER_SHA256, set by the operator)")
    p.add_argument("--expected-chat-template-sha256",
                   default=os.environ.get("KVFLEET_EXPECTED_CHAT_TEMPLATE_SHA256") or None,
                   help="the chat template's sha256 (default: "
                        "$KVFLEET_EXPECTED_CHAT_TEMPLATE_SHA256, set by the operator)")
    tenancy = p.add_argument_group("tenancy")
    tenancy.add_argument("--tenant-header", default="x-kvfleet-tenant",
                         help="trusted header carrying the tenant (set by the kvfleet router)")
    tenancy.add_argument("--default-tenant", default="default")
    tenancy.add_argument("--router-token-file", default=os.environ.get("KVFLEET_ROUTER_TOKEN_FILE"),
                         metavar="PATH",
                         help="serve only requests carrying this token (the kvfleet router's "
                              "proof that it authenticated the tenant); default: "
                              "$KVFLEET_ROUTER_TOKEN_FILE, else the token in "
                              "$KVFLEET_ROUTER_TOKEN (what the operator sets), else trust the "
                              "tenant header")
    tenancy.add_argument("--tls-cert-file", type=Path, metavar="PATH",
                         default=os.environ.get("KVFLEET_TLS_CERT_FILE") or None,
                         help="serve HTTPS with this certificate (PEM), reloaded when it "
                              "changes; with --tls-key-file (default: $KVFLEET_TLS_CERT_FILE)")
    tenancy.add_argument("--tls-key-file", type=Path, metavar="PATH",
                         default=os.environ.get("KVFLEET_TLS_KEY_FILE") or None,
                         help="its private key (default: $KVFLEET_TLS_KEY_FILE)")
    tenancy.add_argument("--shared-prefix-tenants", type=_csv, default=frozenset(),
                         help="comma-separated tenants that share one prefix-cache scope")
    tenancy.add_argument("--tenant-weights", type=_weights, default={},
                         help="fair-share weights, e.g. a=2,b=1 (others weigh 1)")
    tenancy.add_argument("--max-in-flight", type=_positive_int, default=512,
                         help="admitted unfinished requests before 429 queue_full")
    tenancy.add_argument("--max-in-flight-per-tenant", type=_positive_int, default=256,
                         help="per tenant, before 429 tenant_concurrency_exceeded")
    engine = p.add_argument_group("engine")
    engine.add_argument("--block-size", type=_positive_int, default=16)
    engine.add_argument("--num-kv-blocks", type=_positive_int, default=None,
                        help="KV pool size in blocks (default: from --kv-cache-memory-mib)")
    engine.add_argument("--kv-cache-memory-mib", type=_positive_int, default=None,
                        help="KV pool size in MiB (default: what the device has left after "
                             "the weights: free GPU memory, or the cgroup memory limit on "
                             "the CPU; 512 without a limit)")
    engine.add_argument("--device", default=os.environ.get("KVFLEET_DEVICE", "auto"),
                        help="auto (the first GPU when one is visible), cpu, cuda or cuda:N")
    engine.add_argument("--cpu-threads", type=_positive_int, default=None,
                        help="threads of a step's CPU work (default: $OMP_NUM_THREADS, else "
                             "$KVFLEET_CPU_THREADS, which the operator sets from requests.cpu, "
                             "else the cores this process may run on capped by the cgroup CPU "
                             "quota, i.e. a pod's limits.cpu)")
    engine.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and activations (auto: float32 on the CPU, the "
                             "checkpoint's 16-bit dtype or bfloat16 on a GPU)")
    engine.add_argument("--kv-cache-dtype", default=os.environ.get("KVFLEET_KV_CACHE_DTYPE",
                                                                    "auto"),
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="the KV cache (auto: the weights' dtype; 16 bits halve the KV "
                             "memory and the bytes a decode step reads)")
    engine.add_argument("--max-model-len", type=_positive_int, default=None,
                        help="serve at most this context (default: the model's)")
    engine.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048)
    engine.add_argument("--max-num-seqs", type=_positive_int, default=64,
                        help="requests running at once")
    engine.add_argument("--long-prefill-token-threshold", type=_positive_int, default=512)
    engine.add_argument("--max-prefill-tokens-per-step", type=_prefill_cap,
                        default=os.environ.get("KVFLEET_MAX_PREFILL_TOKENS_PER_STEP", "auto"),
                        help="prompt tokens of one step's prefill chunks together; a step's "
                             "first chunk always runs. A low cap spreads a burst of arrivals "
                             "over steps, so requests stop starting and finishing in waves "
                             "(auto: 64 on the CPU, no cap on a GPU; 0: no cap)")
    engine.add_argument("--scheduling-policy", choices=[x.value for x in SchedulingPolicy],
                        default=SchedulingPolicy.PRIORITY.value)
    engine.add_argument("--priority-aging-seconds", type=float, default=10.0,
                        help="waiting this long raises a request one priority level")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True)
    engine.add_argument("--batch-invariant", action="store_true",
                        help="a request's output does not depend on what it is batched with "
                             "(pads small steps: about 2x the step time with 1-2 running)")
    engine.add_argument("--int8-activations", action="store_true",
                        default=os.environ.get("KVFLEET_INT8_ACTIVATIONS", "") == "1",
                        help="decode steps of 1-2 running requests round the 4-bit layer "
                             "matmuls' input to 8 bits per 32 values, as llama.cpp does: "
                             "faster on the CPU, not HF-exact (see bench/README.md); "
                             "default $KVFLEET_INT8_ACTIVATIONS=1, which the operator sets "
                             "from a pool's engine.int8Activations")
    engine.add_argument("--int16-activations", action="store_true",
                        default=os.environ.get("KVFLEET_INT16_ACTIVATIONS", "") == "1",
                        help="the 4-bit weight matmuls round their input to 16 bits per 32 "
                             "values and sum in integers: 1.1-1.9x faster matmuls where the "
                             "CPU has AVX-512 VNNI, logits within ~7e-3 of HF's (see "
                             "bench/README.md); default "
                             "$KVFLEET_INT16_ACTIVATIONS=1, which the operator sets from a "
                             "pool's engine.int16Activations")
    http = p.add_argument_group("http")
    http.add_argument("--max-body-bytes", type=_positive_int, default=4 * MIB)
    http.add_argument("--default-max-tokens", type=_positive_int, default=1024,
                      help="chat requests without max_tokens (capped by the context)")
    http.add_argument("--sampling-defaults", metavar="JSON",
                      default=os.environ.get(SAMPLING_DEFAULTS_ENV) or None,
                      help="the model's sampling defaults for fields a request leaves unset, "
                           'e.g. \'{"temperature": 0.7, "topK": 20, "maxTokens": 512}\' (a '
                           "ModelArtifact's spec.samplingDefaults, which the operator passes "
                           f"as ${SAMPLING_DEFAULTS_ENV})")
    http.add_argument("--drain-grace-seconds", type=float, default=30.0,
                      help="on SIGTERM, time in-flight requests get before being cancelled")
    http.add_argument("--stall-seconds", type=float, default=60.0,
                      help="with requests in flight and no engine step finished for this "
                           "long, the engine is failed: /health and /ready answer 503 with the "
                           "reason and its streams end with an error")
    logs = p.add_argument_group("logging")
    logs.add_argument("--log-level", default="info",
                      choices=["debug", "info", "warning", "error"])
    logs.add_argument("--log-text", action="store_true",
                      help="DEBUG ONLY: include prompt and output text in request logs")
    p.set_defaults(func=run)


def _router_token(path: str | None) -> RouterTokens | None:
    """The router tokens from --router-token-file (re-read when it changes), else the one in
    $KVFLEET_ROUTER_TOKEN, else None (the tenant header is trusted)."""
    if path:
        try:
            return RouterTokens.from_file(Path(path))
        except OSError as exc:
            raise OSError(f"--router-token-file {path}: {exc.strerror}") from None
    token = os.environ.get("KVFLEET_ROUTER_TOKEN", "").strip()
    if not token:
        return None
    if len(token) < MIN_LENGTH:
        raise ValueError(f"$KVFLEET_ROUTER_TOKEN: the router token needs at least "
                         f"{MIN_LENGTH} characters")
    return RouterTokens(token)


def run(args: argparse.Namespace) -> int:
    configure_json_logging(getattr(logging, args.log_level.upper()))
    from kvfleet.engine.serving_core import build_loader  # imports torch: only when serving

    try:
        router_token = _router_token(args.router_token_file)
    except (OSError, ValueError) as exc:
        print(f"kvfleet serve: {exc}", file=sys.stderr)
        return 2
    try:
        faults = faults_for(os.environ.get(FAULTS_ENV, ""), args.revision)
    except ValueError as exc:
        print(f"kvfleet serve: {exc}", file=sys.stderr)
        return 2
    if faults.active:
        logging.getLogger("kvfleet.serve").warning(
            "revision %s runs with injected faults from $%s: %s", args.revision, FAULTS_ENV,
            faults)
    try:
        defaults = None if not args.sampling_defaults else \
            SamplingDefaults.model_validate_json(args.sampling_defaults)
    except ValueError as exc:
        print(f"kvfleet serve: --sampling-defaults (or ${SAMPLING_DEFAULTS_ENV}): {exc}",
              file=sys.stderr)
        return 2
    settings = ServerSettings(
        faults=faults, sampling_defaults=defaults,
        router_token=router_token,
        tenant_header=args.tenant_header.lower(), default_tenant=args.default_tenant,
        shared_prefix_tenants=args.shared_prefix_tenants, max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens)
    limits = AdmissionLimits(max_in_flight=args.max_in_flight,
                             max_in_flight_per_tenant=args.max_in_flight_per_tenant)
    load = build_loader(args, limits)
    if (args.tls_cert_file is None) != (args.tls_key_file is None):
        print("kvfleet serve: --tls-cert-file and --tls-key-file go together", file=sys.stderr)
        return 2
    tls = None
    if args.tls_cert_file is not None:
        tls = (args.tls_cert_file, args.tls_key_file)
        try:
            ServingCertificate(*tls)  # unreadable or mismatched: say so now, not at the listener
        except (OSError, ssl.SSLError) as exc:
            print(f"kvfleet serve: --tls-cert-file {args.tls_cert_file} / --tls-key-file "
                  f"{args.tls_key_file}: {exc}", file=sys.stderr)
            return 2
    options = RuntimeOptions(host=args.host, port=args.port,
                             grace_seconds=args.drain_grace_seconds,
                             stall_seconds=args.stall_seconds, settings=settings, tls=tls)
    return asyncio.run(run_server(load, options))
