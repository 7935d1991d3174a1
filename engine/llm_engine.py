"""LLMEngine: the model, KV pool, scheduler and output processor. `step()` = schedule, run, update, outputs."""

from __future__ import annotations

import logging
import threading
import time

import torch

from engine import memory
from engine.block_manager import BlockManager
from engine.builders import EngineBuilders
from engine.config import EngineConfig
from engine.cuda_graphs import IdleWork, cuda_graph_factory
from engine.device import check_fp8_support, cuda_driver_version, gpu_line
from engine.errors import InvalidRequestError
from engine.kv_cache import allocate
from engine.model_runner import ModelRunner
from engine.output import OutputProcessor
from engine.parallel.group import TPGroup, backend_for
from engine.scheduler import Scheduler
from engine.structured import StructuredOutputs
from engine.timeline import Timeline
from engine.types import LoRARequest, Request, RequestOutput, SamplingParams
from engine.weights import load_model

log = logging.getLogger("engine")


class LLMEngine(EngineBuilders):
    def __init__(self, cfg: EngineConfig, timeline: Timeline | None = None):
        t0 = time.perf_counter()
        self.cfg = cfg
        # cold-start phases; the worker passes its own (counting from process start) and adds ready/first token
        self.timeline = tl = timeline or Timeline()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self._threads_before = None
        if not cfg.num_threads and cfg.tensor_parallel_size > 1 and not torch.cuda.is_available():
            self._threads_before = torch.get_num_threads()  # given back at shutdown
            torch.set_num_threads(max(1, self._threads_before // cfg.tensor_parallel_size))  # ranks share the cores
        self.device = torch.device(
            cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # Triton launches on the current device, not the tensors'
        # triton on CUDA; on CPU only when forced (it then needs TRITON_INTERPRET=1, as the tests set)
        self.kernel_backend = (
            cfg.kernel_backend
            if cfg.kernel_backend != "auto"
            else ("triton" if self.device.type == "cuda" else "torch")
        )
        tl.mark("engine setup")
        self._resolve_model()
        if self.device.type == "cuda":  # configs read, nothing loaded yet
            idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
            props = torch.cuda.get_device_properties(idx)
            cap = (props.major, props.minor)
            log.info("%s", gpu_line(props.name, cap, props.total_memory, torch.version.cuda, cuda_driver_version()))
            check_fp8_support(cfg, self.spec.prequantized, props.name, cap)
        tl.mark("model resolution", str(self.model_path))
        self.kv_dtype = torch.float8_e4m3fn if cfg.kv_cache_dtype.startswith("fp8") else self.dtype
        self.memory = self._plan_memory(loaded=False)  # refuses what cannot fit, before anything is allocated
        self.max_model_len = self.memory.max_model_len  # the model's rope tables are built for this length
        self.tp_group = None
        if self.tp > 1:  # the other ranks start and load their shards while this one loads its own
            self.tp_group = TPGroup(cfg, self.device, self.max_model_len)
            tl.mark("tensor-parallel ranks", f"{self.tp} ranks, {backend_for(self.device)}")
        try:
            self.model, self.weights = load_model(
                cfg, self.model_path, self.spec.prequantized, self._build_model, self.device, self.dtype
            )
            if self.tp_group is not None:
                self.tp_group.expect("loaded", timeout_s=3600)
            tl.mark(self.weights.phase, self.weights.note())
            if self.device.type == "cuda":
                self.memory = self._plan_memory(loaded=True)  # from the memory measured now, weights resident
                self.max_model_len = self.memory.max_model_len
            kv = allocate(self.rank_spec, self.memory, self.kv_dtype, self.device)
            if self.tp_group is not None:  # the same pool on every rank (its own heads), and the same scales rule
                self.tp_group.send(("setup", self.memory, self._calibration_ids()))
            tl.mark("KV allocation", f"{self.memory.num_blocks} blocks, {self.memory.kv_bytes / 2**20:.0f} MiB")
            self.lora = self._build_lora()
            self.runner = ModelRunner(
                self.model,
                kv,
                self._build_attention(),
                cfg.block_size,
                self.device,
                self.kernel_backend,
                self.lora,
                max_num_seqs=cfg.max_num_seqs,
                max_model_len=self.max_model_len,
                vocab_size=self.spec.vocab_size,
            )
            if self.tp_group is not None:
                self.runner.tp = self.tp_group
                self.tp_group.expect("ready", timeout_s=600)
            if self.graphs_enabled:  # captured later, in the idle gaps after ready
                self.runner.enable_graphs(cuda_graph_factory())
            elif not cfg.enforce_eager:  # asked for and not possible here: say so once, at start
                log.warning("ENFORCE_EAGER=false is ignored: %s; decode steps run eagerly", self.graphs_unusable)
            # On CUDA the Triton variants a step can need are compiled in the idle gaps after ready, not mid-request
            self.idle = IdleWork(self.runner, warm_kernels=self.device.type == "cuda" and self.tp == 1)
            self.block_manager = BlockManager(self.memory.num_blocks, cfg.block_size)
            self.scheduler = Scheduler(
                self.block_manager,
                cfg.max_num_seqs,
                cfg.max_num_batched_tokens,
                self.max_model_len,
                cfg.long_prefill_token_threshold,
                can_start=self.lora.can_start if self.lora is not None else None,
            )
            self.speculator = self._build_speculator()
            self.output = OutputProcessor(self.tok, self.eos_token_ids, self.scheduler.finish)
            self._structured: StructuredOutputs | None = None
            self._structured_lock = threading.Lock()
            self.num_generated_tokens = 0
            # Nothing optional before the first job: no profiling run (the KV pool is sized by formula) and no
            # kernel warmup before ready (it runs in the idle gaps after, into TRITON_CACHE_DIR on the volume).
            tl.skip(
                "kernel warmup",
                f"after ready, in idle gaps: {len(self.idle.warm_shapes)} padding-only steps compile the Triton "
                "variants"
                if self.kernel_backend == "triton"
                else "torch kernels on CPU: nothing to compile",
            )
            self._log_ready(time.perf_counter() - t0)
        except BaseException as e:
            if self.tp_group is not None:  # no rank outlives a failed start
                fault = self.tp_group.fault(f"the start failed: {e!r}")
                if isinstance(e, RuntimeError):  # a collective: the fault names the rank that died
                    raise fault from e
            raise

    @property
    def structured(self) -> StructuredOutputs:
        """Grammar-constrained decoding (engine/structured.py), made on first use: a worker that never serves a
        constrained request never builds it."""
        with self._structured_lock:  # the event loop (compile) and the engine thread (add_request) may race here
            if self._structured is None:
                self._structured = StructuredOutputs.of(self.tok, self.spec.vocab_size, self.eos_token_ids)
                self.runner.structured = self._structured
        return self._structured

    @property
    def graphs_enabled(self) -> bool:
        """CUDA graphs for decode steps: ENFORCE_EAGER=false, on CUDA, with the Triton kernels, on one GPU."""
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
    def tokenize(self, prompt: str | dict | list[int]) -> list[int]:
        """Prompt text or {"prompt_token_ids": [...]} -> validated token ids."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise InvalidRequestError("a dict prompt needs 'prompt_token_ids'", field="prompt")
            ids = list(prompt["prompt_token_ids"])
        elif isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone UTF-16 surrogate ("\ud800") from a JSON escape
                raise InvalidRequestError(
                    f"the prompt is not valid Unicode text: {e.reason} at character {e.start}", field="prompt"
                ) from None
            ids = self.tok.encode(prompt)
        else:
            raise InvalidRequestError(f"prompt must be a str or a dict, not {type(prompt).__name__}", field="prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", field="prompt")
        if not all(isinstance(t, int) and 0 <= t < self.spec.vocab_size for t in ids):
            raise InvalidRequestError(
                f"prompt_token_ids must be ints in [0, {self.spec.vocab_size})", field="prompt_token_ids"
            )
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len} and at least one "
                f"token must be generated",
                field="prompt",
            )
        return ids

    def resolve_lora(self, lora: LoRARequest):
        """Validate a request's adapter (name, bucket, ...) before it is queued; raises InvalidRequestError."""
        if self.lora is None:
            raise InvalidRequestError("this worker does not serve LoRA adapters; set ENABLE_LORA=true", field="lora")
        return self.lora.resolve(lora.name, lora.s3_uri)

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone, against this engine; raises InvalidRequestError."""
        if params.n > self.cfg.max_num_seqs:  # n sequences must fit one batch (and n loops run on this thread)
            raise InvalidRequestError(
                f"n={params.n} is more than this worker runs at once (max_num_seqs={self.cfg.max_num_seqs})", field="n"
            )
        bad = [t for t in params.stop_token_ids if t >= self.spec.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.spec.vocab_size})",
                field="stop_token_ids",
            )
        bad = [t for t in params.logit_bias or () if t >= self.spec.vocab_size]
        if bad:  # vLLM's input processor refuses these too (_validate_logit_bias)
            raise InvalidRequestError(
                f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {self.spec.vocab_size})",
                field=f"logit_bias.{bad[0]}",
            )

    def add_request(
        self,
        request_id: str,
        prompt: str | dict | list[int],
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        lora: LoRARequest | None = None,
    ) -> None:
        if request_id in self.output.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already running", field="request_id")
        self.check_params(params)
        lora_key = self.lora.request(self.resolve_lora(lora)) if lora is not None else None
        ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt)
        # Prefix caching keys blocks by this (adapters never share KV); with caching off, n > 1 siblings
        # still share the prompt's blocks
        key = ("lora", lora_key) if lora_key else ("base",)
        if not self.cfg.enable_prefix_caching:
            key = key + ("n", request_id) if params.n > 1 else ()
        if params.prompt_logprobs is not None:  # every prompt token is computed (cached KV has no logits)
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
        failed = self._fail_lora_waiters() if self.lora is not None else []
        spec = self.speculator
        if spec is not None:
            spec.before_schedule(self.scheduler.running)
        scheduled = self.scheduler.schedule()
        if scheduled.empty:
            return failed
        if spec is not None:
            spec.propose(scheduled)  # a draft model runs here, over every speculating sequence at once
        try:
            sampled, logprobs = self.runner.execute(scheduled)
        except BaseException as e:  # under TP the ranks may now be out of step: stop them all, say which died
            if self.tp_group is None:
                raise
            why = f"a collective failed: {e}" if isinstance(e, RuntimeError) else f"a step was interrupted: {e!r}"
            fault = self.tp_group.fault(why)
            if isinstance(e, Exception):
                raise fault from e
            raise
        if self._structured is not None:
            self._structured.accept(sampled)
        self.scheduler.update(scheduled, sampled)
        if spec is not None:
            spec.after_update(scheduled, sampled)
        outs = self.output.process(sampled, logprobs)
        self.num_generated_tokens += sum(len(o.delta_token_ids) for out in outs for o in out.outputs)
        return failed + outs

    def _fail_lora_waiters(self) -> list[RequestOutput]:
        """Requests whose adapter failed to load, or not in time: finished with the error, alone."""
        errors = self.lora.failed_waiters(self.scheduler.waiting)
        failed = {
            self.output.group_of[r].request_id: errors[r.lora_key]
            for r in self.scheduler.waiting
            if r.lora_key in errors
        }
        outs = []
        for rid, err in failed.items():
            group = self.output.groups[rid]
            self.abort(rid)
            outs.append(RequestOutput(rid, group.prompt_token_ids, [], True, error=err))
        return outs

    def shutdown(self) -> None:
        """Stop background work (adapter loads); the engine is not used after this."""
        if self.lora is not None:
            self.lora.shutdown()
        if self._structured is not None:
            self._structured.shutdown()
        if self.tp_group is not None:
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
            "num_generated_tokens": self.num_generated_tokens,
            "max_model_len": self.max_model_len,
            **bm.stats(),
            **(self.lora.stats() if self.lora else {}),
            **(self.speculator.stats() if self.speculator else {}),
        }

    def lora_names(self) -> list[str]:
        """Adapters this worker knows: configured in LORA_MODULES, or requested so far."""
        return self.lora.names() if self.lora is not None else []
