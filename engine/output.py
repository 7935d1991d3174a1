"""OutputProcessor: a step's sampled tokens in, RequestOutputs out. It owns what the step loop does not need: the
user requests (n sequences sharing a prompt), their detokenizers and stop strings, and the metrics (latency per
sequence, speculation's acceptance). As in vLLM v1, the engine core only schedules and runs; this turns its tokens
into what a caller sees."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.types import (
    CompletionOutput,
    Request,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
    StepOutput,
)


@dataclass
class SeqStats:
    """One sequence's output-side counters (vLLM's RequestStateStats), in monotonic seconds."""

    first_token_time: float | None = None
    last_token_time: float | None = None
    itl_sum: float = 0.0  # gaps between steps that brought tokens (tokens that arrive together count one gap)
    itl_max: float = 0.0
    # speculative decoding: verification steps, drafts verified, accepted, and accepted at each draft position
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)

    def arrived(self, now: float) -> None:
        if self.first_token_time is not None:
            gap = now - self.last_token_time
            self.itl_sum += gap
            self.itl_max = max(self.itl_max, gap)
        else:
            self.first_token_time = now
        self.last_token_time = now


@dataclass(eq=False)
class ParentRequest:
    """One user request: n sequences sharing a prompt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer]
    stats: list[SeqStats]
    sent_tokens: list[int]  # per seq: token ids already reported
    detok_tokens: list[int]  # per seq: token ids the detokenizer has seen


class SpecCounters:
    """The engine's speculative decoding counters (vLLM's spec_decode metrics)."""

    def __init__(self, k: int):
        self.k = k
        self.num_drafts = 0  # verification runs (a sequence's step with >= 1 draft)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    def verified(self, st: SeqStats, granted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += granted
        self.num_accepted_tokens += accepted
        st.spec_verify_steps += 1
        st.spec_draft_tokens += granted
        st.spec_accepted_tokens += accepted
        if len(st.spec_accepted_per_pos) < self.k:
            st.spec_accepted_per_pos = [0] * self.k
        for j in range(accepted):
            self.accepted_per_pos[j] += 1
            st.spec_accepted_per_pos[j] += 1

    def stats(self) -> dict:
        n, d, a = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {
            "spec_decode_num_drafts": n,
            "spec_decode_num_draft_tokens": d,
            "spec_decode_num_accepted_tokens": a,
            "spec_decode_acceptance_rate": a / d if d else 0.0,
            "spec_decode_mean_acceptance_length": 1 + a / n if n else 0.0,
            "spec_decode_accepted_per_pos": [x / n if n else 0.0 for x in self.accepted_per_pos],
        }


class OutputProcessor:
    def __init__(self, tok, eos_token_ids: frozenset[int], finish: Callable[[Request, str], None], spec_k: int = 0):
        """finish: the scheduler's (a stop string ends a sequence and frees its blocks). spec_k: the number of
        speculative tokens (0: speculative decoding is off)."""
        self.tok = tok
        self.eos_token_ids = eos_token_ids
        self.finish = finish
        self.groups: dict[str, ParentRequest] = {}
        self.group_of: dict[Request, ParentRequest] = {}
        self.spec = SpecCounters(spec_k) if spec_k else None
        self.num_generated_tokens = 0

    def add(self, request_id: str, ids: list[int], params: SamplingParams, seqs: list[Request]) -> None:
        detoks = [
            IncrementalDetokenizer(
                self.tok, ids, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
            )
            for _ in seqs
        ]
        n = len(seqs)
        group = ParentRequest(request_id, ids, params, seqs, detoks, [SeqStats() for _ in seqs], [0] * n, [0] * n)
        self.groups[request_id] = group
        for s in seqs:
            self.group_of[s] = group

    def pop(self, request_id: str) -> ParentRequest | None:
        """Forget a request (aborted or failed); its sequences are the caller's to finish."""
        group = self.groups.pop(request_id, None)
        for s in group.seqs if group is not None else ():
            self.group_of.pop(s, None)
        return group

    def process(self, scheduled: SchedulerOutput, result: StepOutput) -> list[RequestOutput]:
        """After the scheduler's update (which appended each sequence's new tokens, up to a stop): the requests the
        scheduler failed, then for each request that got tokens this step, its timings, acceptance counts and
        logprobs recorded, its tokens detokenized and stop strings applied (a stop string inside a run of accepted
        drafts drops the tokens after it): one output per request."""
        failed = [self._fail(req, err) for req, err in scheduled.failed.items() if req in self.group_of]
        for req, granted in scheduled.spec.items():
            if req in result.tokens and req in self.group_of:  # (a sibling of an n > 1 request that failed: gone)
                group = self.group_of[req]
                self.spec.verified(group.stats[group.seqs.index(req)], granted, len(result.tokens[req]) - 1)
        now = time.monotonic()
        touched: dict[ParentRequest, None] = {}
        for req in result.tokens:
            if req not in self.group_of:  # its request failed this step through a sibling (NaN in the sibling's row)
                continue
            group = self.group_of[req]
            touched[group] = None
            i = group.seqs.index(req)
            new = req.output_token_ids[group.detok_tokens[i] :]
            if req.params.logprobs is not None:
                req.logprobs += result.logprobs.get(req, [])[: len(new)]
            group.stats[i].arrived(now)
            p = req.params
            for j, token in enumerate(new):
                # the token that stopped the sequence (EOS, a stop token id) has no text unless asked for, as in
                # vLLM, also with skip_special_tokens false (the mistral tool parser's)
                ended = j == len(new) - 1 and req.finish_reason == "stop"
                ended = ended and (req.stop_reason == token or (token in req.eos_token_ids and not p.ignore_eos))
                hidden = (token in self.eos_token_ids and p.skip_special_tokens) or (
                    ended and not p.include_stop_str_in_output
                )
                stop_str = group.detoks[i].add_token(token, emit=not hidden)
                # a stop string ends the sequence, unless a stop rule already ended it at this same token; one
                # inside a run of accepted drafts wins over a rule that ended the run at a later token
                if stop_str is not None and (not req.finished or j < len(new) - 1):
                    del req.output_token_ids[group.detok_tokens[i] + j + 1 :]
                    del req.logprobs[len(req.output_token_ids) :]
                    self.finish(req, "stop")
                    req.finish_reason, req.stop_reason = "stop", stop_str
                    break
            group.detok_tokens[i] = len(req.output_token_ids)
        for req in scheduled.requests:  # embeddings sample nothing: their output is the vector, once finished
            if req.params.pooling is not None and req.finished and req in self.group_of:
                touched[self.group_of[req]] = None
        return failed + [self._output(g) for g in touched]

    def _fail(self, req: Request, error: BaseException) -> RequestOutput:
        """The request `req` belongs to, failed with `error`: every sequence finished, one final output."""
        group = self.pop(self.group_of[req].request_id)
        for s in group.seqs:
            self.finish(s, "abort")
        return RequestOutput(group.request_id, group.prompt_token_ids, [], True, error=error)

    def _output(self, group: ParentRequest) -> RequestOutput:
        outs = []
        for i, (seq, detok) in enumerate(zip(group.seqs, group.detoks)):
            new_ids = seq.output_token_ids[group.sent_tokens[i] :]
            group.sent_tokens[i] = len(seq.output_token_ids)
            self.num_generated_tokens += len(new_ids)
            outs.append(
                CompletionOutput(
                    index=i,
                    text=detok.text,
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                    delta_text=detok.pop_delta(seq.finished),
                    delta_token_ids=new_ids,
                )
            )
        finished = all(s.finished for s in group.seqs)
        if finished:
            self.pop(group.request_id)
        return RequestOutput(
            group.request_id,
            group.prompt_token_ids,
            outs,
            finished,
            sum(s.num_preemptions for s in group.seqs),
            metrics(group, time.monotonic()) if finished else None,
            prompt_logprobs=group.seqs[0].prompt_logprobs,
            embedding=group.seqs[0].embedding,
        )

    def stats(self) -> dict:
        return {"num_generated_tokens": self.num_generated_tokens, **(self.spec.stats() if self.spec else {})}


def metrics(group: ParentRequest, now: float) -> RequestMetrics:
    """One request's metrics; n > 1 sequences pool their gaps and count every output token."""
    seqs, stats = group.seqs, group.stats
    arrival = seqs[0].arrival_time
    sched = [s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None]
    firsts = [st.first_token_time for st in stats if st.first_token_time is not None]
    gaps = sum(max(len(s.output_token_ids) - 1, 0) for s in seqs)
    return RequestMetrics(
        queue_time=min(sched) - arrival if sched else None,
        ttft=min(firsts) - arrival if firsts else None,
        mean_itl=sum(st.itl_sum for st in stats) / gaps if gaps else None,
        max_itl=max(st.itl_max for st in stats) if gaps else None,
        e2e_time=now - arrival,
        prompt_tokens=seqs[0].num_prompt_tokens,
        cached_prompt_tokens=seqs[0].num_cached_tokens or 0,
        output_tokens=sum(len(s.output_token_ids) for s in seqs),
        num_preemptions=sum(s.num_preemptions for s in seqs),
        spec_decode=spec_metrics(stats),
    )


def spec_metrics(stats: list[SeqStats]) -> dict | None:
    steps = sum(st.spec_verify_steps for st in stats)
    if not steps:
        return None
    drafted, accepted = sum(st.spec_draft_tokens for st in stats), sum(st.spec_accepted_tokens for st in stats)
    per_pos = [sum(c) for c in zip(*(st.spec_accepted_per_pos for st in stats if st.spec_accepted_per_pos))]
    return {
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "mean_acceptance_length": round(1 + accepted / steps, 4),
        "accepted_per_pos": [round(c / steps, 4) for c in per_pos],
    }
