"""The local pod runner's kubelet log endpoint (what `kubectl logs` reaches through the
apiserver) and the pod logs a dev cluster keeps after teardown."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from kvfleet.devcluster.cluster import keep_pod_logs
from kvfleet.devcluster.kubeletlogs import KubeletLogServer


def test_container_logs_whole_tail_limit_and_follow(tmp_path: Path) -> None:
    log = tmp_path / "ns_web" / "web.log"
    log.parent.mkdir()
    log.write_bytes(b"one\ntwo\nthree\n")
    alive = threading.Event()
    alive.set()
    server = KubeletLogServer(tmp_path / "kubelet",
                              lambda ns, pod, c: tmp_path / f"{ns}_{pod}" / f"{c}.log",
                              lambda ns, pod: alive.is_set())
    server.start()
    base = f"https://127.0.0.1:{server.port}/containerLogs/ns/web/web"
    try:
        with httpx.Client(verify=False, timeout=10) as client:  # as the apiserver: unverified
            assert client.get(base).text == "one\ntwo\nthree\n"
            assert client.get(base, params={"tailLines": "2"}).text == "two\nthree\n"
            assert client.get(base, params={"limitBytes": "5"}).text == "one\nt"
            missing = client.get(f"https://127.0.0.1:{server.port}/containerLogs/ns/web/other")
            assert missing.status_code == 404 and "no log for container other" in missing.text

            def grow_then_end() -> None:
                time.sleep(0.3)
                with log.open("ab") as stream:
                    stream.write(b"four\n")
                time.sleep(0.5)
                alive.clear()  # the pod is gone: the follow ends

            threading.Thread(target=grow_then_end, daemon=True).start()
            with client.stream("GET", base, params={"follow": "true"}) as followed:
                assert followed.read() == b"one\ntwo\nthree\nfour\n"
    finally:
        server.stop()
    key = tmp_path / "kubelet" / "kubelet.key"
    assert key.stat().st_mode & 0o077 == 0


def test_pod_logs_outlive_the_workdir_and_only_the_last_runs_are_kept(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    for run in range(4):
        pods = tmp_path / f"workdir-{run}" / "pods"
        (pods / "ns_web").mkdir(parents=True)
        (pods / "ns_web" / "web.log").write_text(f"run {run}\n")
        target = keep_pod_logs(pods, into=kept, runs=3)
        assert target is not None and (target / "ns_web" / "web.log").read_text() == f"run {run}\n"
        time.sleep(1.05)  # one folder a second (their names are timestamps)
    assert len(list(kept.iterdir())) == 3
    assert keep_pod_logs(tmp_path / "empty" / "pods", into=kept) is None
