"""LLMEngine: owns the model, KV pool, scheduler and detokenizers. `step()` = schedule, run, postprocess."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.kv_cache import CALIBRATION_TEXT, KVCapacity, allocate, calibrate_kv_scales, plan_capacity
from engine.layers.attention import TorchAttention, TritonAttention
from engine.loader import iter_weights, read_json, resolve_model_path, safetensors_files
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM, ModelSpec
from engine.scheduler import Scheduler
from engine.tokenizer import Tokenizer
from engine.types import CompletionOutput, LoRARequest, Request, RequestMetrics, RequestOutput, SamplingParams

from warmup.timeline import Timeline  # generic; python -m warmup times its steps with it too

log = logging.getLogger("engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(eq=False)
class _Group:
    """One user request: n sequences sharing a prompt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer]
    sent_tokens: list[int] = field(default_factory=list)  # per seq: token ids already reported


class LLMEngine:
    def __init__(self, cfg: EngineConfig, timeline: Timeline | None = None):
        t0 = time.perf_counter()
        self.cfg = cfg
        # cold-start phases; the worker passes its own (counting from process start) and adds ready/first token
        self.timeline = tl = timeline or Timeline()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.device = torch.device(cfg.device if cfg.device != "auto" else
                                   ("cuda" if torch.cuda.is_available() else "cpu"))
        tl.mark("engine setup")
        self.model_path = resolve_model_path(cfg)
        safetensors_files(self.model_path)  # refuse pickle-only checkpoints before anything else
        hf_cfg = read_json(self.model_path / "config.json")
        self.spec = ModelSpec.from_hf(hf_cfg, read_json(self.model_path / "generation_config.json"))
        self.dtype = _DTYPES.get(cfg.dtype, torch.bfloat16)
        if cfg.dtype == "auto" and self.device.type == "cuda" and hf_cfg.get("torch_dtype") == "float16":
            self.dtype = torch.float16

        self.tok = Tokenizer(cfg.tokenizer or self.model_path)  # Rust; transformers only if asked for
        eos = set(self.spec.eos_token_ids)
        if self.tok.eos_token_id is not None:
            eos.add(self.tok.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        tl.mark("model resolution", str(self.model_path))

        weight_bytes = self.spec.num_params() * (1 if cfg.quantization == "fp8" else
                                                 torch.tensor([], dtype=self.dtype).element_size())
        self.kv_dtype = torch.float8_e4m3fn if cfg.kv_cache_dtype.startswith("fp8") else self.dtype
        self.capacity: KVCapacity = plan_capacity(cfg, self.spec, self.kv_dtype, self.device, weight_bytes)
        self.max_model_len = self.capacity.max_model_len
        self.model = LlamaForCausalLM(self.spec, self.dtype, self.device, self.max_model_len, cfg.quantization)
        self.weights_source = self._load_weights()
        tl.mark({"checkpoint": "weight read", "fp8 checkpoint": "weight read (fp8 checkpoint)",
                 "fp8 snapshot": "fp8 snapshot load", "checkpoint, quantized online": "weight read + fp8 "
                 "quantization"}[self.weights_source], self._weights_note())
        kv = allocate(self.spec, self.capacity, self.kv_dtype, self.device)
        tl.mark("KV allocation", f"{self.capacity.num_blocks} blocks, "
                                 f"{self.capacity.num_tokens * self.capacity.bytes_per_token / 2**20:.0f} MiB")
        # triton on CUDA; on CPU only when forced (it then needs TRITON_INTERPRET=1, as the tests set)
        self.kernel_backend = cfg.kernel_backend if cfg.kernel_backend != "auto" else \
            ("triton" if self.device.type == "cuda" else "torch")
        attn_cls = TritonAttention if self.kernel_backend == "triton" else TorchAttention
        attn = attn_cls(cfg.block_size, self.spec.head_dim ** -0.5)
        if self.kv_dtype == torch.float8_e4m3fn:
            attn.set_kv_scales(*self._kv_scales())
            tl.mark("fp8 KV scales")
        self.runner = ModelRunner(self.model, kv, attn, cfg.block_size, self.device, self.kernel_backend)
        self.block_manager = BlockManager(self.capacity.num_blocks, cfg.block_size)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   self.max_model_len, cfg.long_prefill_token_threshold)
        self.lora = None
        if cfg.enable_lora:
            from engine.lora.manager import LoRAManager  # boto3 and friends only when LoRA is on

            self.lora = self.runner.lora = LoRAManager(cfg, self.spec, self.dtype, self.device)
            self.scheduler.can_start = self._lora_slot_ready
        self._groups: dict[str, _Group] = {}
        self._group_of: dict[Request, _Group] = {}
        self.num_generated_tokens = 0
        # Nothing optional before the first job: no profiling run (the KV pool is sized by formula) and no
        # kernel warmup (Triton compiles on first use, into TRITON_CACHE_DIR, which lives on the volume).
        tl.skip("kernel warmup", "Triton compiles on first use into TRITON_CACHE_DIR" if
                self.kernel_backend == "triton" else "torch kernels on CPU: nothing to compile")
        other = plan_capacity(cfg.replace(num_kv_blocks=None), self.spec,
                              self.dtype if self.kv_dtype != self.dtype else torch.float8_e4m3fn, self.device,
                              weight_bytes) if cfg.num_kv_blocks is None else None
        log.info("model %s (%s, %s) on %s in %.1fs; %s [KV %s]%s", self.model_path, self.spec.architecture,
                 str(self.dtype).removeprefix("torch."), self.device, time.perf_counter() - t0,
                 self.capacity.describe(), str(self.kv_dtype).removeprefix("torch."),
                 f"; with KV {'fp8' if self.kv_dtype == self.dtype else 'auto'} it would be {other.num_tokens} "
                 f"tokens, {other.max_concurrent_seqs:.1f} sequences" if other else "")

    def _load_weights(self) -> str:
        """Stream the checkpoint in; with fp8, prefer (or else write) the quantized snapshot on the volume."""
        cfg = self.cfg
        if self.spec.prequantized or cfg.quantization != "fp8":
            self.model.load_weights(iter_weights(self.model_path, self.device))
            return "fp8 checkpoint" if self.spec.prequantized else "checkpoint"
        from warmup import fp8_snapshot  # snapshots are worker preparation, kept with warmup/

        snap = fp8_snapshot.snapshot_for(cfg, self.model_path)
        self.snapshot_path = snap
        if (manifest := fp8_snapshot.complete(snap)) is not None:
            hash_ok = fp8_snapshot.verify_in_background(snap, manifest)  # overlaps the load
            try:
                self.model.load_snapshot(fp8_snapshot.load(snap, self.device))
                error = None
            except Exception as e:  # noqa: BLE001 - a damaged file or header: rebuild, as for a bad hash
                error = f"{type(e).__name__}: {e}"  # not the exception: its traceback would keep the model alive
            if hash_ok() and error is None:
                log.info("fp8 weights from snapshot %s", snap)
                return "fp8 snapshot"
            if error is not None:
                log.warning("fp8 snapshot %s could not be loaded: %s", snap, error)
            # drop everything the snapshot put into the model (weights, scales): none of it is ever used
            self.model = None  # freed before the new one is allocated
            self.model = LlamaForCausalLM(self.spec, self.dtype, self.device, self.max_model_len, cfg.quantization)
        rejected = snap.exists()
        if rejected:
            log.warning("fp8 snapshot %s is corrupt or partial: ignoring it and rebuilding", snap)
        self.model.load_weights(iter_weights(self.model_path, self.device))
        try:
            fp8_snapshot.write(snap, self.model.snapshot_state(), str(self.model_path), replace=rejected)
        except OSError as e:  # a read-only or full volume costs the next cold start, not this one
            log.warning("could not write the fp8 snapshot %s: %s", snap, e)
        return "checkpoint, quantized online"

    def _weights_note(self) -> str:
        """What the weight phase read, for the timeline."""
        if self.weights_source == "fp8 snapshot":
            files = [p for p in self.snapshot_path.iterdir() if p.suffix == ".safetensors"]
        else:
            files = safetensors_files(self.model_path)
        return f"{sum(f.stat().st_size for f in files) / 2**20:.0f} MiB read"

    def _kv_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8 KV scales: from the checkpoint when every layer has them, else calibrated now."""
        ck = self.model.checkpoint_kv_scales
        if len(ck) == self.spec.num_layers and all(set(v) == {"k", "v"} for v in ck.values()):
            log.info("fp8 KV scales from the checkpoint")
            k = torch.tensor([ck[i]["k"] for i in range(self.spec.num_layers)], device=self.device)
            v = torch.tensor([ck[i]["v"] for i in range(self.spec.num_layers)], device=self.device)
            return k, v
        ids = self.tok.encode(CALIBRATION_TEXT)[: self.max_model_len]
        return calibrate_kv_scales(self.model, ids, self.device)

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
                raise InvalidRequestError(f"the prompt is not valid Unicode text: {e.reason} at character "
                                          f"{e.start}", field="prompt") from None
            ids = self.tok.encode(prompt)
        else:
            raise InvalidRequestError(f"prompt must be a str or a dict, not {type(prompt).__name__}",
                                      field="prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", field="prompt")
        if not all(isinstance(t, int) and 0 <= t < self.spec.vocab_size for t in ids):
            raise InvalidRequestError(f"prompt_token_ids must be ints in [0, {self.spec.vocab_size})",
                                      field="prompt_token_ids")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len} and at least one "
                f"token must be generated", field="prompt")
        return ids

    def resolve_lora(self, lora: LoRARequest):
        """Validate a request's adapter (name, bucket, ...) before it is queued; raises InvalidRequestError."""
        if self.lora is None:
            raise InvalidRequestError("this worker does not serve LoRA adapters; set ENABLE_LORA=true", field="lora")
        return self.lora.resolve(lora.name, lora.s3_uri)

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone, against this engine; raises InvalidRequestError."""
        if params.n > self.cfg.max_num_seqs:  # n sequences must fit one batch (and n loops run on this thread)
            raise InvalidRequestError(f"n={params.n} is more than this worker runs at once (max_num_seqs="
                                      f"{self.cfg.max_num_seqs})", field="n")
        bad = [t for t in params.stop_token_ids if t >= self.spec.vocab_size]
        if bad:
            raise InvalidRequestError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, "
                                      f"{self.spec.vocab_size})", field="stop_token_ids")

    def add_request(self, request_id: str, prompt: str | dict | list[int], params: SamplingParams,
                    prompt_token_ids: list[int] | None = None, lora: LoRARequest | None = None) -> None:
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already running", field="request_id")
        self.check_params(params)
        lora_key = self.lora.request(self.resolve_lora(lora)) if lora is not None else None
        ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt)
        seqs, detoks = [], []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(self.device).manual_seed(params.seed + i)
            seqs.append(Request(request_id if params.n == 1 else f"{request_id}#{i}", ids, params,
                                eos_token_ids=self.eos_token_ids, generator=gen))
            detoks.append(IncrementalDetokenizer(self.tok, ids, params.stop,
                                                 params.include_stop_str_in_output, params.skip_special_tokens))
        # Prefix caching keys blocks by this (adapters never share KV); with caching off, n > 1 siblings
        # still share the prompt's blocks
        key = ("lora", lora_key) if lora_key else ("base",)
        if not self.cfg.enable_prefix_caching:
            key = key + ("n", request_id) if params.n > 1 else ()
        for s in seqs:
            s.cache_key, s.lora_key = key, lora_key
        group = _Group(request_id, ids, params, seqs, detoks, [0] * params.n)
        self._groups[request_id] = group
        for s in seqs:
            self._group_of[s] = group
            self.scheduler.add(s)

    def abort(self, request_id: str) -> bool:
        """Finish every sequence of the request and free its blocks now. False if unknown."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for s in group.seqs:
            self.scheduler.finish(s, "abort")
            self._group_of.pop(s, None)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    # ---- the step ---------------------------------------------------------------------------
    def _lora_slot_ready(self, req: Request) -> bool:
        """Scheduler gate: a request starts once its adapter sits in a device slot."""
        if req.lora_key is None:
            return True
        pinned = {r.lora_slot for r in self.scheduler.running if r.lora_key is not None}
        slot = self.lora.acquire(req.lora_key, pinned)
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def _fail_lora_waiters(self) -> list[RequestOutput]:
        """Requests whose adapter failed to load, or not in time: finished with the error, alone."""
        failed: dict[str, _Group] = {}
        errors: dict[str, Exception] = {}
        for req in self.scheduler.waiting:
            if req.lora_key is not None and req.lora_key not in self.lora.slot_of:
                err = errors.get(req.lora_key) or self.lora.status(req.lora_key, req.arrival_time)
                if err is not None:
                    errors[req.lora_key] = err
                    failed[self._group_of[req].request_id] = self._group_of[req]
        outs = []
        for rid, group in failed.items():
            self.abort(rid)
            err = errors[group.seqs[0].lora_key]
            outs.append(RequestOutput(rid, group.prompt_token_ids, [], True, error=err))
        for key in errors:
            self.lora.forget_failed(key)
        return outs

    def step(self) -> list[RequestOutput]:
        failed = self._fail_lora_waiters() if self.lora is not None else []
        out = self.scheduler.schedule()
        if out.empty:
            return failed
        sampled, logprobs = self.runner.execute(out)
        for req, lp in logprobs.items():
            req.logprobs.append(lp)
        self.scheduler.update(out, sampled)
        self.num_generated_tokens += len(sampled)
        now = time.monotonic()
        for req in sampled:
            if req.first_token_time is None:
                req.first_token_time = now
            else:
                gap = now - req.last_token_time
                req.itl_sum += gap
                req.itl_max = max(req.itl_max, gap)
            req.last_token_time = now

        touched: dict[_Group, None] = {}
        for req, token in sampled.items():
            group = self._group_of[req]
            touched[group] = None
            p = req.params
            hidden = (token in self.eos_token_ids and p.skip_special_tokens) or \
                (req.stop_reason == token and not p.include_stop_str_in_output)
            stop_str = group.detoks[group.seqs.index(req)].add_token(token, emit=not hidden)
            if stop_str is not None and not req.finished:
                self.scheduler.finish(req, "stop")
                req.stop_reason = stop_str
        return failed + [self._output(g) for g in touched]

    def _output(self, group: _Group) -> RequestOutput:
        outs = []
        for i, (seq, detok) in enumerate(zip(group.seqs, group.detoks)):
            new_ids = seq.output_token_ids[group.sent_tokens[i]:]
            group.sent_tokens[i] = len(seq.output_token_ids)
            outs.append(CompletionOutput(
                index=i, text=detok.text, token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                delta_text=detok.pop_delta(seq.finished), delta_token_ids=new_ids))
        finished = all(s.finished for s in group.seqs)
        if finished:
            self._groups.pop(group.request_id, None)
            for s in group.seqs:
                self._group_of.pop(s, None)
        return RequestOutput(group.request_id, group.prompt_token_ids, outs, finished,
                             sum(s.num_preemptions for s in group.seqs),
                             RequestMetrics.of(group.seqs, time.monotonic()) if finished else None)

    def stats(self) -> dict:
        bm, sch = self.block_manager, self.scheduler
        return {"num_free_blocks": bm.num_free_blocks, "num_total_blocks": bm.num_blocks,
                "kv_usage": bm.usage(), "running": len(sch.running), "waiting": len(sch.waiting),
                "num_preemptions": sch.num_preemptions, "num_generated_tokens": self.num_generated_tokens,
                "max_model_len": self.max_model_len, **bm.stats(), **(self.lora.stats() if self.lora else {})}

    def lora_names(self) -> list[str]:
        """Adapters this worker knows: configured in LORA_MODULES, or requested so far."""
        return self.lora.names() if self.lora is not None else []
