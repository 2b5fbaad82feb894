"""Engine TLS (`--engine-tls`): the operator issues each pool a certificate for its name, keeps
it in the router-token Secret, mounts it into the engines, probes them over HTTPS, and renews
it before its end keeping the replaced one for the router's trust."""

from __future__ import annotations

import base64
from dataclasses import replace
from datetime import timedelta
from typing import Any

from cryptography import x509
from operator_fakes import NOW, artifact, as_observed, pool

from kvfleet.api.labels import engine_server_name
from kvfleet.compat import default_matrix
from kvfleet.operator.builders import EngineCertificate, EngineOptions
from kvfleet.operator.engine_tls import (
    RENEW_BEFORE,
    VALID_DAYS,
    issue_engine_certificate,
    wanted_certificate,
)
from kvfleet.operator.servingpool import Observed, Plan, reconcile

TLS = EngineOptions(tls=True)


class Issuer:
    def __init__(self) -> None:
        self.issued: list[str] = []

    def __call__(self, name: str) -> EngineCertificate:
        self.issued.append(name)
        return issue_engine_certificate(name)


def _run(observed: Observed, issuer: Issuer, **kw: Any) -> Plan:
    return reconcile(pool(), artifact(), observed, matrix=default_matrix(),
                     now=kw.pop("now", NOW), options=TLS, new_router_token="t" * 48,
                     new_engine_certificate=issuer, **kw)


def _secret_data(plan: Plan) -> dict[str, str]:
    secret = next(o for o in plan.apply if o["kind"] == "Secret")
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def test_engines_serve_https_with_the_pools_certificate_issued_once() -> None:
    issuer = Issuer()
    first = _run(Observed(), issuer)
    p = pool()
    name = engine_server_name(p.metadata.name, p.metadata.namespace or "")
    assert issuer.issued == [name]
    data = _secret_data(first)
    cert = x509.load_pem_x509_certificate(data["tls.crt"].encode())
    assert cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName) == [name]
    assert "PRIVATE KEY" in data["tls.key"] and "previous.crt" not in data
    deployment = next(o for o in first.apply if o["kind"] == "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    engine = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    mount = next(m for m in engine["volumeMounts"] if m["name"] == "router-token")
    assert env["KVFLEET_TLS_CERT_FILE"] == mount["mountPath"] + "/tls.crt"
    assert env["KVFLEET_TLS_KEY_FILE"] == mount["mountPath"] + "/tls.key"
    volume = next(v for v in spec["volumes"] if v["name"] == "router-token")
    assert [i["key"] for i in volume["secret"]["items"]] == ["token", "tls.crt", "tls.key"]
    assert engine["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert engine["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scheme"] == "https"
    # Converged: the Secret read back keeps its certificate; nothing new is issued.
    objs = {o["kind"]: as_observed(o) for o in first.apply}
    observed = Observed(deployments=(objs["Deployment"],),
                        service=objs["Service"], pdb=objs["PodDisruptionBudget"],
                        router_secret=objs["Secret"], network_policy=objs["NetworkPolicy"])
    again = _run(observed, issuer)
    assert again.apply == () and issuer.issued == [name]


def test_a_certificate_is_renewed_before_its_end_and_the_old_one_kept_for_the_router() -> None:
    issuer = Issuer()
    current = issue_engine_certificate("smol.llm.engines.kvfleet.io")
    kept = wanted_certificate(current, "smol.llm.engines.kvfleet.io", NOW, issuer)
    assert kept is current and issuer.issued == []
    end = x509.load_pem_x509_certificate(current.cert.encode()).not_valid_after_utc
    assert end - NOW > timedelta(days=VALID_DAYS - 7)
    due = end - RENEW_BEFORE + timedelta(hours=1)
    renewed = wanted_certificate(current, "smol.llm.engines.kvfleet.io", due, issuer)
    assert renewed.cert != current.cert and renewed.previous == current.cert
    # Issued for another name (the pool was recreated elsewhere): replaced, not trusted on.
    moved = wanted_certificate(current, "smol.other.engines.kvfleet.io", NOW, issuer)
    assert moved.previous == "" and len(issuer.issued) == 2
    broken = wanted_certificate(replace(current, cert="not a cert"), "x.y.engines.kvfleet.io",
                                NOW, issuer)
    assert broken.previous == ""
