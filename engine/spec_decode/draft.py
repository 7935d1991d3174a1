"""A draft model: a small model of the target's vocabulary proposes k tokens autoregressively for the whole batch
at once (one forward over every sequence's catch-up tokens, then k - 1 one-token steps, each fed the previous
step's picks on the device).

Its KV pool has the target's block count and block size, and the draft writes each sequence's KV under the
target's own block ids: it needs no block manager, its lookahead slots are the ones the scheduler granted the
target, and rolling back rejected slots is the target's rollback. A block the draft has filled is marked in
the block manager (`draft_ready`, cleared when the block is handed out for new data), so a prefix-cache hit is
skipped by the draft as well.

Greedy sequences get the draft's argmax (q one-hot). Random ones draw from the draft's softmax at the sequence's
temperature, with its generator when seeded, and hand q to verification. The draft runs without the sequence's
LoRA adapter, in the target's dtype, with a KV cache in that dtype. Where the target's steps replay CUDA graphs, so
do the draft's (its own DecodeGraphs and pool, captured with the target's by IdleWork): its one-token steps, and a
catch-up of one or two tokens per sequence (the steady state after a speculating step); a longer catch-up (a
prompt) runs eagerly."""

from __future__ import annotations

import logging
import weakref

import torch

from engine import memory
from engine.block_manager import BlockManager
from engine.block_table import h2d
from engine.config import EngineConfig
from engine.cpu_native import native_dir
from engine.cuda_graphs import cuda_graph_factory
from engine.errors import ConfigError
from engine.kv_cache import Prefaulter, allocate
from engine.layers.attention import build_attention
from engine.memory import MemoryPlan
from engine.model_runner import ModelRunner, flat_batch
from engine.models import model_class
from engine.models.spec import ModelSpec
from engine.sampler import Rows, Sampler
from engine.startup import ModelFacts
from engine.tokenizer import Tokenizer
from engine.types import Request
from engine.weights import iter_weights

log = logging.getLogger("engine")


class DraftProposer:
    def __init__(
        self,
        cfg: EngineConfig,
        facts: ModelFacts,
        plan: MemoryPlan,
        bm: BlockManager,
        tok: Tokenizer,
        prefault: Prefaulter | None = None,
    ):
        """facts: the target's (the draft's checkpoint is facts.draft_path); plan: the target's KV pool, whose block
        ids the draft shares; bm: the target's block manager; tok: the target's tokenizer; prefault: on CPU, the
        target pool's (the draft's pages follow the same open region)."""
        self.path, self.spec = path, s = facts.draft_path, facts.draft_spec
        check_vocab(facts.spec.vocab_size, tok, s, path)
        self.block_size = cfg.block_size
        self.max_tokens = cfg.max_num_batched_tokens  # the most tokens one draft forward takes
        self.bm = bm
        self.device = dev = facts.device
        m = model_class(s)(s, facts.dtype, dev, plan.max_model_len, None)
        m.load_weights(iter_weights(path, dev))
        kv = allocate(s, plan, facts.dtype, dev, prefault)  # the target's block count and size
        attn = build_attention(s, cfg.block_size, facts.kernel_backend, native_dir(cfg, dev))
        # its own graphs (and pool: the planner counts it, memory.engine_needs) wherever the target has graphs
        graphs = cuda_graph_factory() if memory.cuda_graphs(cfg, dev.type, facts.kernel_backend) else None
        self.runner = ModelRunner(
            m, kv, attn, cfg.block_size, dev, facts.kernel_backend, max_num_seqs=cfg.max_num_seqs,
            max_model_len=plan.max_model_len, new_graph=graphs, graph_query_lens=memory.DRAFT_GRAPH_QUERY_LENS,
        )  # fmt: skip
        self.kv_bytes = kv.numel() * kv.element_size()
        # per sequence: the position its draft run started at, the preemption count it ran under, and the drafts it
        # fed back in (their KV is valid as far as the sequence kept them)
        self._computed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.num_catchup_tokens = 0  # tokens of the sequences themselves the draft has run (not its own drafts)
        log.info("draft model %s (%s): %d layers, KV %.0f MiB", path, s.architecture, s.num_layers,
                 self.kv_bytes / 2**20)  # fmt: skip

    def _start(self, req: Request) -> int:
        """The first position whose draft KV is missing: after its last run, and the drafts of that run the sequence
        kept (the run wrote KV for drafts 1..k-1; a rejected draft never equals the token that replaced it, so the
        kept ones are the accepted run); else past the leading blocks some earlier draft run filled (prefix-cache
        hits)."""
        n, pre, fed = self._computed.get(req, (0, -1, ()))
        if pre == req.num_preemptions:
            kept = req.token_slice(n, min(n + len(fed), req.num_tokens))
            return n + next((j for j, (a, b) in enumerate(zip(kept, fed)) if a != b), len(kept))
        bs, ready, full = self.block_size, 0, (req.num_tokens - 1) // self.block_size
        while ready < min(full, len(req.block_ids)) and self.bm.draft_ready[req.block_ids[ready]]:
            ready += 1
        return ready * bs

    @torch.inference_mode()
    def propose(self, reqs: list[Request], ks: list[int]) -> tuple[dict, dict]:
        """ks[i] (>= 1) drafts for reqs[i]. Returns {req: drafts} and {req: q rows [k, vocab]} for sampled drafts.
        Each step's picks stay on the device and are the next step's input ids; all of them come to the host in
        one copy at the end (a copy per draft token would make the host wait for the device at every one)."""
        starts = [self._start(r) for r in reqs]
        probs: dict[Request, list[torch.Tensor]] = {r: [] for r in reqs if not r.params.greedy}
        k_of, last = dict(zip(reqs, ks)), max(ks)
        active, ids, steps = list(reqs), None, []  # steps: (the requests drafting then, their picks on the device)
        for step in range(last):
            if step == 0:  # the tokens the draft has not seen yet, in forwards of at most the step budget
                logits = self._catch_up(reqs, starts)
                for r, s in zip(reqs, starts):
                    self._mark_ready(r, s)
            else:  # one token each: the previous step's pick, at the position after the sequence's last token
                logits = self._last_logits([(r, r.num_tokens + step - 1, [0]) for r in active], ids)
            picks = self._pick(logits, active, probs)
            steps.append((active, picks))
            if step + 1 < last:
                going = Rows.where((k_of[r] > step + 1 for r in active), self.device)
                active, ids = [active[i] for i in going.rows], going.take(picks)
        host = iter(torch.cat([p for _, p in steps]).tolist())  # the one copy to the host
        drafts: dict[Request, list[int]] = {r: [] for r in reqs}
        for drafting, _ in steps:
            for r in drafting:
                drafts[r].append(next(host))
        for r, k in zip(reqs, ks):
            self._computed[r] = (r.num_tokens, r.num_preemptions, drafts[r][: k - 1])
        return drafts, {r: torch.stack(q) for r, q in probs.items()}

    def _catch_up(self, reqs: list[Request], starts: list[int]) -> torch.Tensor:
        """Run the draft over each sequence's unseen tokens (a whole prompt after a prefill), in forwards of at most
        max_num_batched_tokens tokens (a long prompt in several chunks, in order): the logits of each sequence's
        last token, [B, vocab]."""
        pending = [(r, s, r.token_slice(s, r.num_tokens)) for r, s in zip(reqs, starts)]
        self.num_catchup_tokens += sum(len(t) for _, _, t in pending)
        last: dict[Request, torch.Tensor] = {}
        while pending:
            batch, room, rest = [], self.max_tokens, []
            for r, s, toks in pending:
                take = min(len(toks), room) if room > 0 else 0
                if take:
                    batch.append((r, s, toks[:take]))
                    room -= take
                if take < len(toks):
                    rest.append((r, s + take, toks[take:]))
            for (r, _, _), row in zip(batch, self._last_logits(batch)):
                last[r] = row
            pending = rest
        return torch.stack([last[r] for r in reqs])

    def _last_logits(self, items, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The draft over `items` (request, first position, token ids): each one's last token's logits. [B, vocab].
        ids: the items' token ids already on the device (their host ids are then placeholders)."""
        batch = flat_batch(items, self.block_size)
        hidden = self.runner.forward(batch, ids)
        return self.runner.logits(hidden, [e - 1 for e in batch.query_start_loc[1:]])  # fp32

    def _pick(self, logits: torch.Tensor, reqs: list[Request], probs: dict) -> torch.Tensor:
        """Each row's draft token, on the device: the argmax, or for random rows a draw from the softmax at the
        sequence's temperature (its q rows appended to `probs`)."""
        tokens = logits.argmax(dim=-1)
        rand = Rows.where((not r.params.greedy for r in reqs), self.device)
        if rand:
            rr = [reqs[i] for i in rand.rows]
            t = h2d([[r.params.temperature] for r in rr], torch.float32, self.device)
            q = (rand.take(logits) / t).softmax(-1)
            rand.put(tokens, Sampler.race(q, rr))
            for j, r in enumerate(rr):
                probs[r].append(q[j])
        return tokens

    def _mark_ready(self, req: Request, start: int) -> None:
        for b in range(start // self.block_size, req.num_tokens // self.block_size):
            self.bm.draft_ready[req.block_ids[b]] = 1


def check_vocab(target_vocab_size: int, target_tok: Tokenizer, spec: ModelSpec, path) -> None:
    """The draft proposes token ids the target verifies: both must mean the same tokens."""
    if spec.vocab_size != target_vocab_size:
        raise ConfigError(
            f"speculative_config.model={str(path)!r}: the draft's vocabulary has {spec.vocab_size} tokens, the "
            f"target's {target_vocab_size}; a draft model must share the target's tokenizer"
        )
    if (path / "tokenizer.json").exists():
        theirs = Tokenizer(path).backend
        ours = target_tok.backend
        if theirs is not None and ours is not None and theirs.get_vocab() != ours.get_vocab():
            raise ConfigError(
                f"speculative_config.model={str(path)!r}: the draft's tokenizer maps tokens to different ids than "
                "the target's; a draft model must share the target's tokenizer"
            )
