"""LLMEngine: the model, KV pool, scheduler and output processor. `step()` = schedule, propose, run, update,
outputs."""

from __future__ import annotations

import functools
import logging
import time

import torch

from engine import faults, memory, pooling, startup
from engine.config import EngineConfig
from engine.cpu_threads import claim_threads
from engine.errors import InvalidRequestError
from engine.intake import Intake, ValidRequest
from engine.lora.manager import LoRAManager
from engine.output import OutputProcessor
from engine.parallel.group import start_ranks
from engine.sampler import Sampler
from engine.spec_decode.speculator import start_speculation
from engine.step_runner import EMPTY, StepInput, StepRunner
from engine.structured import StructuredOutputs
from engine.timeline import Timeline
from engine.types import LoRARequest, Request, RequestOutput, SamplingParams, SchedulerOutput, StepOutput

log = logging.getLogger("engine")


class LLMEngine:
    def __init__(self, cfg: EngineConfig, timeline: Timeline | None = None):
        """The cold start, each part handed to the next (engine/startup.py). Its phases are marked on `timeline`: the
        worker passes its own (counting from process start) and adds ready and first token."""
        t0 = time.perf_counter()
        self.cfg = cfg
        self.timeline = tl = timeline or Timeline()
        tl.mark("engine setup")
        self.facts = facts = startup.resolve(cfg)  # the config files alone: no weight read yet
        self._threads_before = claim_threads(cfg, facts.device)  # given back at shutdown
        plan = startup.device_plan(cfg, facts)  # refuses what cannot fit, before anything is allocated
        self.kv_prefault, kv = startup.early_pool(cfg, facts, plan)  # CPU: faulting in while the tokenizer loads
        startup.start_cpu(cfg, facts)  # CPU: its C kernels build while the weights load
        self.tok, self.eos_token_ids = startup.open_tokenizer(cfg, facts)
        tl.mark("model resolution", str(facts.path))
        # the other tensor-parallel ranks load their shards while this one loads its own
        self.tp_group = start_ranks(cfg, facts.device, plan.max_model_len, tl)
        with self.tp_group.starting():  # no rank outlives a failed start
            model, self.weights = startup.load_rank(cfg, facts, plan.max_model_len, lambda: tl.mark("model build"))
            self.tp_group.expect("loaded", timeout_s=3600)
            tl.mark(self.weights.phase, self.weights.note())
            self.memory = plan = startup.device_plan(cfg, facts, loaded_len=plan.max_model_len)  # CUDA: measured now
            calibration = startup.calibration_ids(facts, model, self.tok, plan.max_model_len)
            self.tp_group.send(("setup", plan, calibration))  # every rank: the same pool (of its heads), same scales
            self.runner = startup.build_rank(cfg, facts, model, plan, calibration, self.kv_prefault, kv)
            tl.mark("KV allocation", startup.pool_note(plan, self.kv_prefault))
            self.lora = LoRAManager(cfg, facts.spec, self.runner.lora, self.tp_group) if cfg.enable_lora else None
            self.tp_group.expect("ready", timeout_s=600)
            self.block_manager = startup.block_manager(cfg, plan, self.kv_prefault)  # CPU: an open region, grown
            self.speculator = start_speculation(cfg, facts, plan, self.block_manager, self.tok, tl, self.kv_prefault)
            self.scheduler = startup.scheduler(cfg, facts, plan, self.block_manager, self.lora, self.speculator)
            self.intake = Intake(self.tok, facts.spec.vocab_size, plan.max_model_len, cfg, model.generates)  # each once
            self.structured = StructuredOutputs(self.tok, facts.spec.vocab_size, self.eos_token_ids)  # imports nothing
            self.step_runner = StepRunner(self.tp_group.wrap(self.runner), Sampler(facts.spec.vocab_size, facts.device))
            self.output = OutputProcessor(self.tok, self.eos_token_ids, self.scheduler.finish, self.speculator.k)
            self.injector, self.ooms, self.num_failed_nan = faults.injector(cfg.fault_injection), faults.OomHistory(), 0
            self.idle = startup.idle_work(cfg, facts, self.runner, self.structured, self.speculator.draft, self.tok)
            tl.skip("kernel warmup", _warmup_note(facts.kernel_backend, len(self.idle.warm_shapes)))
            startup.log_ready(cfg, facts, plan, time.perf_counter() - t0)

    # ---- what the start found (engine/startup.py's ModelFacts and MemoryPlan) ----------------------------------
    spec = property(lambda self: self.facts.spec, doc="the whole model's ModelSpec")
    rank_spec = property(lambda self: self.facts.rank_spec, doc="the shapes rank 0 holds")
    draft_spec = property(lambda self: self.facts.draft_spec)
    model_path = property(lambda self: self.facts.path)
    device = property(lambda self: self.facts.device)
    dtype = property(lambda self: self.facts.dtype)
    kv_dtype = property(lambda self: self.facts.kv_dtype)
    kernel_backend = property(lambda self: self.facts.kernel_backend)
    max_model_len = property(lambda self: self.memory.max_model_len, doc="the planned context length")
    model = property(lambda self: self.runner.model, doc="rank 0's model")

    @property
    def graphs_enabled(self) -> bool:
        """CUDA graphs for decode and verify steps (and a draft model's): ENFORCE_EAGER=false, on CUDA, with the Triton
        kernels, on one GPU."""
        return memory.cuda_graphs(self.cfg, self.device.type, self.kernel_backend)  # the planner's rule too

    @property
    def graphs_unusable(self) -> str | None:
        """Why CUDA graphs cannot run on this engine (None: they can)."""
        return memory.graphs_unusable(self.cfg, self.device.type, self.kernel_backend)

    @property
    def weights_source(self) -> str:
        """How the weights came in: "checkpoint", "fp8 checkpoint", "fp8 snapshot", "checkpoint, quantized online"."""
        return self.weights.source

    @property
    def tokenizer(self):
        """transformers' tokenizer (as vLLM's get_tokenizer()), loaded on the first call. The engine itself uses
        `tok` (engine/tokenizer.py), which needs no transformers."""
        return self.tok.hf

    # ---- requests ---------------------------------------------------------------------------
    def validate(
        self,
        prompt: str | dict | ValidRequest,
        params: SamplingParams | None = None,
        lora: LoRARequest | None = None,
    ) -> ValidRequest:
        """Tokenize, check against this engine and resolve the adapter, once; raises InvalidRequestError."""
        return self.intake.validate(prompt, params, lora)

    @functools.cached_property
    def model_pooling(self) -> pooling.ModelPooling:
        """How the checkpoint says to pool an embedding: its sentence-transformers files, else a decoder's default."""
        return pooling.model_pooling(self.facts.path)

    def tokenize(self, prompt: str | dict) -> list[int]:
        """Prompt text or {"prompt_token_ids": [...]} -> validated token ids."""
        return self.intake.tokenize(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | dict | ValidRequest,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        lora: LoRARequest | None = None,
    ) -> None:
        """Queue a request. A ValidRequest is trusted as it is; anything else is validated first (prompt_token_ids,
        when given, stands for the prompt)."""
        if request_id in self.output.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already running", field="request_id")
        if prompt_token_ids is not None:
            prompt = {"prompt_token_ids": prompt_token_ids}
        valid = self.validate(prompt, params, lora)
        ids, params = valid.prompt_token_ids, valid.params
        lora_key = self.lora.request(valid.lora) if valid.lora is not None else None
        # Prefix caching keys blocks by this (adapters never share KV); with caching off, n > 1 siblings
        # still share the prompt's blocks
        key = ("lora", lora_key) if lora_key else ("base",)
        if not self.cfg.enable_prefix_caching:
            key = key + ("n", request_id) if params.n > 1 else ()
        if params.prompt_logprobs is not None:  # every prompt token is computed (cached KV has no logits)
            key = ()
        if params.pooling is not None and pooling.needs_every_position(params.pooling):  # ... or hidden states
            key = ()
        if self.facts.spec.hybrid:  # no KV sharing at all: a linear layer's state is per sequence (state_cache.py)
            key = ()
        seqs = []
        for i in range(params.n):
            gen = torch.Generator(self.device).manual_seed(params.seed + i) if params.seed is not None else None
            seq = Request(
                request_id if params.n == 1 else f"{request_id}#{i}",
                ids,
                params,
                eos_token_ids=self.eos_token_ids,
                generator=gen,
            )
            seq.cache_key, seq.lora_key = key, lora_key
            if params.structured_outputs is not None:  # each sequence its own matcher (compiled once, cached)
                seq.matcher = self.structured.matcher(params.structured_outputs)
                seq.grammar_after = params.structured_outputs.after
            seqs.append(seq)
        self.output.add(request_id, ids, params, seqs)
        for s in seqs:
            self.scheduler.add(s)

    def abort(self, request_id: str) -> bool:
        """Finish every sequence of the request and free its blocks now. False if unknown."""
        group = self.output.pop(request_id)
        for s in group.seqs if group is not None else ():
            self.scheduler.finish(s, "abort")
        return group is not None

    def abort_all(self) -> list[str]:
        """Abort every request (after an engine fault); returns their ids."""
        ids = list(self.output.groups)
        for rid in ids:
            self.abort(rid)
        return ids

    def has_unfinished(self) -> bool:
        return bool(self.output.groups)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        injected = self.injector.next_step() if self.injector is not None else frozenset()
        scheduled = self.scheduler.schedule()
        try:
            result = self._execute(scheduled, injected)
        except Exception as e:
            # anything else is a fault: the engine cannot be trusted after it (AsyncEngine's rule); so is an OOM under
            # tensor parallelism, where the other ranks may wait in a collective of the step that failed
            if not faults.is_oom(e) or self.cfg.tensor_parallel_size > 1:
                raise
            scheduled, result = self._after_oom(scheduled, e)
        scheduled.failed.update(result.failed)  # rows with NaN logits: those requests fail, the others go on
        self.num_failed_nan += len(result.failed)
        self.scheduler.update(scheduled, result.tokens)
        return self.output.process(scheduled, result)

    def _execute(self, scheduled: SchedulerOutput, injected: frozenset[str] = frozenset()) -> StepOutput:
        """The device part of a step, which changes no request: an error here leaves the step to roll back."""
        drafts = self.speculator.propose(scheduled)  # a draft model runs here, over every speculating sequence
        grammar = self.structured.masks(scheduled.sampling, drafts.tokens)
        return self.step_runner.execute(StepInput(scheduled, drafts, grammar), injected)

    def _after_oom(self, scheduled: SchedulerOutput, e: BaseException) -> tuple[SchedulerOutput, StepOutput]:
        """The step ran out of memory and computed nothing. Retry it once with the batch halved (its newest half
        preempted by recompute, the token budget halved for a while: Scheduler.halve); if the retry runs out too,
        its largest request fails, saying what would fit, and the rest wait for the next step. Every block of
        what did not run goes back to the pool. Returns what ran (or only the failures) and its output."""
        self.ooms.record()
        log.warning("a step of %d requests (%d tokens) ran out of memory: %s; retrying with the batch halved",
                    len(scheduled.requests), scheduled.total_tokens, e)  # fmt: skip
        faults.free_cached_memory(self.device)
        self.scheduler.halve(scheduled)
        retry = self.scheduler.schedule()
        retry.failed.update(scheduled.failed)  # refused at admission by the first attempt: still to report
        try:
            return retry, self._execute(retry)
        except Exception as e2:
            if not faults.is_oom(e2):
                raise
            faults.free_cached_memory(self.device)
            self.scheduler.halve(retry, preempt=False)
            largest = max(retry.requests, key=lambda r: _footprint(r, retry))
            log.warning("the halved retry ran out of memory too: %s fails", largest.request_id)
            retry.failed[largest] = faults.did_not_fit(retry.total_tokens, largest)
            return SchedulerOutput([], [], failed=retry.failed), EMPTY

    @property
    def unhealthy(self) -> str | None:
        """Why this engine should be replaced although it still runs (steps kept running out of memory)."""
        return self.ooms.unhealthy

    def shutdown(self) -> None:
        """Stop background work (adapter loads); the engine is not used after this."""
        if self.lora is not None:
            self.lora.shutdown()
        self.structured.shutdown()
        self.tp_group.shutdown()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)

    def stats(self) -> dict:
        bm, sch = self.block_manager, self.scheduler
        return {
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_blocks,
            "kv_usage": bm.usage(),
            "running": len(sch.running),
            "waiting": len(sch.waiting),
            "num_preemptions": sch.num_preemptions,
            "num_failed_nan": self.num_failed_nan,
            "num_oom_steps": self.ooms.count,
            "max_model_len": self.max_model_len,
            **bm.stats(),
            **self.output.stats(),  # num_generated_tokens; speculation's acceptance
            **(self.lora.stats() if self.lora else {}),
        }

    def lora_names(self) -> list[str]:
        """Adapters this worker knows: configured in LORA_MODULES, or requested so far."""
        return self.lora.names() if self.lora is not None else []


def _footprint(req: Request, out: SchedulerOutput) -> tuple:
    """What a request's part of a step costs in activations: prompt logprobs first (a vocabulary-wide row per prompt
    token), then its tokens times its n."""
    n = out.num_scheduled_tokens[out.requests.index(req)]
    return req.params.prompt_logprobs is not None, n * req.params.n


def _warmup_note(kernel_backend: str, shapes: int) -> str:
    """Nothing optional runs before the first job: no profiling run (the KV pool is sized by formula) and no kernel
    warmup before ready (it runs after, into TRITON_CACHE_DIR on the volume: engine/cuda_graphs.py's IdleWork)."""
    if kernel_backend == "triton":
        return f"after ready, idle or busy: {shapes} padding-only steps compile the Triton variants"
    return "torch kernels on CPU: nothing to compile"
