"""kvfleet's router beside the proxies a team would otherwise put in front of its engines.

    .venv/bin/python bench/router_vs_peers.py [--rates 100,300] [--seconds 10] [--chunks 16]

One fake engine (bench/router_overhead.py's: answers at once, streams `--chunks` SSE frames and
a usage frame) behind, in turns, at each rate:

- direct: no proxy, the floor of the client and the engine themselves;
- nginx (Debian's `nginx-light`) as a plain reverse proxy: one worker, upstream keep-alive,
  no buffering: what a proxy that reads nothing costs;
- LiteLLM's proxy (`litellm[proxy]==1.91.1`, in `.venv-litellm`: see below) with a master key,
  one worker, no database (so no virtual keys or budgets: its cheapest configuration);
- kvfleet's router with a tenant key, a TenantQuota whose every limit is set (none binding)
  and the shared ledger in a real redis-server: every request takes the whole admission.

The same open-loop client (Poisson arrivals, streamed chat requests) runs against each in
turn; the proxies not being measured are stopped (SIGSTOP). Prints, per rate and proxy, the
time to the first byte p50/p99, what the proxy adds over direct, and its CPU per request (its
processes', from /proc); then kvfleet's added p50 and p99 as ratios of LiteLLM's and nginx's,
the targets of issue 47 (at most 0.5x LiteLLM's, at most 3x nginx's). Writes
`bench/out/router_vs_peers.png` (first-byte CDFs).

Set-up, once: `apt-get install nginx-light` and
`python3.11 -m venv .venv-litellm && .venv-litellm/bin/pip install 'litellm[proxy]==1.91.1'`
(its own virtualenv: its pins are not the project's). LiteLLM starts offline here with
`LITELLM_LOCAL_MODEL_COST_MAP=True`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import latency_plot
import router_overhead as ro
import yaml

ROOT = Path(__file__).resolve().parents[1]
LITELLM = ROOT / ".venv-litellm" / "bin" / "litellm"
MASTER_KEY = "sk-litellm-bench-0123456789abcdef"


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (nginx's worker, LiteLLM's uvicorn)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo += children.get(current, [])
    return out


def cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            total += ro.cpu_seconds(pid)
    return total


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def start_nginx(port: int, upstream: int, tmp: Path) -> subprocess.Popen[bytes]:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise SystemExit("nginx is not installed (Debian: apt-get install nginx-light)")
    for folder in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (tmp / folder).mkdir(exist_ok=True)
    conf = tmp / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body;
  proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fastcgi;
  uwsgi_temp_path {tmp}/uwsgi;
  scgi_temp_path {tmp}/scgi;
  upstream engine {{ server 127.0.0.1:{upstream}; keepalive 128; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://engine;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
""")
    return subprocess.Popen([nginx, "-c", str(conf), "-p", str(tmp)])


def start_litellm(port: int, upstream: int, tmp: Path) -> subprocess.Popen[bytes]:
    if not LITELLM.exists():
        raise SystemExit(f"{LITELLM} is missing: python3.11 -m venv .venv-litellm && "
                         ".venv-litellm/bin/pip install 'litellm[proxy]==1.91.1'")
    conf = tmp / "litellm.yaml"
    conf.write_text(yaml.safe_dump({
        "model_list": [{"model_name": "pool", "litellm_params": {
            "model": "openai/pool", "api_base": f"http://127.0.0.1:{upstream}/v1",
            "api_key": "unused"}}],
        "general_settings": {"master_key": MASTER_KEY},
        "litellm_settings": {"drop_params": True, "set_verbose": False}}))
    return subprocess.Popen(
        [str(LITELLM), "--config", str(conf), "--host", "127.0.0.1", "--port", str(port),
         "--num_workers", "1"],
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"},
        stdout=subprocess.DEVNULL, stderr=(tmp / "litellm.log").open("wb"))


def start_kvfleet(port: int, upstream: int, redis_url: str, tmp: Path
                  ) -> subprocess.Popen[bytes]:
    config = tmp / "router.yaml"
    config.write_text(yaml.safe_dump({
        "pools": [{"name": "pool", "status": {"servingRevision": ro.REVISION},
                   "endpoints": {ro.REVISION: [f"127.0.0.1:{upstream}"]}}],
        "tenants": [{"tenant": "bench", "keys": [ro.KEY], "quota": ro.QUOTA}]}))
    return subprocess.Popen(
        [sys.executable, "-m", "kvfleet", "router", "--config", str(config), "--port",
         str(port), "--metrics-port", str(ro.free_port()), "--log-level", "warning",
         "--redis", redis_url], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="100,300")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--chunks", type=int, default=16)
    args = parser.parse_args()
    up, redis_port = ro.free_port(), ro.free_port()
    ports = {"nginx": ro.free_port(), "litellm": ro.free_port(), "kvfleet": ro.free_port()}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with tempfile.TemporaryDirectory(prefix="kvfleet-peers-") as folder:
        tmp = Path(folder)
        try:
            _start(procs, args, tmp, up, redis_port, ports)
            _run(procs, args, up, ports)
        finally:
            for proc in procs.values():
                signal_all(tree(proc.pid), signal.SIGCONT)
                proc.terminate()
            for proc in procs.values():
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return 0


def _start(procs: dict[str, subprocess.Popen[bytes]], args: argparse.Namespace, tmp: Path,
           up: int, redis_port: int, ports: dict[str, int]) -> None:
    """Each process into `procs` as it starts (the caller stops those that did)."""
    procs["redis"] = ro.start_redis(redis_port, str(tmp))
    procs["upstream"] = subprocess.Popen(
        [sys.executable, str(ROOT / "bench/router_overhead.py"), "--upstream", str(up),
         "--chunks", str(args.chunks)])
    procs["nginx"] = start_nginx(ports["nginx"], up, tmp)
    procs["litellm"] = start_litellm(ports["litellm"], up, tmp)
    procs["kvfleet"] = start_kvfleet(ports["kvfleet"], up, f"redis://127.0.0.1:{redis_port}/0",
                                     tmp)


def _run(procs: dict[str, subprocess.Popen[bytes]], args: argparse.Namespace, up: int,
         ports: dict[str, int]) -> None:
    print("starting the proxies (LiteLLM takes a while) ...", flush=True)
    ro.wait_http(f"http://127.0.0.1:{up}/metrics")
    ro.wait_http(f"http://127.0.0.1:{ports['kvfleet']}/health")
    ro.wait_http(f"http://127.0.0.1:{ports['litellm']}/health/liveliness", timeout=180)
    time.sleep(1.0)
    urls = {"direct": up, **ports}
    auth = {"direct": {}, "nginx": {},
            "litellm": {"authorization": f"Bearer {MASTER_KEY}"},
            "kvfleet": {"authorization": f"Bearer {ro.KEY}"}}
    for name in ports:  # warm up (and fail here if a proxy does not answer)
        warm = asyncio.run(ro.load(_url(urls[name]), auth[name], 20, 1.0))
        if not warm or not any(first for first, _ in warm):
            raise SystemExit(f"{name} gave no streamed answer")
    results = {}
    for rate in [float(r) for r in args.rates.split(",")]:
        results[rate] = measure(urls, auth, rate, args.seconds, procs)
    plot(results)


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}/v1/chat/completions"


def measure(urls: dict[str, int], auth: dict[str, dict[str, str]], rate: float, seconds: float,
            procs: dict[str, subprocess.Popen[bytes]]
            ) -> dict[str, list[tuple[float, list[float]]]]:
    proxies = [n for n in urls if n != "direct"]
    runs, cpu = {}, {}
    for name, port in urls.items():
        paused = [pid for other in proxies if other != name for pid in tree(procs[other].pid)]
        signal_all(paused, signal.SIGSTOP)
        try:
            pids = tree(procs[name].pid) if name in procs else []
            before = cpu_of(pids)
            runs[name] = asyncio.run(ro.load(_url(port), auth[name], rate, seconds))
            cpu[name] = (cpu_of(pids) - before) / max(1, len(runs[name])) * 1e3
        finally:
            signal_all(paused, signal.SIGCONT)
    first = {n: [x[0] * 1e3 for x in r] for n, r in runs.items()}
    base = first["direct"]
    added = {n: (ro.pct(first[n], .5) - ro.pct(base, .5), ro.pct(first[n], .99) -
                 ro.pct(base, .99)) for n in proxies}
    print(f"{rate:5.0f}/s {'direct':>8} | first byte p50 / p99 ms {ro.pct(base, .5):6.2f} / "
          f"{ro.pct(base, .99):6.2f}", flush=True)
    for name in proxies:
        failed = sum(1 for x in runs[name] if not x[0])
        print(f"{rate:5.0f}/s {name:>8} | first byte p50 / p99 ms {ro.pct(first[name], .5):6.2f}"
              f" / {ro.pct(first[name], .99):6.2f} | added +{added[name][0]:6.2f} / "
              f"+{added[name][1]:6.2f} | CPU {cpu[name]:5.2f} ms/request"
              + (f" | {failed} without a byte" if failed else ""), flush=True)
    kv = added["kvfleet"]
    for peer, target in (("litellm", 0.5), ("nginx", 3.0)):
        p50, p99 = (kv[i] / added[peer][i] if added[peer][i] > 0 else float("inf")
                    for i in (0, 1))
        print(f"{rate:5.0f}/s kvfleet added ÷ {peer} added: p50 {p50:.2f}x, p99 {p99:.2f}x "
              f"(target <= {target:g}x)", flush=True)
    return runs


def plot(results: dict[float, dict[str, list[tuple[float, list[float]]]]]) -> None:
    styles = {"direct": ":", "nginx": "--", "litellm": "-.", "kvfleet": "-"}
    latency_plot.write_cdfs(
        [(f"{name} at {rate:.0f}/s", [x[0] * 1e3 for x in runs[name]], styles[name])
         for rate, runs in results.items() for name in styles],
        "time to first byte (ms, log)",
        "Streamed first byte: direct, nginx, LiteLLM, kvfleet's router (fake engine)",
        "router_vs_peers.png")


if __name__ == "__main__":
    raise SystemExit(main())
