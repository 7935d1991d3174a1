"""Where an adapter comes from: name validation, name -> URI resolution, and fetching its two PEFT files.

Resolution order (docs/configuration.md): static LORA_MODULES, then an explicit request s3_uri (only for buckets in
LORA_ALLOWED_BUCKETS), then LORA_S3_URI + name + '/'. Local folders are read in place by the disk cache; `fetch`
copies them only when asked to (it is uniform so tests and tools can treat both kinds alike).
boto3 is imported inside `fetch`: importing it costs ~0.3 s and `import handler` must stay fast."""

from __future__ import annotations

import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from engine.errors import EngineError, InvalidRequestError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
MAX_NAME_LEN = 128
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
_CHUNK = 1 << 20


class LoRALoadError(EngineError):
    """The adapter could not be fetched for reasons that are not the request's fault (S3 down, access denied,
    timeout). It fails only the request that named the adapter; `field` is "lora" like InvalidRequestError's."""

    field = "lora"


def validate_name(name) -> str:
    """An adapter name is a label, never a path: [A-Za-z0-9._-], not starting with '.', at most 128 chars."""
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("the adapter name must be a non-empty string", field="lora")
    if len(name) > MAX_NAME_LEN:
        raise InvalidRequestError(f"the adapter name is {len(name)} characters; at most {MAX_NAME_LEN}", field="lora")
    if not _NAME_RE.fullmatch(name):
        raise InvalidRequestError(
            f"adapter name {name[:40]!r}: only letters, digits, '.', '_' and '-' are allowed (no path separators)",
            field="lora",
        )
    if name.startswith(".") or ".." in name:
        raise InvalidRequestError(f"adapter name {name!r} must not start with '.' or contain '..'", field="lora")
    return name


@dataclass(frozen=True)
class AdapterRef:
    """One adapter: the name the request used and the URI it resolved to. The URI is the identity (cache key,
    device slot key): two requests may use the same name with different s3_uris."""

    name: str
    uri: str  # s3://bucket/prefix/ (always ends with '/') or an absolute local folder

    @property
    def is_s3(self) -> bool:
        return self.uri.startswith("s3://")


def split_s3_uri(uri: str, field: str = "lora.s3_uri") -> tuple[str, str]:
    """s3://bucket/some/prefix -> ("bucket", "some/prefix/"). The prefix is a folder: a '/' is appended."""
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise InvalidRequestError(f"{uri!r} is not an s3://bucket/prefix/ URI", field=field)
    bucket, _, prefix = uri[5:].partition("/")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        raise InvalidRequestError(f"{uri!r}: {bucket!r} is not a valid bucket name", field=field)
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return bucket, prefix


def _normalize(uri: str, field: str) -> str:
    if uri.startswith("s3://"):
        bucket, prefix = split_s3_uri(uri, field)
        return f"s3://{bucket}/{prefix}"
    return str(Path(uri).expanduser().resolve())  # a local folder, configured by the operator


def resolve(config, name, s3_uri: str | None = None) -> AdapterRef:
    """Name (+ optional request s3_uri) -> AdapterRef, in the documented order. Raises InvalidRequestError."""
    if not config.enable_lora:
        raise InvalidRequestError("this worker does not serve LoRA adapters; set ENABLE_LORA=true", field="lora")
    name = validate_name(name)
    static = dict(config.lora_modules)
    if name in static:
        uri = _normalize(static[name], "lora")
        if s3_uri is not None and _normalize(s3_uri, "lora.s3_uri") != uri:
            # Silently ignoring the request's URI would serve an adapter the caller did not ask for.
            raise InvalidRequestError(
                f"adapter {name!r} is configured in LORA_MODULES; omit s3_uri or use another name", field="lora.s3_uri"
            )
        return AdapterRef(name, uri)
    if s3_uri is not None:
        bucket, prefix = split_s3_uri(s3_uri)
        if bucket not in config.lora_allowed_buckets:
            raise InvalidRequestError(
                f"bucket {bucket!r} is not allowed for request s3_uris; the operator can add it "
                "to LORA_ALLOWED_BUCKETS",
                field="lora.s3_uri",
            )
        return AdapterRef(name, f"s3://{bucket}/{prefix}")
    if config.lora_s3_uri:
        bucket, prefix = split_s3_uri(config.lora_s3_uri, "lora")
        return AdapterRef(name, f"s3://{bucket}/{prefix}{name}/")
    known = ", ".join(sorted(static)) or "none"
    raise InvalidRequestError(
        f"unknown adapter {name!r} (configured: {known}); configure it in LORA_MODULES, set "
        "LORA_S3_URI, or pass an s3_uri in a bucket listed in LORA_ALLOWED_BUCKETS",
        field="lora",
    )


_clients: dict = {}
_clients_lock = threading.Lock()


def _s3_client(endpoint_url: str | None):
    """One client per endpoint: building one costs ~50 ms, and boto3 clients are thread-safe (sessions are not)."""
    with _clients_lock:
        if endpoint_url not in _clients:
            import boto3
            from botocore.config import Config

            # Bounded timeouts and few retries: a dead endpoint must fail the request, not hang a loader thread.
            cfg = Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 2, "mode": "standard"})
            _clients[endpoint_url] = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=cfg)
        return _clients[endpoint_url]


def fetch(ref: AdapterRef, dest_dir: Path, endpoint_url: str | None = None, max_bytes: int | None = None) -> None:
    """Write adapter_config.json + adapter_model.safetensors of `ref` into `dest_dir` (which exists).

    Not found / pickle-only / too large: InvalidRequestError(field="lora"). Endpoint down, access denied,
    throttling, time-outs: LoRALoadError. `max_bytes` caps the safetensors size before anything is downloaded."""
    dest_dir = Path(dest_dir)
    if not ref.is_s3:
        src = Path(ref.uri)
        if not (src / WEIGHTS_FILE).is_file() and (src / PICKLE_FILE).is_file():
            raise InvalidRequestError(
                f"adapter {ref.name!r} at {src} has only {PICKLE_FILE} (pickle, refused); save it with safetensors",
                field="lora",
            )
        for f in (CONFIG_FILE, WEIGHTS_FILE):
            if not (src / f).is_file():
                raise InvalidRequestError(f"adapter {ref.name!r}: {src / f} not found", field="lora")
            shutil.copyfile(src / f, dest_dir / f)
        return
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = split_s3_uri(ref.uri, "lora")
    client = _s3_client(endpoint_url)
    where = f"s3://{bucket}/{prefix}"

    def missing(e: ClientError) -> bool:
        return e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound")

    def get(fname: str, cap: int | None) -> None:
        obj = client.get_object(Bucket=bucket, Key=prefix + fname)
        size = obj.get("ContentLength")
        if cap is not None and size is not None and size > cap:
            obj["Body"].close()
            raise InvalidRequestError(
                f"adapter {ref.name!r}: {where}{fname} is {size} bytes; an adapter of rank <= "
                f"MAX_LORA_RANK for this model is at most {cap}",
                field="lora",
            )
        with open(dest_dir / fname, "wb") as out:
            for chunk in obj["Body"].iter_chunks(_CHUNK):  # botocore checks Content-Length: short reads raise
                out.write(chunk)

    try:
        try:
            get(CONFIG_FILE, 1 << 20)
        except ClientError as e:
            if missing(e):
                raise InvalidRequestError(
                    f"adapter {ref.name!r}: no {CONFIG_FILE} under {where}", field="lora"
                ) from None
            raise
        try:
            get(WEIGHTS_FILE, max_bytes)
        except ClientError as e:
            if not missing(e):
                raise
            try:
                client.head_object(Bucket=bucket, Key=prefix + PICKLE_FILE)
                pickle = True
            except ClientError:
                pickle = False
            why = (
                f"has only {PICKLE_FILE} (pickle, refused; save it with safetensors)"
                if pickle
                else f"has no {WEIGHTS_FILE}"
            )
            raise InvalidRequestError(f"adapter {ref.name!r}: {where} {why}", field="lora") from None
    except ClientError as e:
        err = e.response.get("Error", {})
        raise LoRALoadError(
            f"adapter {ref.name!r}: S3 refused {where}: {err.get('Code')} {err.get('Message', '')}".strip()
        ) from None
    except BotoCoreError as e:  # connection refused, timeouts, missing credentials, incomplete reads
        raise LoRALoadError(f"adapter {ref.name!r}: could not download {where}: {e}") from None
