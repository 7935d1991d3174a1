"""What rank 0 sends the other tensor-parallel ranks: block tables as deltas (a decode step's descriptor is O(batch)
whatever the context, and a rank's DeviceBlockTable writes only new entries), LoRA parts as bytes (no tensor through
/dev/shm), NCCL joined eagerly; a message that cannot be pickled or written fails the engine naming the rank instead
of leaving rank 0 waiting in a collective."""

from __future__ import annotations

import pickle
import time
import types

import pytest
import torch

from engine import EngineFault, SamplingParams
from engine.block_table import DeviceBlockTable
from engine.parallel import rank as rank_mod
from engine.parallel.tables import TableMirror, TableSender
from tests.test_tp import GREEDY, assert_same, engine, generate
from tests.utils import build_tiny_model


def roundtrip(sender: TableSender, mirror: TableMirror, tables: list[list[int]]) -> tuple[list[list[int]], int]:
    """One step through a pipe: the mirror's tables, and the delta's pickled size."""
    blob = pickle.dumps(sender.delta(tables), protocol=pickle.HIGHEST_PROTOCOL)
    return mirror.tables(pickle.loads(blob)), len(blob)


def test_table_deltas_rebuild_each_table_and_keep_its_list():
    sender, mirror = TableSender(keep_steps=2), TableMirror()
    a, b, c = list(range(100, 400)), list(range(500, 800)), [7]
    got, _ = roundtrip(sender, mirror, [a, b])
    assert got == [a, b]
    first = got[0]
    device = DeviceBlockTable(4, 512, torch.device("cpu"))
    device.update(got)
    written = device.entries_written
    sizes = []
    for step in range(6):  # decode steps: a grows by one block now and then; b, c stay
        if step % 2:
            a.append(1000 + step)
        got, size = roundtrip(sender, mirror, [a, b, c])
        sizes.append(size)
        assert got == [a, b, c] and got[0] is first  # the same list, extended: the incremental path applies
        device.update(got)
    assert device.entries_written - written == 3 + 1  # a's three new blocks, c once: not 600 entries a step
    assert max(sizes) < 200  # three short rows, whatever the tables' length (the whole tables: over 1 kB)
    b = b[:10]  # trimmed after rejected drafts: a new list, sent whole
    a.pop()  # cut in place, which the BlockManager never does: still sent whole rather than wrong
    got, _ = roundtrip(sender, mirror, [b, c, a, a])  # rows move; a twice
    assert got == [b, c, a, a] and got[2] is got[3]
    for _ in range(3):  # c is skipped for a while, then forgotten on both sides
        assert roundtrip(sender, mirror, [a, b])[0] == [a, b]
    assert len(mirror._tables) == len(sender._known) == 2
    c.append(8)
    assert roundtrip(sender, mirror, [c, a])[0] == [c, a]


def test_ranks_join_nccl_eagerly_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(rank_mod.dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    rank_mod.join_group(torch.device("cuda"), "file:///x", 1, 2, 30)
    rank_mod.join_group(torch.device("cpu"), "file:///x", 1, 2, 30)
    assert calls[0][0] == "nccl" and calls[0][1]["device_id"] == torch.device("cuda", 1)
    assert calls[1][0] == "gloo" and "device_id" not in calls[1][1]


def test_lora_parts_travel_as_bytes():
    from engine import ModelSpec
    from engine.lora.manager import LoRASlots

    hf = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    }  # fmt: skip
    direct, sent = (LoRASlots(2, 4, ModelSpec.from_hf(hf), torch.bfloat16, torch.device("cpu")) for _ in range(2))
    a = {k: torch.randn(v.shape[0], *v.shape[2:]).to(torch.bfloat16) for k, v in direct.a.items()}
    b = {k: torch.randn(v.shape[0], *v.shape[2:]).to(torch.bfloat16) for k, v in direct.b.items()}
    direct.load(1, a, b)
    blob = LoRASlots.pack(a, b)
    assert type(blob) is bytes  # nothing for torch's pickler to put in a shared-memory segment
    sent.load_bytes(1, pickle.loads(pickle.dumps(blob)))
    for lin in a:
        assert torch.equal(direct.a[lin], sent.a[lin]) and torch.equal(direct.b[lin], sent.b[lin])


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    wide = dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=4, intermediate_size=256)
    return build_tiny_model(tmp_path_factory.mktemp("tpmsg") / "llama", "llama", max_position_embeddings=2048, **wide)


@pytest.mark.slow
def test_decode_descriptor_does_not_grow_with_the_context(long_model):
    """TP=2 gives TP=1's tokens at a long context, and its decode steps' forward descriptors are as small as at a
    short one: 4 sequences of ~1500 tokens hold ~380 blocks, which whole tables would add every step."""
    short = [[3 + i, 4 + i, 5 + i] * 6 for i in range(4)]
    long = [[(7 * i + j) % 300 + 3 for j in range(1500)] for i in range(4)]
    kw = dict(num_kv_blocks=512, block_size=16, max_num_batched_tokens=2048)
    with engine(long_model, **kw) as one:
        ref_short, ref_long = generate(one, short), generate(one, long)
    with engine(long_model, 2, **kw) as llm:
        group, sizes = llm.engine.tp_group, []
        real = group.send

        def send(msg):
            before = group.sent_bytes["forward"]
            real(msg)
            if msg[0] == "forward" and set(msg[1].tokens_per_seq) == {1} and len(msg[1].seq_lens) == 4:
                sizes.append((max(msg[1].seq_lens), group.sent_bytes["forward"] - before))

        group.send = send
        assert_same(ref_short, generate(llm, short))
        at_short = max(n for ctx, n in sizes if ctx < 100)
        assert_same(ref_long, generate(llm, long))
        at_long = max(n for ctx, n in sizes if ctx > 1500)
    assert len(sizes) >= 2 * (GREEDY.max_tokens - 2)
    assert at_long <= at_short + 64, (at_short, at_long)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["pickle", "writer"])
def test_a_message_that_cannot_be_sent_fails_the_engine(long_model, monkeypatch, where):
    """A non-OSError while pickling (rank 0's thread) or writing (the rank's writer thread) fails the next step
    with a fault naming the rank and the error, fast, and leaves no rank running."""
    import engine.parallel.group as group_mod

    with engine(long_model, 2) as llm:
        e = llm.engine
        e.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=50, ignore_eos=True))
        e.step()
        if where == "pickle":

            def dumps(msg, protocol=None):
                raise ValueError("simulated pickling failure")

            monkeypatch.setattr(group_mod, "pickle", types.SimpleNamespace(dumps=dumps, HIGHEST_PROTOCOL=5))
            match = "could not pickle a 'forward' message: ValueError"
        else:

            def send_bytes(payload):
                raise ValueError("simulated write failure")

            e.tp_group.conns[0].send_bytes = send_bytes
            match = "rank 1.*could not be written: ValueError"
        t = time.monotonic()
        with pytest.raises(EngineFault, match=match):
            for _ in range(5):
                e.step()
        monkeypatch.undo()
        assert time.monotonic() - t < 10
        assert not any(p.is_alive() for p in e.tp_group.procs)
