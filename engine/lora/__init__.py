"""LoRA adapters before the device: name resolution and fetching (source), the disk cache, and loading a PEFT
adapter into validated fp32 tensors (adapter). The device slots and the delta kernels live elsewhere."""

from engine.lora.adapter import SUPPORTED_MODULES, LoRAAdapter, load_adapter, max_adapter_bytes, module_shapes
from engine.lora.disk_cache import AdapterDiskCache, cache_key, verify_adapter_dir
from engine.lora.source import AdapterRef, LoRALoadError, fetch, resolve, split_s3_uri, validate_name

__all__ = [
    "AdapterDiskCache",
    "AdapterRef",
    "LoRAAdapter",
    "LoRALoadError",
    "SUPPORTED_MODULES",
    "cache_key",
    "fetch",
    "load_adapter",
    "max_adapter_bytes",
    "module_shapes",
    "resolve",
    "split_s3_uri",
    "validate_name",
    "verify_adapter_dir",
]
