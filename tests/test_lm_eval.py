"""lm-eval-harness against the emulator, as its README runs an OpenAI-compatible server: the `local-completions`
model (token-id prompts, batched, echo + logprobs + max_tokens=1, its defaults) on a tiny multiple-choice task
written here (no hub data): every question's obvious answer has the highest loglikelihood, and batch_size=4 scores
what batch_size=1 does.

Why not bit-equal: with batch_size=4 four prompts share each engine step, so the linear layers run on a different
number of rows and the attention on a padded batch; float32 sums then round differently in the last bits. Summed
over a continuation's tokens, that moved a loglikelihood by at most 1.3e-5 here (2026-12, 2-core CPU), so the test
allows 1e-4; the choice each question makes is the same."""

from __future__ import annotations

import json
import time

import pytest

from bench.procs import Emulator, emulator_env

pytestmark = pytest.mark.slow  # lm-eval-harness against the emulator

DOCS = [
    ("The capital of France is", [" Berlin", " Paris", " Banana"], 1),
    ("The capital of Germany is", [" Berlin", " Madrid", " Pencil"], 0),
    ("One, two, three, four,", [" seven", " banana", " five"], 2),
    ("Monday, Tuesday,", [" Wednesday", " January", " Paris"], 0),
    ("The sun rises in the", [" west", " east", " fridge"], 1),
    ("Water is made of hydrogen and", [" oxygen", " cheese", " iron"], 0),
]


@pytest.fixture(scope="module")
def emu(smollm2_path):
    env = emulator_env(
        MODEL_NAME=str(smollm2_path),
        DTYPE="float32",
        MAX_MODEL_LEN="512",
        OPENAI_SERVED_MODEL_NAME_OVERRIDE="smol",
    )
    e = Emulator(env)
    yield e
    e.close()


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """A multiple-choice task over a local JSON-lines file (datasets' packaged "json" builder: nothing to fetch)."""
    data = tmp_path_factory.mktemp("lm_eval") / "obvious.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in DOCS))
    return {
        "task": "obvious_answers",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "question",
        "doc_to_choice": "choices",
        "doc_to_target": "answer",
        "target_delimiter": "",  # each choice starts with its own space
        "metric_list": [{"metric": "acc"}],
    }


def _run(emu, smollm2_path, task, batch_size: int) -> tuple[dict, list[list[float]]]:
    """(the task's results, each doc's loglikelihood per choice)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": "smol",
            "base_url": f"{emu.base_url}/completions",
            "tokenizer": str(smollm2_path),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "max_retries": 1,
        },
        tasks=[task],
        task_manager=TaskManager(include_defaults=False),  # indexing lm-eval's thousands of tasks takes seconds
        batch_size=batch_size,
        log_samples=True,
    )
    samples = sorted(out["samples"]["obvious_answers"], key=lambda s: s["doc_id"])
    return out["results"]["obvious_answers"], [[r[0][0] for r in s["resps"]] for s in samples]


def test_local_completions_batched_loglikelihoods(emu, smollm2_path, task, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    def jobs() -> int:  # requests that reached the worker so far
        return sum(" started (in flight" in line for line in list(emu.lines))

    def settled(before: int, want: int) -> int:  # the count once the emulator's log has been read up to date
        deadline = time.monotonic() + 5
        while jobs() - before < want and time.monotonic() < deadline:
            time.sleep(0.05)
        return jobs() - before

    before = jobs()
    results, batched = _run(emu, smollm2_path, task, 4)
    asked = sum(len(c) for _, c, _ in DOCS)  # one loglikelihood request per choice
    assert settled(before, -(-asked // 4)) == -(-asked // 4)  # 4 prompts a request
    for (question, choices, answer), lls in zip(DOCS, batched, strict=True):
        best = max(range(len(choices)), key=lls.__getitem__)
        assert best == answer, (question, dict(zip(choices, lls)))
    assert results["acc,none"] == 1.0
    before = jobs()
    _, single = _run(emu, smollm2_path, task, 1)
    assert settled(before, asked) == asked
    diff = max(abs(a - b) for x, y in zip(batched, single, strict=True) for a, b in zip(x, y, strict=True))
    print(f"largest loglikelihood difference, batch_size 4 vs 1: {diff:.2e}")
    assert diff <= 1e-4
