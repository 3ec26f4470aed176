"""The server's Prometheus metrics (``/metrics``), one registry per server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["Metrics"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """Counters, gauges and histograms of one server (names prefixed ``flashspec_``)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start every series afresh (a new registry): after the start-up's warm-up requests."""
        self.registry = r = CollectorRegistry()
        self.requests = Counter("flashspec_requests", "Requests by outcome "
                                "(ok, bad_request, too_large, unauthorized, rejected, cancelled, shutdown, error)", ["outcome"], registry=r)
        self.prompt_tokens = Counter("flashspec_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("flashspec_generated_tokens", "Tokens generated and returned "
                                        "(as usage.completion_tokens: none past a stop string)", registry=r)
        self.proposed = Counter("flashspec_draft_tokens_proposed", "Draft tokens proposed", registry=r)
        self.accepted = Counter("flashspec_draft_tokens_accepted", "Draft tokens accepted", registry=r)
        self.acceptance_rate = Gauge("flashspec_acceptance_rate", "Accepted / proposed drafts since start-up",
                                     registry=r)
        self.tokens_per_step = Gauge("flashspec_mean_accepted_tokens_per_step",
                                     "Tokens a row gains per decode step since start-up (accepted drafts + 1)",
                                     registry=r)
        self.selections = Counter("flashspec_arm_selections", "Decode steps per arm (drafter@gamma)", ["arm"],
                                  registry=r)
        self.queue_depth = Gauge("flashspec_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.running = Gauge("flashspec_running_batch_size", "Requests in the running batch", registry=r)
        self.ttft = Histogram("flashspec_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram("flashspec_inter_token_latency_seconds", "Time between two tokens of a request",
                             buckets=_LATENCY, registry=r)
        self.startup = Gauge("flashspec_startup_seconds", "Model load and warm-up time", registry=r)
