"""`kvfleet artifact fetch` against real servers on loopback: an HTTP server that honours
ranges and can cut a transfer mid-file, stall or lie about a file, and moto's S3 API server
with a bucket the test fills. Every failure is a clear error and leaves no partial file."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvfleet.engine.fetch import Cache, FetchError, FileSpec, fetch

pytestmark = pytest.mark.slow


@dataclass
class Behaviour:
    body: bytes
    cut_after: int | None = None  # the first response stops after this many bytes
    delay_s: float = 0.0  # before each chunk
    chunk: int = 64 * 1024


@dataclass
class FileServer:
    files: dict[str, Behaviour] = field(default_factory=dict)
    requests: list[tuple[str, str | None]] = field(default_factory=list)
    port: int = 0

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/models/{name}"

    def gets(self, name: str) -> list[str | None]:
        return [r for p, r in self.requests if p == f"/models/{name}"]


def _handler(server: FileServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            server.requests.append((self.path, self.headers.get("Range")))
            behaviour = server.files.get(self.path.removeprefix("/models/"))
            if behaviour is None:
                self.send_error(404)
                return
            body, start = behaviour.body, 0
            if self.headers.get("Range"):
                start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0])
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(body) - start))
            self.end_headers()
            sent, limit = start, behaviour.cut_after
            behaviour.cut_after = None  # only the first response is cut
            try:
                while sent < len(body):
                    if limit is not None and sent >= limit:
                        self.connection.shutdown(2)  # mid-file, as a dropped link would
                        return
                    time.sleep(behaviour.delay_s)
                    end = min(len(body), sent + behaviour.chunk,
                              limit if limit is not None else len(body))
                    self.wfile.write(body[sent:end])
                    sent = end
            except (BrokenPipeError, ConnectionResetError):
                pass

    return Handler


@pytest.fixture
def files() -> Iterator[FileServer]:
    state = FileServer()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    httpd.daemon_threads = True
    state.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield state
    httpd.shutdown()
    httpd.server_close()


def spec_of(uri: str, body: bytes) -> FileSpec:
    return FileSpec(uri, hashlib.sha256(body).hexdigest(), len(body))


def leftovers(cache: Cache) -> list[str]:
    return sorted(p.name for p in (cache.root / "partial").iterdir())


def test_a_transfer_cut_mid_file_resumes_where_it_stopped(
        files: FileServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = os.urandom(3 * 1024 * 1024 + 17)
    files.files["model.gguf"] = Behaviour(body, cut_after=1024 * 1024)
    cache = Cache(tmp_path / "cache")
    path = fetch([spec_of(files.url("model.gguf"), body)], cache, backoff_s=0.05)
    assert path.name == "model.gguf" and path.read_bytes() == body
    assert path == cache.model_path([spec_of(files.url("model.gguf"), body)])
    # The second request asked only for what was missing.
    assert files.gets("model.gguf") == [None, "bytes=1048576-"]
    assert leftovers(cache) == []
    assert cache.blob(hashlib.sha256(body).hexdigest()).stat().st_mode & 0o222 == 0
    assert "fetch model.gguf: 3.0/3.0 MiB (100%)" in capsys.readouterr().err
    # Cached: a second fetch sends nothing.
    assert fetch([spec_of(files.url("model.gguf"), body)], cache) == path
    assert len(files.gets("model.gguf")) == 2


def test_a_wrong_digest_names_the_file_and_both_digests(files: FileServer, tmp_path: Path) -> None:
    body = b"not the weights you reviewed" * 1000
    files.files["model.gguf"] = Behaviour(body)
    expected = "0" * 64
    cache = Cache(tmp_path / "cache")
    with pytest.raises(FetchError) as info:
        fetch([FileSpec(files.url("model.gguf"), expected, len(body))], cache)
    message = str(info.value)
    assert "model.gguf" in message and expected in message
    assert hashlib.sha256(body).hexdigest() in message
    assert leftovers(cache) == [] and list((cache.root / "blobs").iterdir()) == []


def test_a_truncated_source_is_refused(files: FileServer, tmp_path: Path) -> None:
    body = os.urandom(100_000)
    files.files["model.gguf"] = Behaviour(body[:60_000])  # a complete response, too short
    cache = Cache(tmp_path / "cache")
    with pytest.raises(FetchError, match="60000 bytes arrived, the manifest says 100000"):
        fetch([spec_of(files.url("model.gguf"), body)], cache)
    assert leftovers(cache) == []


def test_not_found_fails_at_once(files: FileServer, tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache")
    with pytest.raises(FetchError, match=r"missing\.gguf: GET .*: HTTP 404"):
        fetch([spec_of(files.url("missing.gguf"), b"x")], cache)
    assert len(files.gets("missing.gguf")) == 1  # not retried: it will not appear
    assert leftovers(cache) == []


def test_a_stalled_server_fails_after_the_attempts(files: FileServer, tmp_path: Path) -> None:
    body = os.urandom(256 * 1024)
    files.files["model.gguf"] = Behaviour(body, delay_s=2.0, chunk=1024)
    cache = Cache(tmp_path / "cache")
    started = time.monotonic()
    with pytest.raises(FetchError, match=r"model\.gguf: 2 attempts failed, the last: GET .*"
                                         r"ReadTimeout"):
        fetch([spec_of(files.url("model.gguf"), body)], cache, attempts=2, timeout_s=0.5,
              backoff_s=0.05)
    assert time.monotonic() - started < 10
    assert len(files.gets("model.gguf")) == 2 and leftovers(cache) == []


def test_a_full_cache_is_a_clear_error(files: FileServer, tmp_path: Path) -> None:
    """A cache over its size limit (an emptyDir's sizeLimit) refuses before downloading; a
    full filesystem (a 512 KiB tmpfs) does too, naming what is missing."""
    small, big = os.urandom(300 * 1024), os.urandom(400 * 1024)
    files.files["a.safetensors"] = Behaviour(small)
    files.files["b.safetensors"] = Behaviour(big)
    specs = [spec_of(files.url("a.safetensors"), small), spec_of(files.url("b.safetensors"), big)]
    capped = Cache(tmp_path / "capped", limit_bytes=512 * 1024)
    with pytest.raises(FetchError, match=r"b\.safetensors: needs 409600 more bytes: the cache "
                                         r".* would hold 716800, over its limit of 524288"):
        fetch(specs, capped)
    assert leftovers(capped) == [] and not files.gets("b.safetensors")

    mount = tmp_path / "tmpfs"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)],
                             capture_output=True, check=False).returncode == 0
    if not mounted:
        pytest.skip("cannot mount a tmpfs here (needs root): the size-limit case ran")
    try:
        full = Cache(mount)
        with pytest.raises(FetchError, match=r"b\.safetensors: needs 409600 more bytes and "
                                             r".* has \d+ free"):
            fetch(specs, full)
        assert leftovers(full) == []
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_two_processes_sharing_a_cache_download_once(files: FileServer, tmp_path: Path) -> None:
    body = os.urandom(2 * 1024 * 1024)
    files.files["model.gguf"] = Behaviour(body, delay_s=0.05)  # ~1.6 s: they overlap
    spec = spec_of(files.url("model.gguf"), body)
    artifact = tmp_path / "artifact.yaml"
    artifact.write_text(f"""apiVersion: kvfleet.io/v1alpha1
kind: ModelArtifact
metadata: {{name: m}}
spec:
  family: tiny
  weights:
    format: gguf
    files: [{{uri: "{spec.uri}", sha256: "{spec.sha256}", sizeBytes: {spec.size_bytes}}}]
  tokenizer: {{type: gpt2, sha256: "{"1" * 64}"}}
  specialTokens: {{eosTokenId: 2}}
  architecture: {{name: llama, numLayers: 1, hiddenSize: 64, numQueryHeads: 4, numKVHeads: 2,
                  headDim: 16, vocabSize: 100, maxContextLength: 128}}
  dtype: float32
  engineVersions: {{min: "0.1"}}
""")
    command = [sys.executable, "-m", "kvfleet", "artifact", "fetch", "-f", str(artifact),
               "--cache", str(tmp_path / "cache")]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    outputs = [run.communicate(timeout=120) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    (path,) = {out.strip() for out, _ in outputs}
    assert Path(path).read_bytes() == body
    assert len(files.gets("model.gguf")) == 1
    # One downloaded (its progress lines); the other waited on the lock, then found the blob.
    assert sorted("fetch model.gguf" in err for _, err in outputs) == [False, True], outputs


def test_a_checkpoint_folder_keeps_the_file_names(files: FileServer, tmp_path: Path) -> None:
    """Several files (an HF checkpoint) become one folder under the names the URIs give,
    local files included (file://, and pkg:// for a file inside an installed package)."""
    local = tmp_path / "config.json"
    local.write_text('{"model_type": "llama"}')
    shard = os.urandom(50_000)
    files.files["model-00001-of-00001.safetensors"] = Behaviour(shard)
    import kvfleet

    packaged = Path(kvfleet.__file__).parent / "engine" / "csrc" / "vec.h"
    specs = [spec_of(local.as_uri(), local.read_bytes()),
             spec_of(files.url("model-00001-of-00001.safetensors"), shard),
             spec_of("pkg://kvfleet/engine/csrc/vec.h", packaged.read_bytes())]
    cache = Cache(tmp_path / "cache")
    folder = fetch(specs, cache)
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "model-00001-of-00001.safetensors", "vec.h"]
    assert (folder / "vec.h").read_bytes() == packaged.read_bytes()
    with pytest.raises(ValueError, match=r"would both be 'config\.json'"):
        fetch([*specs, spec_of(files.url("config.json"), b"{}")], cache)


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """moto's S3 API server on loopback; the fetcher finds it through AWS_ENDPOINT_URL."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client = boto3.client("s3")
    client.create_bucket(Bucket="models")
    yield client
    server.stop()


def test_s3_objects_are_fetched_and_verified(s3: object, tmp_path: Path) -> None:
    body = os.urandom(1024 * 1024 + 5)
    s3.put_object(Bucket="models", Key="smol/v1/model.gguf", Body=body)  # type: ignore[attr-defined]
    cache = Cache(tmp_path / "cache")
    path = fetch([spec_of("s3://models/smol/v1/model.gguf", body)], cache)
    assert path.read_bytes() == body and path.name == "model.gguf"
    with pytest.raises(FetchError, match=r"absent\.gguf: GET s3://models/absent\.gguf: NoSuchKey"):
        fetch([spec_of("s3://models/absent.gguf", b"x")], cache)
    with pytest.raises(FetchError, match="sha256 is"):
        fetch([FileSpec("s3://models/smol/v1/model.gguf", "2" * 64, len(body))], cache)
    assert leftovers(cache) == []
