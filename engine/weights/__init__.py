"""Model weights: where a model is (locate, default_model), how its safetensors stream in (reader), and the fp8
snapshot with its load-or-build policy (fp8_snapshot, load)."""

from engine.weights.default_model import converted_dir
from engine.weights.fp8_snapshot import snapshot_for
from engine.weights.fp8_snapshot import valid as snapshot_valid
from engine.weights.load import LoadedWeights, load_model
from engine.weights.locate import read_json, resolve_model_path, safetensors_files
from engine.weights.reader import iter_safetensors, iter_weights

__all__ = [
    "LoadedWeights",
    "converted_dir",
    "iter_safetensors",
    "iter_weights",
    "load_model",
    "read_json",
    "resolve_model_path",
    "safetensors_files",
    "snapshot_for",
    "snapshot_valid",
]
