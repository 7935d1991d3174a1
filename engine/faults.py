"""When the machine fails under the engine (docs/decisions.md, "Faults"): which errors a step may survive, the
out-of-memory history that marks the worker unhealthy, and FAULT_INJECTION, which makes each fault happen on
purpose at a chosen step, through the same path a real one takes. Imports no torch until a step asks."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import deque

from engine.errors import RequestFault

log = logging.getLogger("engine")

KINDS = ("oom", "nan", "hang", "kill")
OOM_LIMIT, OOM_WINDOW_S = 3, 60.0  # this many out-of-memory steps within the window: the worker is unhealthy


def parse_fault_injection(text: str | None) -> tuple[tuple[str, int], ...]:
    """ "oom@3,nan@5" -> (("oom", 3), ("nan", 5)); raises ValueError saying what is wrong. Empty: no faults."""
    plan = []
    for entry in filter(None, (e.strip() for e in (text or "").split(","))):
        kind, at, step = entry.partition("@")
        if kind not in KINDS or not at or not step.isdigit() or int(step) < 1:
            raise ValueError(f"{entry!r} is not KIND@STEP with KIND one of {', '.join(KINDS)} and STEP >= 1")
        plan.append((kind, int(step)))
    return tuple(plan)


class Injector:
    """FAULT_INJECTION's plan. `next_step()` counts engine steps from 1 (the steps after ready: warm-up runs no
    step) and carries out what is due at this one: `hang` blocks the step thread forever (as a hung kernel or
    collective would: the watchdog must notice), `kill` sends this process SIGKILL; `oom` and `nan` are returned for
    the step runner to apply (engine/step_runner.py: the forward pass raises the device's out-of-memory error; row
    0 of the logits becomes NaN). Each entry fires once."""

    def __init__(self, plan: tuple[tuple[str, int], ...]):
        self.plan = list(plan)
        self.step = 0

    def next_step(self) -> frozenset[str]:
        self.step += 1
        due = frozenset(kind for kind, at in self.plan if at == self.step)
        if due:
            log.warning("FAULT_INJECTION: %s at step %d", ", ".join(sorted(due)), self.step)
        if "kill" in due:
            for h in logging.getLogger().handlers:
                h.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if "hang" in due:
            threading.Event().wait()
        return due


def injector(fault_injection: str | None) -> Injector | None:
    """FAULT_INJECTION's Injector; None when it is unset (the step pays nothing)."""
    return Injector(parse_fault_injection(fault_injection)) if fault_injection else None


def injected_oom() -> BaseException:
    """The error a failed device allocation raises: torch.cuda.OutOfMemoryError (on CPU too, where torch has it)."""
    import torch

    return torch.cuda.OutOfMemoryError("FAULT_INJECTION: CUDA out of memory (injected)")


def is_oom(e: BaseException) -> bool:
    """A device or host allocation failed: the step may be retried smaller. Anything else a step raises is a fault
    (the engine cannot be trusted after a CUDA error)."""
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and "can't allocate memory" in str(e)  # CPU: the default allocator's words


def free_cached_memory(device) -> None:
    """Hand the caching allocator's free blocks back before the retry (what fragmentation held)."""
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()


class OomHistory:
    """When the step ran out of memory: OOM_LIMIT times within OOM_WINDOW_S makes the worker unhealthy (the card is
    too small for its traffic, or something leaks); `unhealthy` says why, once set."""

    def __init__(self):
        self.times: deque[float] = deque(maxlen=OOM_LIMIT)
        self.count = 0
        self.unhealthy: str | None = None

    def record(self) -> None:
        now = time.monotonic()
        self.times.append(now)
        self.count += 1
        if len(self.times) == OOM_LIMIT and now - self.times[0] <= OOM_WINDOW_S and self.unhealthy is None:
            self.unhealthy = f"{OOM_LIMIT} steps ran out of device memory within {OOM_WINDOW_S:.0f} s"
            log.error("the worker is unhealthy: %s; it asks to be replaced", self.unhealthy)


def did_not_fit(tokens: int, req) -> RequestFault:
    """The error of a request that ran out of memory again in the halved retry, saying what would fit."""
    p = req.params
    what, field = "a shorter prompt", "prompt"
    if p.prompt_logprobs is not None:
        what, field = "fewer prompt_logprobs (or none: each prompt token's logits are computed)", "prompt_logprobs"
    elif p.n > 1:
        what, field = "a smaller n", "n"
    return RequestFault(
        f"the request did not fit in device memory: its step ran out of memory twice, the second time with the "
        f"batch halved ({tokens} tokens); {what} would fit, or retry when the worker is less busy",
        status=503,
        field=field,
    )


def nan_logits() -> RequestFault:
    return RequestFault(
        "the model produced NaN or infinite logits for this request; it was stopped (the other requests of its batch "
        "ran on). Retry it; if it repeats, report the prompt"
    )
