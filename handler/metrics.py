"""The worker's Prometheus metrics, for the /metrics route, under vLLM's names and buckets
(vllm/v1/metrics/loggers.py) so that dashboards built for vLLM read this worker unchanged.

Two sources:
- the engine's state (running, waiting, KV usage, prefix-cache and preemption totals), read from engine.stats() by a
  collector when scraped: exact at the scrape, and nothing to do between scrapes;
- each request's latencies, tokens and finished reason, observed by Metrics.watch over its engine outputs
  (jobs.generate wraps every route's stream in it).

Each Metrics has its own registry, never prometheus_client's global one: tests build several workers in one
process."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine import AsyncEngine, RequestOutput

LABELS = ("model_name", "engine")  # vLLM's label names; engine is "0" (one engine per worker)
FINISHED_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason values, as its label writes them

# vLLM's bucket boundaries, in seconds
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class Metrics:
    """One worker's metrics: render() is the /metrics body; watch() wraps each request's engine outputs."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.registry = CollectorRegistry()
        labels = (model_name, "0")
        reg = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=reg).labels(*labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=reg, buckets=buckets).labels(*labels)

        # prometheus_client exposes a counter named X as X_total, as vLLM's are
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*LABELS, "finished_reason"),
            registry=reg,
        )
        self.success = {r: success.labels(*labels, r) for r in FINISHED_REASONS}  # every reason shows, from 0
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS
        )
        reg.register(EngineCollector(engine, labels))

    def render(self) -> tuple[bytes, str]:
        """The /metrics body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def watch(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """The request's outputs, unchanged, observed on the way:
        - TTFT from here (the request entering the engine) to its first tokens, when its prompt tokens count too;
        - ITL per token after those: the gap since the last output with tokens, shared by the tokens a sequence got
          in this one (speculation);
        - e2e and the finished reason when it ends: at its finished output, not when its consumer is done with it.
        A request that ends without a finished output (its consumer closed it, or was cancelled) is an abort; one
        whose stream raised, or whose finished output carries an error, is an error."""
        start = last = time.monotonic()
        first, ended = True, False
        try:
            async for out in outputs:
                new = [len(c.delta_token_ids) for c in out.outputs if c.delta_token_ids]
                if new:
                    now = time.monotonic()
                    if first:
                        first = False
                        self.ttft.observe(now - start)
                        self.prompt_tokens.inc(len(out.prompt_token_ids))
                    else:
                        for k in new:
                            gap = (now - last) / k
                            for _ in range(k):
                                self.itl.observe(gap)
                    last = now
                    self.generation_tokens.inc(sum(new))
                if out.finished:
                    self._end(start, _reason(out))
                    ended = True
                yield out
        except Exception:
            if not ended:
                self._end(start, "error")
                ended = True
            raise
        finally:
            if not ended:  # GeneratorExit (its consumer closed it) or CancelledError
                self._end(start, "abort")

    def _end(self, start: float, reason: str) -> None:
        self.e2e.observe(time.monotonic() - start)
        self.success[reason].inc()


def _reason(out: RequestOutput) -> str:
    """A finished request's label: error, else the first of its sequences' reasons that is not stop (n > 1)."""
    if out.error is not None:
        return "error"
    reasons = [c.finish_reason for c in out.outputs if c.finish_reason not in (None, "stop")]
    return reasons[0] if reasons and reasons[0] in FINISHED_REASONS else "stop"


# The engine's state: (family, vLLM's name, its help text, the engine.stats() key it is read from)
ENGINE_METRICS = (
    (GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in model execution batches.", "running"),
    (GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", "waiting"),
    (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_usage"),
    (
        CounterMetricFamily,
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        "prefix_cache_queried_tokens",
    ),
    (
        CounterMetricFamily,
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        "prefix_cache_hit_tokens",
    ),
    (
        CounterMetricFamily,
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        "num_preemptions",
    ),
    # ours (engine/faults.py): requests failed because their logits were NaN or infinite, steps out of memory
    (CounterMetricFamily, "worker:num_requests_nan_logits", "Requests failed with NaN logits.", "num_failed_nan"),
    (CounterMetricFamily, "worker:num_steps_out_of_memory", "Steps that ran out of memory.", "num_oom_steps"),
)


class EngineCollector:
    """The engine's state, read from engine.stats() when scraped. Its counters are the engine's own totals, which
    only grow: monotonic, as Prometheus counters must be."""

    def __init__(self, engine: AsyncEngine, labels: tuple[str, str]):
        self.engine, self.labels = engine, list(labels)

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        for family, name, doc, key in ENGINE_METRICS:
            m = family(name, doc, labels=LABELS)
            m.add_metric(self.labels, s[key])
            yield m


class AdmissionCollector:
    """The load-balancing server's admission (handler/admission.py), read when scraped: requests holding a slot
    and waiting for one (before the engine sees them: with MAX_CONCURRENCY reached, vllm:num_requests_waiting
    stays near 0 while these wait), and the requests turned away, by why: overloaded (429), waited_too_long,
    closed (shutting down) and unavailable (starting, faulted) (503)."""

    REASONS = ("overloaded", "waited_too_long", "closed", "unavailable")

    def __init__(self, admission, model_name: str):
        self.admission, self.labels = admission, [model_name, "0"]

    def collect(self) -> Iterator[Metric]:
        adm = self.admission
        for name, doc, value in (
            ("worker:lb_requests_running", "Requests holding one of MAX_CONCURRENCY slots.", adm.active),
            ("worker:lb_requests_waiting", "Requests waiting for a slot (at most LB_MAX_WAITING).", adm.queued),
        ):
            m = GaugeMetricFamily(name, doc, labels=LABELS)
            m.add_metric(self.labels, value)
            yield m
        m = CounterMetricFamily("worker:lb_requests_refused", "Requests turned away, by reason.",
                                labels=(*LABELS, "reason"))  # fmt: skip
        for reason in self.REASONS:
            m.add_metric([*self.labels, reason], adm.refused[reason])
        yield m
