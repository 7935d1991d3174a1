"""The model families: `model_class(spec)` picks the class a ModelSpec needs."""

from __future__ import annotations


def model_class(spec):
    """Gemma's, GPT-OSS's, a hybrid's (Qwen3-Next, Qwen3.5), the mixture-of-experts one, or the Llama family's."""
    from engine.models.gemma import GemmaForCausalLM
    from engine.models.gpt_oss import GptOssForCausalLM
    from engine.models.llama import LlamaForCausalLM
    from engine.models.moe import MoEForCausalLM
    from engine.models.qwen3_next import HybridForCausalLM

    if spec.gemma:
        return GemmaForCausalLM
    if spec.hybrid:
        return HybridForCausalLM
    if spec.attention_sinks:
        return GptOssForCausalLM
    return MoEForCausalLM if spec.num_experts else LlamaForCausalLM
