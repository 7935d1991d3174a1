"""Structured output (engine/structured.py) on the real SmolLM2, which without a grammar rarely emits valid JSON for
a schema: every constrained output parses and validates (jsonschema), under n > 1, chunked prefill and preemption;
regex and choice hold; a grammar that does not compile fails its request alone; unconstrained requests in the same
batch are untouched; prompt logprobs equal HF transformers'. The OpenAI-route tests are in test_structured_api.py."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow  # the real SmolLM2 under grammars

S = StructuredOutputsParams
OBJ = dict(type="object", additionalProperties=False)
# Strings are bounded: a 135M model inside an open string can repeat itself until max_tokens (so can any model
# under vLLM's grammar backends); the grammar guarantees the shape, not that the model ever closes a free string.
SCHEMAS = {
    "person": OBJ
    | dict(
        properties={
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        required=["name", "age"],
    ),
    "nested": OBJ
    | dict(
        properties={
            "address": OBJ
            | dict(
                properties={"street": {"type": "string", "maxLength": 24}, "city": {"type": "string", "maxLength": 16}},
                required=["street", "city"],
            ),
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        },
        required=["address", "tags"],
    ),
    "enum": OBJ | dict(properties={"color": {"enum": ["red", "green", "blue"]}}, required=["color"]),
    "bounded_numbers": OBJ
    | dict(
        properties={
            "scores": {
                "type": "array",
                "items": {"type": "number", "minimum": 0, "maximum": 10},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        required=["scores"],
    ),
    "nullable": OBJ
    | dict(
        properties={"active": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 30}},
        required=["active", "note"],
    ),
    "array_of_objects": OBJ
    | dict(
        properties={
            "items": {
                "type": "array",
                "items": OBJ
                | dict(
                    properties={
                        "id": {"type": "integer", "minimum": 1, "maximum": 99},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    required=["id", "qty"],
                ),
                "minItems": 1,
                "maxItems": 2,
            }
        },
        required=["items"],
    ),
    "int_enum": OBJ | dict(properties={"level": {"type": "integer", "enum": [1, 2, 3]}}, required=["level"]),
    "pattern": OBJ | dict(properties={"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, required=["zip"]),
    "deep": OBJ
    | dict(
        properties={
            "a": OBJ
            | dict(
                properties={"b": OBJ | dict(properties={"c": {"type": "string", "maxLength": 10}}, required=["c"])},
                required=["b"],
            )
        },
        required=["a"],
    ),
    "top_level_array": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "minItems": 1, "maxItems": 3},
    "price": OBJ
    | dict(
        properties={"price": {"type": "number", "minimum": 0.5, "maximum": 99.5}, "currency": {"const": "EUR"}},
        required=["price", "currency"],
    ),
}


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), log_stats_interval=0)


def prompt(llm, what: str) -> str:
    msgs = [{"role": "user", "content": f"Reply with JSON only: {what}"}]
    return llm.engine.tok.apply_chat_template(msgs, add_generation_prompt=True)


def check(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_every_schema_validates(llm):
    names = list(SCHEMAS)
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=S(json=SCHEMAS[n])) for n in names]
    outs = llm.generate([prompt(llm, f"a {n.replace('_', ' ')} example") for n in names], params)
    for n, o in zip(names, outs):
        assert o.outputs[0].finish_reason == "stop", (n, o.outputs[0].text)
        check(o.outputs[0].text, SCHEMAS[n])
    unconstrained = llm.generate(
        prompt(llm, "a person with name and age"), SamplingParams(temperature=0, max_tokens=60)
    )
    text = unconstrained[0].outputs[0].text
    with pytest.raises((ValueError, jsonschema.ValidationError)):  # the grammar is what makes the outputs valid
        check(text, SCHEMAS["person"])


def test_n_chunked_prefill_and_preemption_keep_the_constraint(smollm2_path):
    """n=4 sampled sequences each have their own matcher; a 16-token budget chunks the prompt and a pool of 6 blocks
    of 16 forces recompute preemptions: the matchers stay with the output tokens, so every output validates."""
    llm = LLM(str(smollm2_path), log_stats_interval=0, max_num_batched_tokens=16, num_kv_blocks=6, block_size=16)
    schema = SCHEMAS["array_of_objects"]
    sp = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=60, structured_outputs=S(json=schema))
    out = llm.generate(prompt(llm, "an order"), sp)[0]
    assert llm.engine.scheduler.num_preemptions > 0
    assert len(out.outputs) == 4
    for c in out.outputs:
        check(c.text, schema)


def test_regex_choice_grammar_and_json_object(llm):
    p = prompt(llm, "anything")
    outs = llm.generate(
        [p] * 3 + [prompt(llm, 'an object whose key "ok" is true')],
        [
            SamplingParams(temperature=0.7, seed=1, max_tokens=20, structured_outputs=S(regex=r"[A-Z]{2}-\d{3}")),
            SamplingParams(
                temperature=0.7, seed=2, max_tokens=20, structured_outputs=S(choice=["yes", "no", "maybe so"])
            ),
            SamplingParams(temperature=0, max_tokens=20, structured_outputs=S(grammar='root ::= "a" ("b" | "c")+ "!"')),
            SamplingParams(temperature=0, max_tokens=80, structured_outputs=S(json_object=True)),
        ],
    )
    texts = [o.outputs[0].text for o in outs]
    import re

    assert re.fullmatch(r"[A-Z]{2}-\d{3}", texts[0]), texts[0]
    assert texts[1] in ("yes", "no", "maybe so")
    assert re.fullmatch(r"a[bc]+!", texts[2]), texts[2]
    assert isinstance(json.loads(texts[3]), dict)


def test_a_bad_grammar_fails_only_its_request(llm):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(
            prompt(llm, "x"), SamplingParams(structured_outputs=S(json={"type": "nonsense"}, field="guided_json"))
        )
    assert e.value.field == "guided_json" and "nonsense" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(
            prompt(llm, "x"), SamplingParams(structured_outputs=S(regex="(", field="structured_outputs.regex"))
        )
    assert e.value.field == "structured_outputs.regex"
    out = llm.generate(prompt(llm, "x"), SamplingParams(max_tokens=20, structured_outputs=S(choice=["ok"])))
    assert out[0].outputs[0].text == "ok"  # the engine serves on
    with pytest.raises(InvalidRequestError, match="exactly one"):
        S(json={}, regex="a")


def test_unconstrained_rows_are_untouched(smollm2_path):
    """The same batch with and without constrained neighbours: the unconstrained requests' tokens are identical."""
    llm = LLM(str(smollm2_path), dtype="float32", log_stats_interval=0)
    free = [prompt(llm, "a short poem"), prompt(llm, "a color")]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(free + free, [sp] * 4)
    cons = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, structured_outputs=S(json=SCHEMAS["person"])),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, structured_outputs=S(regex=r"[a-z ]{16}")),
    ]
    mixed = llm.generate(free + free, [sp, sp] + cons)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone[:2]]
    assert [o.outputs[0].token_ids for o in mixed[2:]] != [o.outputs[0].token_ids for o in alone[2:]]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prompt_logprobs_equal_hf(smollm2_path, prefix_caching):
    """fp32, chunked at 8 tokens, twice (the second time the prompt's blocks are in the prefix cache when it is on:
    prompt logprobs recompute them)."""
    from transformers import AutoModelForCausalLM

    ids = [1, 504, 3458, 282, 4649, 314, 1345, 30, 378, 2103, 3200, 12, 16, 28, 1077, 5423, 18, 282, 15, 64, 99]
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    llm = LLM(
        str(smollm2_path),
        dtype="float32",
        log_stats_interval=0,
        enable_prefix_caching=prefix_caching,
        max_num_batched_tokens=8,
    )
    for _ in range(2):
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
        got = out.prompt_logprobs
        assert got[0] is None and len(got) == len(ids)
        for i in range(1, len(ids)):
            assert abs(got[i][ids[i]] - lp[i - 1, ids[i]].item()) < 1e-3
            top = lp[i - 1].topk(3)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(got[i][t] - v) < 1e-3


def test_a_grammar_left_without_tokens_stops_its_sequence_only(llm):
    """min_tokens masks the stop token that a complete grammar leaves as its only choice: that sequence stops there
    (it used to fail the whole step), and the engine serves on."""
    sp = SamplingParams(temperature=0, max_tokens=10, min_tokens=5, structured_outputs=S(choice=["ok"]))
    out = llm.generate(prompt(llm, "x"), sp)[0].outputs[0]
    assert out.text.startswith("ok") and out.finish_reason == "stop"
    again = llm.generate(prompt(llm, "x"), SamplingParams(max_tokens=5, structured_outputs=S(choice=["yes"])))
    assert again[0].outputs[0].text == "yes"
