"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: engine/models/qwen3_next.py) and their state
pool (engine/state_cache.py, engine/state_slots.py). The default and chunked settings of HF parity run for every
family in test_parity.py (TINY_ARCHS); here: prompts split at every position, preemption, many sequences at once,
a step that ran out of memory, slots that never leak into each other nor out of the pool, what is refused, and the
planner on Qwen3-Next-80B-A3B."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ConfigError
from engine.models.spec import ModelSpec
from engine.state_cache import StatePool
from tests.utils import check_logprobs_close, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
PROMPTS = [[5 + (11 * i + 5 * j) % 300 for j in range(n)] for i, n in enumerate((3, 9, 17, 26, 40, 1, 55, 12))]


def make(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", log_stats_interval=0, **kw)


def generate(llm: LLM, prompts=PROMPTS, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def assert_hf(outs, ref, what: str) -> None:
    for i, (out, (ref_ids, ref_lp)) in enumerate(zip(outs, ref)):
        got = out.outputs[0]
        assert got.token_ids == ref_ids, f"{what}: prompt {i}"
        check_logprobs_close(got.token_ids, got.logprobs, ref_ids, ref_lp, f"{what}: prompt {i}")


def assert_slots_free(llm: LLM) -> None:
    slots = llm.engine.scheduler.state_slots
    assert slots.num_free == slots.num_slots and sorted(slots.free) == list(range(slots.num_slots))


@pytest.fixture(scope="module")
def next_ref(tiny_models):
    return hf_greedy(tiny_models["qwen3-next"], PROMPTS, GREEDY.max_tokens)


def test_the_spec_and_the_pool(tiny_models):
    llm = make(tiny_models["qwen3-next"], max_num_seqs=5)
    spec, runner = llm.engine.spec, llm.engine.runner
    assert spec.hybrid and spec.linear_layers == (True, True, True, False) and spec.num_kv_layers == 1
    assert spec.rotary_dim == 4 and spec.attn_gate  # a quarter of head_dim 16
    assert runner.kv_caches.shape[0] == 1  # KV for the attention layer only
    la = spec.linear_attn
    assert runner.state.conv.shape == (3, 5, la.conv_channels, 3) and runner.state.rec.shape == (3, 5, 4, 8, 12)
    assert runner.state.rec.dtype == torch.float32
    assert llm.engine.memory.state_bytes == 5 * spec.state_bytes_per_seq(4) == runner.state.nbytes


def test_a_prompt_split_at_every_position_carries_the_state(tiny_models):
    """One 13-token prompt, prefilled in chunks of 1, 2, ... 12 tokens (so every position is the first cut): the
    conv and recurrent states carried from chunk to chunk give HF's tokens and logprobs each time."""
    path = tiny_models["qwen3.5"]
    prompt = [[7 + (13 * j) % 290 for j in range(13)]]
    ref = hf_greedy(path, prompt, 8)
    llm = make(path)
    for chunk in range(1, 13):
        llm.engine.scheduler.chunk_cap = chunk
        assert_hf(generate(llm, prompt, SamplingParams(temperature=0, max_tokens=8, logprobs=3)), ref, f"chunk {chunk}")
    assert_slots_free(llm)


def test_many_sequences_mixed_prefill_and_decode(tiny_models, next_ref):
    """Eight sequences of 1-55 tokens in steps of at most 16 tokens: prefill chunks and decodes share steps, each
    sequence in its own slot."""
    llm = make(tiny_models["qwen3-next"], max_num_batched_tokens=16)
    assert_hf(generate(llm), next_ref, "mixed")
    assert_slots_free(llm)


def test_preemption_frees_the_slot_and_recomputes(tiny_models, next_ref):
    llm = make(tiny_models["qwen3-next"], num_kv_blocks=8, max_model_len=72, max_num_batched_tokens=32)
    assert_hf(generate(llm), next_ref, "preempting")
    assert llm.engine.scheduler.num_preemptions > 0
    assert_slots_free(llm)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_a_step_that_ran_out_of_memory_recomputes_its_sequences(tiny_models, next_ref):
    """The injected OOM comes after the forward ran: the state slots hold the failed step's update, so every
    request of that step goes back to recompute from its prompt, and the tokens are HF's still."""
    llm = make(tiny_models["qwen3-next"], max_num_batched_tokens=24, fault_injection="oom@3,oom@9")
    assert_hf(generate(llm), next_ref, "after OOM")
    assert llm.engine.ooms.count == 2 and llm.engine.scheduler.num_preemptions >= 2
    assert_slots_free(llm)


def test_the_state_must_be_carried(tiny_models, next_ref, monkeypatch):
    """Must-fail: a pool that clears every slot each step (no state carried across chunks or decodes) loses HF."""
    batch = StatePool.batch

    def forgetful(self, qsl, positions, slots):
        return batch(self, qsl, [0] * len(positions), slots)  # as if every sequence started here

    monkeypatch.setattr(StatePool, "batch", forgetful)
    outs = generate(make(tiny_models["qwen3-next"]))
    assert [o.outputs[0].token_ids for o in outs] != [r[0] for r in next_ref]


def test_a_corrupted_slot_changes_only_its_own_sequence(tiny_models):
    """Garbage written into one running sequence's slots (every linear layer) changes that sequence's output and no
    other's: slots do not leak into each other."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(corrupt: bool) -> dict[str, list[int]]:
        eng = make(tiny_models["qwen3.5-moe"]).engine
        for i, p in enumerate(PROMPTS[:5]):
            eng.add_request(f"r{i}", {"prompt_token_ids": p}, params)
        done, steps = {}, 0
        while eng.has_unfinished():
            steps += 1
            if corrupt and steps == 6:
                victim = next(r for r in eng.scheduler.running if r.request_id == "r2")
                g = torch.Generator().manual_seed(0)
                st = eng.runner.state
                st.rec[:, victim.state_slot] = torch.randn(st.rec[:, 0].shape, generator=g) * 3
                st.conv[:, victim.state_slot] = torch.randn(st.conv[:, 0].shape, generator=g) * 3
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return done

    clean, dirty = run(False), run(True)
    assert dirty["r2"] != clean["r2"]
    assert {k: v for k, v in dirty.items() if k != "r2"} == {k: v for k, v in clean.items() if k != "r2"}


def test_slots_come_back_after_many_admissions_aborts_and_preemptions(tiny_models):
    """Forty requests through four slots, some aborted while running, under a pool small enough to preempt: two
    running sequences never share a slot, and at the end every slot is free."""
    llm = make(tiny_models["qwen3.5"], max_num_seqs=4, num_kv_blocks=6, max_model_len=64, max_num_batched_tokens=20)
    eng = llm.engine
    for i in range(40):
        p = [3 + (i * 7 + j * 3) % 200 for j in range(1 + (i * 13) % 50)]
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1 + i % 9))
    steps = 0
    while eng.has_unfinished():
        steps += 1
        running = eng.scheduler.running
        taken = [r.state_slot for r in running]
        assert len(set(taken)) == len(taken) and all(0 <= s < 4 for s in taken)
        waiting = [r.state_slot for r in eng.scheduler.waiting]
        assert all(s == -1 for s in waiting)  # preempted or not started: no slot held
        if steps % 7 == 0 and running:
            eng.abort(running[0].request_id.split("#")[0])
        eng.step()
    assert_slots_free(llm)
    assert eng.scheduler.num_preemptions > 0


def test_n_siblings_and_a_repeated_prompt_share_nothing(tiny_models):
    """Prefix caching is off for hybrids (a linear layer's state is per sequence, not per block): a repeated prompt
    finds no cached blocks, and n > 1 siblings each compute their prompt, all with HF's tokens."""
    path = tiny_models["qwen3.5"]
    ref = hf_greedy(path, PROMPTS[4:5], 8)
    llm = make(path)
    params = SamplingParams(temperature=0, max_tokens=8, n=2)
    for _ in range(2):
        out = generate(llm, PROMPTS[4:5], params)[0]
        assert [c.token_ids for c in out.outputs] == [ref[0][0]] * 2
    stats = llm.engine.stats()
    assert stats["prefix_cache_queried_tokens"] == stats["prefix_cache_hit_tokens"] == 0  # never even looked up
    assert_slots_free(llm)


def test_what_hybrids_refuse(tiny_models):
    path = tiny_models["qwen3-next"]
    with pytest.raises(ConfigError, match="speculative decoding is not supported") as e:
        make(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert e.value.field == "speculative_config"
    with pytest.raises(ConfigError, match="LoRA is not supported") as e:
        make(path, enable_lora=True)
    assert e.value.field == "enable_lora"
    from engine.parallel import shard

    spec = ModelSpec.from_hf(json.loads((path / "config.json").read_text()))
    shard.check(spec, 2)  # one key head a rank (TP=2 parity: tests/test_tp.py)
    with pytest.raises(ConfigError, match="2 linear-attention key heads are not divisible by 4"):
        shard.check(spec, 4)


def test_a_vision_language_checkpoint_serves_its_language_model(tiny_models, tmp_path):
    """Qwen3.5 ships as Qwen3_5ForConditionalGeneration: the text config nested, the language model's tensors under
    model.language_model, a vision tower beside. The language model loads (the tower and an MTP head skipped)."""
    from safetensors.torch import load_file, save_file

    src = tiny_models["qwen3.5"]
    cfg = json.loads((src / "config.json").read_text())
    vl = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": cfg,
          "vision_config": {"depth": 1}, "tie_word_embeddings": False}  # fmt: skip
    dst = tmp_path / "vl"
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(vl))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (dst / f.name).write_bytes(f.read_bytes())
    text = load_file(src / "model.safetensors")
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in text.items()}
    tensors |= {"model.visual.blocks.0.attn.qkv.weight": torch.zeros(3, 3), "mtp.fc.weight": torch.zeros(2, 2)}
    save_file(tensors, dst / "model.safetensors")
    assert_hf(generate(make(dst), PROMPTS[:3]), hf_greedy(src, PROMPTS[:3], GREEDY.max_tokens), "vision-language")


def test_fused_experts_load(tiny_models, tmp_path):
    """transformers 5 can save the experts fused (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]), as
    Qwen3.5-MoE's checkpoints ship: they load as per-expert tensors, with HF's tokens."""
    import transformers

    src = tiny_models["qwen3.5-moe"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    dst = tmp_path / "fused"
    model.save_pretrained(str(dst), save_original_format=False)
    for f in src.glob("tok*"):
        (dst / f.name).write_bytes(f.read_bytes())
    from safetensors import safe_open

    with safe_open(dst / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    assert_hf(generate(make(dst), PROMPTS[:3]), hf_greedy(src, PROMPTS[:3], GREEDY.max_tokens), "fused experts")


def test_config_defaults_and_a_vision_language_config():
    """Unset, partial_rotary_factor is 0.25 and Qwen3-Next's norm_topk_prob true (transformers' defaults); a
    vision-language config's quantization_config (top level) reaches the text model's spec."""
    base = {k: v for k, v in QWEN3_NEXT_80B.items() if k not in ("partial_rotary_factor", "norm_topk_prob")}
    spec = ModelSpec.from_hf(base)
    assert spec.rotary_dim == 64 and spec.norm_topk_prob
    vl = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": base | {"architectures": None},
          "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}  # fmt: skip
    spec = ModelSpec.from_hf(vl)
    assert spec.architecture == "Qwen3_5MoeForCausalLM" and spec.quant is not None and spec.quant.kind == "fp8"


QWEN3_NEXT_80B = {  # Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (the fields the engine reads)
    "architectures": ["Qwen3NextForCausalLM"], "decoder_sparse_step": 1, "full_attention_interval": 4,
    "head_dim": 256, "hidden_size": 2048, "intermediate_size": 5120, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [],
    "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512,
    "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2, "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06, "rope_theta": 10000000, "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
}  # fmt: skip


def test_the_planner_on_qwen3_next_80b():
    """fp8 weights (QUANTIZATION=fp8) at max_model_len 32768: 79.7 B parameters (3.9 B active); each sequence's
    state is 36 linear layers x (32 x 128 x 128 fp32 + 8192 x 3 bf16) = 73.7 MiB. An 80 GiB card cannot hold the
    weights (75.3 GiB of its 72 GiB budget); a 141 GB one holds them with 128 sequences' states (9.2 GiB) and KV
    for 43 contexts; 256 sequences' states leave KV for 30. Two 80 GiB cards (TENSOR_PARALLEL_SIZE=2) hold half of
    everything each (the state pool too: each rank's heads), with KV for 73 contexts."""
    from warmup.plan import make_plan, render

    spec = ModelSpec.from_hf(QWEN3_NEXT_80B)
    assert 79e9 < spec.num_params() < 80e9 and 3.8e9 < spec.num_active_params() < 3.95e9
    assert spec.state_bytes_per_seq(2) == 36 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    plan = dict(quantization="fp8", max_model_len=32768)
    small = make_plan(spec, 80 * 2**30, max_num_seqs=128, **plan)
    assert not small["fits"] and "weights take 75.25 GiB" in small["error"]
    assert "9.21 GiB for 128 sequences' linear-attention state" in small["error"]
    big = make_plan(spec, 141 * 10**9, max_num_seqs=128, **plan)
    assert big["fits"] and big["state_bytes"] == 128 * spec.state_bytes_per_seq(2)
    assert 43 <= big["max_concurrent_seqs"] < 44, big
    more = make_plan(spec, 141 * 10**9, max_num_seqs=256, **plan)
    assert 30 <= more["max_concurrent_seqs"] < 31 and more["kv_tokens"] < big["kv_tokens"]
    assert "state pool 9.21 GiB (128 sequences x 73.7 MiB)" in render(spec, big, 141 * 10**9, 0.9)
    graphs = make_plan(spec, 141 * 10**9, max_num_seqs=128, enforce_eager=False, **plan)  # + a spare slot, planned
    assert graphs["state_bytes"] == 129 * spec.state_bytes_per_seq(2)
    two = make_plan(spec, 80 * 2**30, max_num_seqs=128, tensor_parallel_size=2, **plan)  # each rank: half the heads
    assert two["fits"] and two["state_bytes"] == big["state_bytes"] // 2 and 73 <= two["max_concurrent_seqs"] < 74


@pytest.mark.slow  # a whole engine under the Triton interpreter
def test_the_triton_path_matches_hf(tiny_models):
    """The Triton kernels (forced, under the interpreter): the conv, the recurrent rule and the gated norm over the
    state pool, in prefill chunks of 8 tokens with decodes beside them, give HF's tokens."""
    path = tiny_models["qwen3-next"]
    prompts = PROMPTS[:4]
    ref = hf_greedy(path, prompts, 6)
    llm = make(path, kernel_backend="triton", max_num_batched_tokens=8)
    assert llm.engine.runner.state.on_device is False  # CPU tensors: the slot indices stay host lists
    assert_hf(generate(llm, prompts, SamplingParams(temperature=0, max_tokens=6, logprobs=3)), ref, "triton")
    assert_slots_free(llm)


@pytest.mark.slow  # a whole engine under the Triton interpreter
def test_cuda_graph_steps_over_the_state_pool(tiny_models):
    """Decode steps replayed from graphs (the sync-checking stand-in): each sequence's state slot comes from the
    graph's static buffer, padding sequences write into the spare slot, and a one-token prompt's first step (at
    position 0, in a graph) starts from a cleared slot: HF's tokens."""
    from tests.graph_standin import SyncCheckedGraph

    path = tiny_models["qwen3.5"]
    prompts = [PROMPTS[5], PROMPTS[0], PROMPTS[2]]  # 1, 3 and 17 tokens
    ref = hf_greedy(path, prompts, 6)
    llm = make(path, kernel_backend="triton", max_num_seqs=4)
    graphs = llm.engine.runner.enable_graphs(SyncCheckedGraph)
    assert llm.engine.runner.state.spare == 4
    llm.engine.runner.state.rec[:, :4] = 1.0  # stale states a new sequence must not see
    assert_hf(generate(llm, prompts, SamplingParams(temperature=0, max_tokens=6, logprobs=3)), ref, "graphs")
    assert graphs.replays >= 5 and graphs.captured[:3] == [1, 2, 4]
    assert_slots_free(llm)


def test_fp8_kv_calibrates_the_attention_layers_only(tiny_models, caplog):
    """KV_CACHE_DTYPE=fp8: the calibration forward runs through the linear layers from a scratch state, and the
    logged scale range is the attention layers' (the linear layers have no KV)."""
    import logging

    with caplog.at_level(logging.INFO, logger="engine.kv_cache"):
        llm = make(tiny_models["qwen3-next"], kv_cache_dtype="fp8")
    assert "fp8 KV scales calibrated" in caplog.text and "k 1e-06" not in caplog.text
    outs = generate(llm, PROMPTS[:3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5, 5]
    assert_slots_free(llm)
