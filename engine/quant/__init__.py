"""Quantized checkpoints: what a quantization_config says (scheme.py) and its tensors in the engine's layouts
(convert.py). The kernels are in kernels/int_gemm.py and kernels/fp8.py."""
