"""LoRA before the device: name resolution, S3 fetch against a real (moto) server, the disk cache, and loading
real PEFT adapters into validated tensors."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.lora import (
    AdapterDiskCache,
    AdapterRef,
    LoRALoadError,
    fetch,
    load_adapter,
    max_adapter_bytes,
    resolve,
    validate_name,
)
from tests.lora_fixtures import make_peft_adapter, model_spec, upload_adapter

FILES = ("adapter_config.json", "adapter_model.safetensors")


def cfg(**kw) -> EngineConfig:
    return EngineConfig(enable_lora=True, **kw)


@pytest.fixture(scope="module")
def adapters(lora_bases, tmp_path_factory):
    """The PEFT adapters most tests share, built once."""
    root = tmp_path_factory.mktemp("adapters")
    llama = lora_bases["llama"]
    return {
        "plain": make_peft_adapter(llama, root / "plain", r=4, alpha=8, seed=1),
        "rslora": make_peft_adapter(
            llama, root / "rslora", r=8, alpha=16, rslora=True, seed=2, targets=("q_proj", "v_proj", "down_proj")
        ),
        "qwen3": make_peft_adapter(lora_bases["qwen3"], root / "qwen3", r=2, alpha=3, seed=3),
        "big": make_peft_adapter(llama, root / "big", r=16, alpha=16, seed=4),
    }


def _cache(tmp_path, moto_server, max_bytes=1 << 30, slow=0.0) -> AdapterDiskCache:
    def fetch_fn(ref, dest):
        time.sleep(slow)  # widens the window in which concurrent gets must coalesce
        fetch(ref, dest, moto_server.url)

    return AdapterDiskCache(tmp_path / "lora-cache", max_bytes, fetch_fn)


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("name", ["a", "my-adapter_v1.2", "A" * 128])
def test_valid_names(name):
    assert validate_name(name) == name


@pytest.mark.parametrize(
    "name,why",
    [
        ("", "non-empty"),
        (None, "non-empty"),
        ("../x", "only letters"),
        ("a/b", "only letters"),
        ("a\\b", "only letters"),
        ("a b", "only letters"),
        (".hidden", "start with '.'"),
        ("a..b", "'..'"),
        ("..", "'..'"),
        ("x" * 129, "at most 128"),
    ],
)
def test_bad_names(name, why):
    with pytest.raises(InvalidRequestError, match=why) as e:
        validate_name(name)
    assert e.value.field == "lora"


def test_resolve_order(tmp_path):
    c = cfg(
        lora_modules=(("local", str(tmp_path)), ("static", "s3://static-bkt/ad/one")),
        lora_s3_uri="s3://pool-bkt/adapters",
        lora_allowed_buckets=("user-bkt",),
    )
    assert resolve(c, "local") == AdapterRef("local", str(tmp_path.resolve()))
    assert resolve(c, "static") == AdapterRef("static", "s3://static-bkt/ad/one/")  # static wins over the prefix
    assert resolve(c, "static", "s3://static-bkt/ad/one/").uri == "s3://static-bkt/ad/one/"
    assert resolve(c, "mine", "s3://user-bkt/x/y").uri == "s3://user-bkt/x/y/"  # explicit, allowed bucket
    assert resolve(c, "other") == AdapterRef("other", "s3://pool-bkt/adapters/other/")  # prefix + name + '/'
    with pytest.raises(InvalidRequestError, match="LORA_ALLOWED_BUCKETS") as e:
        resolve(c, "mine", "s3://evil-bkt/x/")
    assert e.value.field == "lora.s3_uri"
    with pytest.raises(InvalidRequestError, match="LORA_MODULES") as e:  # a static name with another URI
        resolve(c, "static", "s3://user-bkt/x/")
    assert e.value.field == "lora.s3_uri"
    with pytest.raises(InvalidRequestError, match="not an s3://"):
        resolve(c, "mine", "/etc/passwd")
    with pytest.raises(InvalidRequestError, match="only letters"):
        resolve(c, "../etc")
    with pytest.raises(
        InvalidRequestError,
        match=r"unknown adapter 'nope' \(configured: local, static\).*"
        "LORA_S3_URI",
    ) as e:
        resolve(cfg(lora_modules=c.lora_modules), "nope")
    assert e.value.field == "lora"
    with pytest.raises(InvalidRequestError, match="ENABLE_LORA"):
        resolve(EngineConfig(), "x")


@pytest.mark.parametrize("which", ["plain", "rslora", "qwen3"])
def test_fetch_and_load_match_peft(which, adapters, lora_bases, moto_server, s3, tmp_path):
    folder, expected = adapters[which]
    base = lora_bases["qwen3" if which == "qwen3" else "llama"]
    uri = upload_adapter(s3, "load-bkt", f"{which}-{tmp_path.name}", folder)
    ref = resolve(cfg(lora_allowed_buckets=("load-bkt",)), which, uri)
    path = _cache(tmp_path, moto_server).get(ref)
    ad = load_adapter(path, model_spec(base), max_rank=16, name=which)
    assert ad.scaling == pytest.approx(expected["scaling"])  # PEFT's own number (alpha/sqrt(r) for rslora)
    assert ad.rank == json.loads((folder / FILES[0]).read_text())["r"]
    assert set(ad.weights) == set(expected["weights"]) and ad.weights
    for k, (a, b) in expected["weights"].items():
        got_a, got_b = ad.weights[k]
        assert got_a.dtype == got_b.dtype == torch.float32
        assert torch.equal(got_a, a) and torch.equal(got_b, b), k
        assert got_b.abs().sum() > 0
    assert ad.nbytes == sum(a.numel() * 4 + b.numel() * 4 for a, b in expected["weights"].values())


def test_hit_does_no_s3_request_and_survives_restart(adapters, moto_server, s3, tmp_path):
    uri = upload_adapter(s3, "hit-bkt", "a1", adapters["plain"][0])
    ref = AdapterRef("a1", uri)
    cache = _cache(tmp_path, moto_server)
    before = moto_server.count("GET", "/hit-bkt/")
    p1 = cache.get(ref)
    assert moto_server.count("GET", "/hit-bkt/") == before + 2  # config + safetensors
    n_all = len(moto_server.requests())
    assert cache.get(ref) == p1
    assert ref in cache and cache.stats()["hits"] == 1 and cache.stats()["downloads"] == 1
    restarted = _cache(tmp_path, moto_server)  # a new process over the same volume
    assert restarted.get(ref) == p1 and restarted.stats()["hits"] == 1
    assert len(moto_server.requests()) == n_all  # not one request of any kind reached S3
    assert p1.parent == tmp_path / "lora-cache" and json.loads((p1 / "meta.json").read_text())["uri"] == uri


def test_eight_concurrent_gets_one_download(adapters, moto_server, s3, tmp_path):
    uri = upload_adapter(s3, "flight-bkt", "a", adapters["plain"][0])
    cache = _cache(tmp_path, moto_server, slow=0.3)
    barrier, paths, errors = threading.Barrier(8), [], []

    def worker():
        barrier.wait()
        try:
            paths.append(cache.get(AdapterRef("a", uri)))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(set(paths)) == 1 and len(paths) == 8
    assert moto_server.count("GET", "/flight-bkt/a/adapter_model.safetensors") == 1
    st = cache.stats()
    assert st["downloads"] == 1 and st["misses"] == 1 and st["coalesced"] >= 1


def test_different_adapters_download_in_parallel(adapters, moto_server, s3, tmp_path):
    uris = [upload_adapter(s3, "par-bkt", f"p{i}", adapters["plain"][0]) for i in range(2)]
    inside, both = [], threading.Event()

    def fetch_fn(ref, dest):
        inside.append(ref.name)
        if len(inside) == 2:
            both.set()
        assert both.wait(5), "the second download did not start while the first was in progress"
        fetch(ref, dest, moto_server.url)

    cache = AdapterDiskCache(tmp_path / "c", 1 << 30, fetch_fn)
    threads = [threading.Thread(target=cache.get, args=(AdapterRef(f"p{i}", u),)) for i, u in enumerate(uris)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert cache.stats()["entries"] == 2


def test_lru_eviction_by_bytes(adapters, moto_server, s3, tmp_path):
    refs = [AdapterRef(f"e{i}", upload_adapter(s3, "lru-bkt", f"e{i}", adapters["plain"][0])) for i in range(3)]
    probe = _cache(tmp_path / "probe", moto_server)
    size = probe.stats()["bytes"] if probe.get(refs[0]) else 0
    cache = _cache(tmp_path, moto_server, max_bytes=2 * size + size // 2)  # room for two
    p0, p1 = cache.get(refs[0]), cache.get(refs[1])
    cache.get(refs[0])  # e0 is now the most recent
    p2 = cache.get(refs[2])  # evicts e1, the least recently used
    assert p0.exists() and p2.exists() and not p1.exists()
    assert refs[1] not in cache and cache.stats()["evictions"] == 1
    on_disk = sum(f.stat().st_size for f in (tmp_path / "lora-cache").rglob("*") if f.is_file())
    assert on_disk == cache.stats()["bytes"] <= cache.max_bytes
    assert not [n for n in _entries(tmp_path / "lora-cache") if n.startswith(".")]
    # Recency survives a restart: e0 was touched after e2 was inserted, so e2 goes first now.
    cache.get(refs[0])
    restarted = _cache(tmp_path, moto_server, max_bytes=2 * size + size // 2)
    restarted.get(refs[1])
    assert refs[0] in restarted and refs[2] not in restarted
    # An adapter bigger than the whole budget is still served, and is the next one evicted.
    tiny = _cache(tmp_path / "tiny", moto_server, max_bytes=size // 2)
    q0 = tiny.get(refs[0])
    assert q0.exists() and tiny.stats()["entries"] == 1
    tiny.get(refs[1])
    assert not q0.exists() and tiny.stats()["entries"] == 1
    with tiny.use(refs[1]) as pinned:  # a pinned folder is not evicted under a reader
        tiny.get(refs[2])
        assert pinned.exists()
    assert not pinned.exists() and tiny.stats()["entries"] == 1


def test_pickle_only_adapter_refused(adapters, moto_server, s3, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / FILES[0]).write_bytes((adapters["plain"][0] / FILES[0]).read_bytes())
    torch.save({"x": torch.zeros(1)}, folder / "adapter_model.bin")
    uri = upload_adapter(s3, "pkl-bkt", "p", folder, files=(FILES[0], "adapter_model.bin"))
    cache = _cache(tmp_path, moto_server)
    with pytest.raises(InvalidRequestError, match="pickle") as e:
        cache.get(AdapterRef("p", uri))
    assert e.value.field == "lora" and _entries(tmp_path / "lora-cache") == []
    with pytest.raises(InvalidRequestError, match="pickle"):  # the same rule for a local folder
        cache.get(AdapterRef("p", str(folder)))


def test_missing_adapter_and_endpoint_down(moto_server, s3, tmp_path):
    s3.create_bucket(Bucket="empty-bkt")
    cache = _cache(tmp_path, moto_server)
    with pytest.raises(InvalidRequestError, match="no adapter_config.json under s3://empty-bkt/nothing/"):
        cache.get(AdapterRef("nothing", "s3://empty-bkt/nothing/"))
    with socket.socket() as sock:  # a port nobody listens on: connection refused
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    down = AdapterDiskCache(tmp_path / "down", 1 << 30, lambda r, d: fetch(r, d, dead))
    t0 = time.monotonic()
    with pytest.raises(LoRALoadError, match="could not download"):
        down.get(AdapterRef("x", "s3://empty-bkt/x/"))
    assert time.monotonic() - t0 < 10 and _entries(tmp_path / "down") == []


def test_waiter_timeout(adapters, moto_server, s3, tmp_path):
    uri = upload_adapter(s3, "slow-bkt", "s", adapters["plain"][0])
    cache = _cache(tmp_path, moto_server, slow=1.0)
    leader = threading.Thread(target=cache.get, args=(AdapterRef("s", uri),))
    leader.start()
    time.sleep(0.1)
    with pytest.raises(LoRALoadError, match="not downloaded within"):
        cache.get(AdapterRef("s", uri), timeout=0.2)
    leader.join(10)
    assert cache.get(AdapterRef("s", uri), timeout=0.2).exists()  # the download itself went on


def test_truncated_download_leaves_nothing_and_retry_works(adapters, moto_server, s3, tmp_path):
    good = adapters["plain"][0]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / FILES[0]).write_bytes((good / FILES[0]).read_bytes())
    data = (good / FILES[1]).read_bytes()
    (bad / FILES[1]).write_bytes(data[: len(data) - 100])  # a partial upload
    uri = upload_adapter(s3, "trunc-bkt", "t", bad)
    cache = _cache(tmp_path, moto_server)
    with pytest.raises(InvalidRequestError, match="truncated"):
        cache.get(AdapterRef("t", uri))
    assert _entries(tmp_path / "lora-cache") == [] and cache.stats()["failures"] == 1
    (bad / FILES[1]).write_bytes(b"\xff" * 64)  # garbage header length
    upload_adapter(s3, "trunc-bkt", "t", bad)
    with pytest.raises(InvalidRequestError, match="not safetensors"):
        cache.get(AdapterRef("t", uri))
    upload_adapter(s3, "trunc-bkt", "t", good)
    assert (cache.get(AdapterRef("t", uri)) / FILES[1]).read_bytes() == data


def test_oversized_download_refused_before_transfer(adapters, lora_bases, moto_server, s3, tmp_path):
    spec = model_spec(lora_bases["llama"])
    uri = upload_adapter(s3, "size-bkt", "big", adapters["big"][0])
    cap = max_adapter_bytes(spec, max_rank=16)
    assert (adapters["big"][0] / FILES[1]).stat().st_size <= cap  # a legitimate r=16 adapter fits
    cache = AdapterDiskCache(tmp_path / "c", 1 << 30, lambda r, d: fetch(r, d, moto_server.url, max_bytes=1000))
    with pytest.raises(InvalidRequestError, match="at most 1000"):
        cache.get(AdapterRef("big", uri))


def test_rank_above_max_refused(adapters, lora_bases):
    with pytest.raises(InvalidRequestError, match="r=16 is above MAX_LORA_RANK=8"):
        load_adapter(adapters["big"][0], model_spec(lora_bases["llama"]), max_rank=8, name="big")


def test_unsupported_target_modules_refused(lora_bases, tmp_path):
    spec = model_spec(lora_bases["llama"])
    folder, _ = make_peft_adapter(lora_bases["llama"], tmp_path / "lm", targets=("q_proj", "lm_head"))
    with pytest.raises(InvalidRequestError, match=r"\['lm_head'\] are not supported; supported: q_proj, k_proj"):
        load_adapter(folder, spec, 16, "lm")
    # A regex target: the config cannot be listed, the tensor file shows what was adapted.
    folder, _ = make_peft_adapter(lora_bases["llama"], tmp_path / "re", targets=r".*(q_proj|embed_tokens)")
    with pytest.raises(InvalidRequestError, match="embed_tokens.*does not support"):
        load_adapter(folder, spec, 16, "re")


def test_wrong_shapes_refused(adapters, lora_bases):
    spec = model_spec(lora_bases["llama"])
    with pytest.raises(
        InvalidRequestError,
        match=r"down_proj.lora_A.weight' has shape \[4, 192\]; this model needs "
        r"\[4, 256\]",
    ):
        load_adapter(adapters["plain"][0], dataclasses.replace(spec, intermediate_size=256), 16, "plain")
    with pytest.raises(InvalidRequestError, match="layer 1 does not exist"):
        load_adapter(adapters["plain"][0], dataclasses.replace(spec, num_layers=1), 16, "plain")
    with pytest.raises(
        InvalidRequestError,
        match=r"k_proj.lora_B.weight' has shape \[32, 4\]; this model needs "
        r"\[96, 4\]",
    ):  # a llama adapter on qwen3 (head_dim 48)
        load_adapter(adapters["plain"][0], model_spec(lora_bases["qwen3"]), 16, "plain")


@pytest.mark.parametrize(
    "change,why",
    [
        (dict(use_dora=True), "use_dora=True"),
        (dict(bias="all"), "bias='all'"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
        (dict(alpha_pattern={"q_proj": 8}), "alpha_pattern"),
        (dict(peft_type="IA3"), "peft_type"),
    ],
)
def test_refused_config_settings(change, why, adapters, lora_bases, tmp_path):
    src = adapters["plain"][0]
    (tmp_path / FILES[1]).write_bytes((src / FILES[1]).read_bytes())
    (tmp_path / FILES[0]).write_text(json.dumps({**json.loads((src / FILES[0]).read_text()), **change}))
    with pytest.raises(InvalidRequestError, match=why):
        load_adapter(tmp_path, model_spec(lora_bases["llama"]), 16, "x")


def test_missing_half_and_nan_refused(adapters, lora_bases, tmp_path):
    spec = model_spec(lora_bases["llama"])
    (tmp_path / FILES[0]).write_text((adapters["plain"][0] / FILES[0]).read_text())
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    save_file({key.format("A"): torch.ones(4, 96)}, str(tmp_path / FILES[1]))
    with pytest.raises(InvalidRequestError, match="layer 0 q_proj has no lora_B"):
        load_adapter(tmp_path, spec, 16, "x")
    save_file(
        {key.format("A"): torch.ones(4, 96), key.format("B"): torch.full((96, 4), float("nan"))},
        str(tmp_path / FILES[1]),
    )
    with pytest.raises(InvalidRequestError, match="NaN"):
        load_adapter(tmp_path, spec, 16, "x")


def test_local_folder_read_in_place(adapters, lora_bases, tmp_path):
    folder = adapters["plain"][0]
    ref = resolve(cfg(lora_modules=(("loc", str(folder)),)), "loc")
    cache = AdapterDiskCache(tmp_path / "c", 1 << 30)
    assert cache.get(ref) == folder.resolve() and _entries(tmp_path / "c") == []
    assert load_adapter(cache.get(ref), model_spec(lora_bases["llama"]), 16, "loc").rank == 4
    (tmp_path / "copy").mkdir()
    fetch(ref, tmp_path / "copy")  # fetch itself copies a local folder (the cache does not call it for one)
    assert (tmp_path / "copy" / FILES[1]).read_bytes() == (folder / FILES[1]).read_bytes()


def test_stale_temp_folders_cleaned_on_start(tmp_path):
    from engine.lora.disk_cache import _HOST

    root = tmp_path / "lora-cache"
    for name in (f".tmp-{_HOST}-dl-1234", ".tmp-otherhost-dl-old", ".tmp-otherhost-dl-fresh"):
        (root / name).mkdir(parents=True)
        (root / name / FILES[1]).write_bytes(b"half")
    os.utime(root / ".tmp-otherhost-dl-old", (time.time() - 7200,) * 2)
    (root / ("0" * 64)).mkdir()  # no meta.json: never completed
    cache = AdapterDiskCache(root, 1 << 20)
    # Ours (a crashed earlier run) and old ones go; another worker's fresh download on a shared volume stays.
    assert _entries(root) == [".tmp-otherhost-dl-fresh"] and cache.stats()["entries"] == 0


def test_a_cached_adapter_damaged_on_the_volume_is_fetched_again(adapters, moto_server, s3, tmp_path):
    """A cache entry cut short after it was cached (a full volume, a crashed copy): the next use sees it, drops the
    entry and downloads the adapter again, so the request that named it is served (docs/decisions.md, "Faults")."""
    good = adapters["plain"][0]
    uri = upload_adapter(s3, "damaged-bkt", "d", good)
    ref = AdapterRef("d", uri)
    cache = _cache(tmp_path, moto_server)
    path = cache.get(ref)
    weights = path / FILES[1]
    weights.write_bytes(weights.read_bytes()[:-100])
    with cache.use(ref) as again:
        assert (again / FILES[1]).read_bytes() == (good / FILES[1]).read_bytes()
    assert cache.stats()["downloads"] == 2 and _entries(tmp_path / "lora-cache") == [path.name]


def test_a_full_volume_downloads_the_adapter_without_caching_it(adapters, moto_server, s3, tmp_path):
    """No space left on the volume (ENOSPC while the download writes there): the request is still served from a
    private temporary folder, deleted after use; nothing half-written stays in the cache."""
    import errno

    uri = upload_adapter(s3, "full-bkt", "f", adapters["plain"][0])
    root = tmp_path / "lora-cache"

    def full_volume(ref, dest):
        if root in Path(dest).parents:
            raise OSError(errno.ENOSPC, "No space left on device")
        fetch(ref, dest, moto_server.url)

    cache = AdapterDiskCache(root, 1 << 30, full_volume)
    with cache.use(AdapterRef("f", uri)) as path:
        assert root not in path.parents and (path / FILES[1]).is_file()
    assert not path.exists() and _entries(root) == [] and cache.stats()["uncached"] == 1
