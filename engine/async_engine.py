"""AsyncEngine: one background thread runs the step loop; each request streams through its own queue.

The event loop never runs model code. Requests and aborts reach the engine thread through an inbox
that it drains between steps, so only that thread touches LLMEngine state. With no work, the thread
blocks on the inbox instead of spinning, once the work after ready (IdleWork: kernel warm-up, graph captures) is
done; that work runs one piece per idle gap, and between busy steps within its share of the loop's time."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

import torch

from engine.config import EngineConfig
from engine.cpu_threads import ThreadGovernor
from engine.errors import EngineError, EngineFault
from engine.host_memory import memory_breakdown, trim_heap
from engine.intake import ValidRequest
from engine.llm_engine import LLMEngine
from engine.openmp import release_openmp_threads
from engine.timeline import Timeline
from engine.types import LoRARequest, RequestOutput, SamplingParams

TRIM_INTERVAL_S = 2.0  # the heap is given back at most this often, when the loop goes idle (host_memory.trim_heap)
# ... and this often between steps under a load that never lets it go idle. glibc keeps up to 64 MB of free memory
# at the top of each arena before it gives any back by itself, so under load RSS swung by 50-70 MB between trims 30 s
# apart (bench/soak.py). A trim costs 2-5 ms here, and the next large steps fault back in what they need (at about
# 0.5 s/GiB, some 25 ms for 50 MB): about 0.3 % of the time at this interval.
TRIM_BUSY_INTERVAL_S = 10.0
log = logging.getLogger("engine")


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        engine: LLMEngine | None = None,
        timeline: Timeline | None = None,
        idle_held: bool = False,
        **kwargs,
    ):
        """idle_held: the idle work's device pieces wait for release_idle() (IdleWork.held)."""
        self.engine = engine or LLMEngine(config or EngineConfig(**kwargs), timeline)
        self.engine.idle.held = idle_held  # before the loop's thread starts
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stats = self.engine.stats()
        self._closed = False
        self._stalled = False  # the last step ran nothing (requests wait for adapters): poll the inbox briefly
        self.fault: EngineFault | None = None  # set when a step raised or hung; no new work is accepted after
        # called once, from the engine thread or the watchdog's, when the engine faults (the worker stops serving)
        self.on_fault: Callable[[EngineFault], None] | None = None
        self._step_began: float | None = None  # when the running step began (None: between steps)
        self.governor: ThreadGovernor | None = None  # made by the step thread, before __init__ returns
        self._threads = torch.get_num_threads()  # as the engine claimed them (the step thread's start sets its own)
        # the steps' OpenMP regions run on the loop's thread: this (building) thread's pool ends here, or libgomp
        # counts both and its workers sleep between regions instead of spinning (engine/openmp.py). An `engine`
        # passed in was built elsewhere: its builder's thread is that caller's to release.
        release_openmp_threads()
        self._thread = threading.Thread(target=self._loop, name="engine-step-loop", daemon=True)
        self._loop_ready = threading.Event()
        self._thread.start()
        self._loop_ready.wait()  # the step thread's OpenMP team and governor exist (a few ms)
        threading.Thread(target=self._watchdog, name="engine-step-watchdog", daemon=True).start()

    @property
    def tokenizer(self):
        """transformers' tokenizer, loaded on the first call (see LLMEngine.tokenizer)."""
        return self.engine.tokenizer

    @property
    def tok(self):
        """The engine's own tokenizer: encode, decode and apply_chat_template without transformers."""
        return self.engine.tok

    def tokenize(self, prompt: str | dict) -> list[int]:
        """Validated prompt token ids (raises InvalidRequestError), as generate() would compute them."""
        return self.engine.tokenize(prompt)

    def validate(
        self, prompt: str | dict, params: SamplingParams | None = None, lora: LoRARequest | None = None
    ) -> ValidRequest:
        """The request checked once, now (raises InvalidRequestError naming the field): the prompt tokenized and
        within the context, the params within this engine's limits, the adapter resolved. generate() trusts it."""
        return self.engine.validate(prompt, params, lora)

    def release_idle(self) -> None:
        """The worker takes jobs from now on: the held idle pieces may run (idle_held)."""
        self._inbox.put(("release",))

    def warm_later(self, *pieces: Callable[[], object]) -> None:
        """Run `pieces` on the step loop's thread after ready, one per idle gap (IdleWork's host pieces): what a
        later request would otherwise pay for on its own path, kept off the cold start (an import, a compile)."""
        self._inbox.put(("idle", pieces))

    def lora_names(self) -> list[str]:
        return self.engine.lora_names()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_pooling(self):
        """How the checkpoint says to pool an embedding (engine/pooling.py ModelPooling)."""
        return self.engine.model_pooling

    @property
    def architecture(self) -> str:
        """The checkpoint's architecture, as ModelSpec names it (GptOssForCausalLM: handler/harmony.py)."""
        return self.engine.facts.spec.architecture

    @property
    def hidden_size(self) -> int:
        return self.engine.facts.spec.hidden_size

    async def generate(
        self,
        prompt: str | dict | ValidRequest,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield one RequestOutput per step that produced something for this request (deltas in
        `outputs[i].delta_text` / `delta_token_ids`). A ValidRequest (validate()) is trusted as it is; a raw prompt
        is validated first, and invalid input raises before anything runs. Leaving the loop early (break, cancel)
        aborts the request and frees its blocks."""
        if self.fault is not None:
            raise EngineFault(str(self.fault))
        if self._closed:
            raise EngineError("the engine is shut down")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise EngineError(f"request id {request_id!r} is already in use")
        valid = self.engine.validate(prompt, params, lora)
        if valid.params.structured_outputs is not None:  # wait for the grammar here, not on the step loop
            await asyncio.wrap_future(self.engine.structured.compile(valid.params.structured_outputs))
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        self._inbox.put(("add", request_id, valid))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(("abort", request_id, None, False))

    async def abort(self, request_id: str, error: BaseException | None = None, *, with_parts: bool = False) -> None:
        """Abort and wait until the engine thread has freed the request's blocks. With `error`, the request's
        generate() raises it (after the outputs already made) instead of waiting for more. with_parts: also every
        request named "{request_id}/..." (a batched job's other prompts: handler/openai_completions.py)."""
        done = threading.Event()
        self._inbox.put(("abort", request_id, done, with_parts))
        if error is not None:
            self._send(request_id, error)
        # a faulted engine frees nothing (its thread may hang in a step): do not wait for it
        await asyncio.get_running_loop().run_in_executor(None, lambda: _wait_unless(done, lambda: self.fault))

    def stats(self) -> dict:
        return dict(self._stats)

    @property
    def unhealthy(self) -> str | None:
        """Why this worker should be replaced (None: it is healthy): the engine faulted, or its steps keep running
        out of memory while it still serves (engine/faults.py OomHistory)."""
        return str(self.fault) if self.fault is not None else self.engine.unhealthy

    def shutdown(self) -> None:
        self._closed = True
        self._inbox.put(("stop",))
        self._thread.join(timeout=30 if self.fault is None else 1)  # a hung step never returns
        self.engine.shutdown()

    # ---- faults ----------------------------------------------------------------------------
    def _watchdog(self) -> None:
        """A step running past STEP_TIMEOUT_S hung (a kernel, the driver, a collective): every request fails now,
        from this thread, since the engine thread never comes back; the worker then exits (handler/worker.py)."""
        limit = self.engine.cfg.step_timeout_s
        while not self._closed and self.fault is None:
            time.sleep(min(1.0, limit / 4))
            began = self._step_began
            if began is not None and time.monotonic() - began > limit:
                log.error("an engine step has run for %.0f s, past STEP_TIMEOUT_S=%g", time.monotonic() - began, limit)
                why = f"an engine step ran for more than {limit:g} s (STEP_TIMEOUT_S): the device, the driver or a "
                self._faulted(EngineFault(why + "collective hung; send the request again"))
                return

    def _faulted(self, fault: EngineFault) -> None:
        """The engine cannot be trusted any more: fail every request with `fault`, refuse new ones, tell the worker."""
        if self.fault is not None:
            return
        self.fault = fault
        if self.on_fault is not None:  # the worker first: the jobs' errors then find it faulted
            self.on_fault(fault)
        for rid in list(self._streams):
            self._send(rid, fault)

    # ---- engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        eng = self.engine
        try:  # whatever happens here, __init__ stops waiting
            if eng.device.type == "cuda" and eng.device.index is not None:
                torch.cuda.set_device(eng.device)  # per thread: this one launches every kernel of the steps
            # on CPU: this thread's OpenMP team, run on fewer threads while another process holds a core
            governor = ThreadGovernor.for_step_thread(eng.device, eng.cfg.tensor_parallel_size, self._threads)
            self.governor = governor
        finally:
            self._loop_ready.set()
        last_log, last_generated = time.monotonic(), 0
        last_trim, busy_since_trim = time.monotonic(), False
        trims = [0, 0.0, 0]  # count, seconds, bytes returned: for the status line
        while True:
            # Block for work when idle; otherwise just drain what arrived during the last step. When the last
            # step ran nothing (every request waits for an adapter download), wait briefly instead of spinning.
            since = time.monotonic() - last_trim
            trim_in = TRIM_INTERVAL_S - since if busy_since_trim else None
            # the heap's free pages back to the OS: once gone idle after a busy spell, or between steps under a
            # load that never lets the loop go idle
            if busy_since_trim and ((trim_in <= 0 and not eng.has_unfinished()) or since >= TRIM_BUSY_INTERVAL_S):
                took, returned = trim_heap()
                trims = [trims[0] + 1, trims[1] + took, trims[2] + returned]
                last_trim, busy_since_trim, trim_in = time.monotonic(), False, None
            try:
                if not eng.has_unfinished():  # idle: kernel warmup and graph captures first, one piece a gap
                    # (a trim held back by its interval: wake up for it)
                    cmd = self._inbox.get_nowait() if eng.idle.pending else self._inbox.get(timeout=trim_in)
                elif self._stalled:
                    cmd = self._inbox.get(timeout=0.02)
                else:
                    cmd = self._inbox.get_nowait()
            except queue.Empty:
                cmd = None
                if not eng.has_unfinished() and eng.idle.pending:
                    self._step_began = time.monotonic()  # a graph capture or a kernel warm-up can hang as a step can
                    try:
                        eng.idle.step()
                    finally:
                        self._step_began = None
                    if governor is not None:
                        governor.restart()
                    continue
            while cmd is not None:
                if cmd[0] == "stop":
                    if governor is not None:
                        governor.close()
                    return
                self._handle(cmd)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if not eng.has_unfinished():
                self._stats = eng.stats()
                if governor is not None:  # idle: the next busy spell starts a window of its own
                    governor.restart()
                continue
            busy_since_trim = True
            if governor is not None:
                governor.before_step()
            self._step_began = time.monotonic()
            try:
                outputs = eng.step()
            except Exception as e:  # a bug or a device error, not user input: fail everything, promptly
                log.exception("engine step failed; failing %d in-flight requests", len(self._streams))
                eng.abort_all()
                self._faulted(EngineFault(f"engine step failed: {e!r}"))
                continue
            finally:
                self._step_began = None
            if governor is not None:
                governor.after_step()
            self._stats = eng.stats()
            self._stalled = not outputs and not self._stats["running"]
            for out in outputs:
                self._send(out.request_id, out.error if out.error is not None else out)
            # a busy worker warms up too: one piece within its share of the loop, after this step's tokens went out
            self._step_began = time.monotonic()
            if eng.idle.busy() and governor is not None:  # a piece ran: its time is no step's
                governor.restart()
            self._step_began = None
            interval = eng.cfg.log_stats_interval
            if interval and time.monotonic() - last_log >= interval:
                now, s = time.monotonic(), self._stats
                rate = (s["num_generated_tokens"] - last_generated) / (now - last_log)
                last_log, last_generated = now, s["num_generated_tokens"]
                spec = (
                    f", spec acceptance {100 * s['spec_decode_acceptance_rate']:.1f}% "
                    f"(mean length {s['spec_decode_mean_acceptance_length']:.2f})"
                    if "spec_decode_acceptance_rate" in s
                    else ""
                )
                heap = (
                    f", heap given back {trims[0]} times ({trims[2] / trims[0] / 2**20:.1f} MB in "
                    f"{1e3 * trims[1] / trims[0]:.1f} ms on average)"
                    if trims[0]
                    else ""
                )
                log.info(
                    "running %d, waiting %d, KV %.0f%% (%d blocks open), prefix cache hit rate %.1f%%, preemptions %d, "
                    "%.1f tok/s%s%s; memory: %s",
                    s["running"],
                    s["waiting"],
                    100 * s["kv_usage"],
                    s["kv_open_blocks"],
                    100 * s["prefix_cache_hit_rate"],
                    s["num_preemptions"],
                    rate,
                    spec,
                    heap,
                    memory_breakdown(),
                )

    def _handle(self, cmd) -> None:
        if cmd[0] == "add":
            _, rid, valid = cmd
            if rid not in self._streams:  # cancelled before it was added
                return
            if self.fault is not None:
                self._send(rid, EngineFault(str(self.fault)))
                return
            try:
                self.engine.add_request(rid, valid)
            except Exception as e:
                self._send(rid, e)
        elif cmd[0] == "idle":
            self.engine.idle.add(*cmd[1])
        elif cmd[0] == "release":
            self.engine.idle.held = False
        elif cmd[0] == "abort":
            _, rid, done, with_parts = cmd
            for r in [rid, *(k for k in self.engine.output.groups if with_parts and is_part(k, rid))]:
                self.engine.abort(r)
            self._stats = self.engine.stats()
            if done is not None:
                done.set()

    def _send(self, request_id: str, item) -> None:
        entry = self._streams.get(request_id)
        if entry is None:
            return
        loop, q = entry
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed
            self.engine.abort(request_id)


def is_part(request_id: str, of: str) -> bool:
    """Whether request_id is "{of}/{i}": prompt i > 0 of a batched job whose prompt 0 is `of` (handler's naming; a
    job id holding "/" cannot make another job's request look like one)."""
    return request_id.startswith(of + "/") and request_id[len(of) + 1 :].isdigit()


def _wait_unless(done: threading.Event, stop: Callable[[], object]) -> None:
    while not done.wait(0.1) and not stop():
        pass
