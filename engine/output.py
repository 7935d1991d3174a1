"""OutputProcessor: a step's sampled tokens in, RequestOutputs out. It owns what the step loop does not need: the
user requests (n sequences sharing a prompt), their detokenizers and stop strings, and the latency metrics.
As in vLLM v1, the engine core only schedules and runs; this turns its tokens into what a caller sees."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.types import CompletionOutput, Request, RequestMetrics, RequestOutput, SamplingParams


@dataclass(eq=False)
class Group:
    """One user request: n sequences sharing a prompt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer]
    sent_tokens: list[int] = field(default_factory=list)  # per seq: token ids already reported
    detok_tokens: list[int] = field(default_factory=list)  # per seq: token ids the detokenizer has seen


class OutputProcessor:
    def __init__(self, tok, eos_token_ids: frozenset[int], finish: Callable[[Request, str], None]):
        self.tok = tok
        self.eos_token_ids = eos_token_ids
        self.finish = finish  # the scheduler's: a stop string ends a sequence and frees its blocks
        self.groups: dict[str, Group] = {}
        self.group_of: dict[Request, Group] = {}

    def add(self, request_id: str, ids: list[int], params: SamplingParams, seqs: list[Request]) -> None:
        detoks = [
            IncrementalDetokenizer(
                self.tok, ids, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
            )
            for _ in seqs
        ]
        group = Group(request_id, ids, params, seqs, detoks, [0] * len(seqs), [0] * len(seqs))
        self.groups[request_id] = group
        for s in seqs:
            self.group_of[s] = group

    def pop(self, request_id: str) -> Group | None:
        """Forget a request (aborted or failed); its sequences are the caller's to finish."""
        group = self.groups.pop(request_id, None)
        for s in group.seqs if group is not None else ():
            self.group_of.pop(s, None)
        return group

    def process(self, sampled: dict[Request, list[int]], logprobs: dict[Request, list[dict]]) -> list[RequestOutput]:
        """After the scheduler's update (which appended each sequence's new tokens, up to a stop): record timings and
        logprobs, detokenize, apply stop strings (a stop string inside a run of accepted drafts drops the tokens
        after it), and return one output per request that got tokens this step."""
        now = time.monotonic()
        touched: dict[Group, None] = {}
        for req in sampled:
            group = self.group_of[req]
            touched[group] = None
            i = group.seqs.index(req)
            new = req.output_token_ids[group.detok_tokens[i] :]
            if req.params.logprobs is not None:
                req.logprobs += logprobs.get(req, [])[: len(new)]
            if req.first_token_time is None:
                req.first_token_time = now
            else:  # tokens that arrive together count one gap, for the first of them
                gap = now - req.last_token_time
                req.itl_sum += gap
                req.itl_max = max(req.itl_max, gap)
            req.last_token_time = now
            p = req.params
            for j, token in enumerate(new):
                hidden = (token in self.eos_token_ids and p.skip_special_tokens) or (
                    req.stop_reason == token and j == len(new) - 1 and not p.include_stop_str_in_output
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
        return [self._output(g) for g in touched]

    def _output(self, group: Group) -> RequestOutput:
        outs = []
        for i, (seq, detok) in enumerate(zip(group.seqs, group.detoks)):
            new_ids = seq.output_token_ids[group.sent_tokens[i] :]
            group.sent_tokens[i] = len(seq.output_token_ids)
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
            RequestMetrics.of(group.seqs, time.monotonic()) if finished else None,
            prompt_logprobs=group.seqs[0].prompt_logprobs,
        )
