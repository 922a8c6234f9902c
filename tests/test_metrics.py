"""The worker's metrics against vLLM V1's Prometheus logger: every metric name it
exposes, with its labels, under our prefix or vLLM's."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedq.metrics import PlainHistogram, WorkerMetrics, aggregate_workers
from pagedq.outputs import CompletionOutput, RequestMetrics, RequestOutput

# vLLM V1's metric names (vllm/v1/metrics/loggers.py, PrometheusStatLogger), without
# speculative decoding and LoRA, which pagedq does not do. Counters are listed by the
# name Prometheus exposes (with _total).
VLLM_V1_METRICS = {
    "num_requests_running": "gauge", "num_requests_waiting": "gauge", "kv_cache_usage_perc": "gauge",
    "prefix_cache_queries": "counter", "prefix_cache_hits": "counter", "num_preemptions": "counter",
    "prompt_tokens": "counter", "generation_tokens": "counter", "request_success": "counter",
    "request_prompt_tokens": "histogram", "request_generation_tokens": "histogram",
    "iteration_tokens_total": "histogram", "request_max_num_generation_tokens": "histogram",
    "request_params_n": "histogram", "request_params_max_tokens": "histogram",
    "time_to_first_token_seconds": "histogram", "time_per_output_token_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram",
    "request_inference_time_seconds": "histogram", "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram", "cache_config_info": "gauge",
}


def scrape(metrics: WorkerMetrics) -> dict:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics)
    return {family.name: family for family in text_string_to_metric_families(generate_latest(registry).decode())}


def finished_request(n: int = 2) -> RequestOutput:
    outputs = [CompletionOutput(index=i, text="", token_ids=list(range(3 + i)), cumulative_logprob=0.0, logprobs=None,
                                finish_reason="length") for i in range(n)]
    timing = RequestMetrics(arrival_time=100.5, first_scheduled_time=101.0, first_token_time=101.5, finished_time=103.5)
    return RequestOutput("r", None, [1] * 10, outputs, True, timing)


@pytest.mark.parametrize("prefix", ["pagedq", "vllm"])
def test_every_vllm_v1_metric_with_its_labels(prefix):
    metrics = WorkerMetrics(["q"], "my-model", 128, {"block_size": "16"}, prefix=prefix)
    metrics.observe_step({"tokens_computed": 10, "generation_tokens": 0, "num_running": 1})
    metrics.observe_step({"tokens_computed": 12, "generation_tokens": 2, "num_running": 1})
    metrics.observe_finished(finished_request(), enqueued_at=100.0, n=2, max_tokens=None)
    families = scrape(metrics)
    for name, kind in VLLM_V1_METRICS.items():
        family = families[f"{prefix}:{name}"]
        assert family.type == kind, name
        if name != "cache_config_info":
            assert all(s.labels["model_name"] == "my-model" and s.labels["engine"] == "0" for s in family.samples), name
    # pagedq's own job metrics keep their prefix whichever is chosen.
    assert "pagedq:jobs_finished" in families and "pagedq:queue_depth" in families

    def value(name: str, suffix: str, **labels) -> float:
        family = families[f"{prefix}:{name}"]
        return next(s.value for s in family.samples if s.name == family.name + suffix
                    and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("iteration_tokens_total", "_sum") == 12 and value("iteration_tokens_total", "_count") == 2
    assert value("request_success", "_total", finished_reason="length") == 1
    assert value("request_success", "_total", finished_reason="stop") == 0
    assert value("request_generation_tokens", "_sum") == 3 + 4
    assert value("request_max_num_generation_tokens", "_sum") == 4
    assert value("request_params_n", "_sum") == 2
    assert value("request_params_max_tokens", "_sum") == 128 - 10  # none given: what the context leaves
    assert value("request_queue_time_seconds", "_sum") == 1.0  # from enqueue
    assert value("request_prefill_time_seconds", "_sum") == 0.5
    assert value("request_decode_time_seconds", "_sum") == 2.0
    assert value("request_inference_time_seconds", "_sum") == 2.5
    assert value("request_time_per_output_token_seconds", "_sum") == 2.0 / 3
    assert value("cache_config_info", "", block_size="16") == 1


def test_unknown_prefix_is_refused():
    with pytest.raises(ValueError, match="prefix"):
        WorkerMetrics(["q"], "m", 128, {}, prefix="tgi")


def test_workers_pages_are_summed_into_one():
    """The api's /metrics shows the workers' series summed across workers: counters and
    histograms add, the KV cache's usage is the mean; the queue depth is the api's own."""
    pages = []
    for running, usage, tokens in ((2, 0.5, 7), (3, 0.25, 5)):
        metrics = WorkerMetrics(["q"], "m", 64, {"block_size": "16"}, prefix="vllm")
        metrics.observe_step({"num_running": running, "kv_cache_usage": usage, "generation_tokens": tokens})
        metrics.observe_finished(finished_request(), enqueued_at=100.0, n=2, max_tokens=8)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(metrics)
        pages.append(generate_latest(registry).decode())
    registry = CollectorRegistry(auto_describe=False)

    class Pages:
        def collect(self):
            return aggregate_workers(pages)

    registry.register(Pages())
    merged = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in text_string_to_metric_families(generate_latest(registry).decode()) for s in family.samples}
    labels = (("engine", "0"), ("model_name", "m"))
    assert merged[("vllm:num_requests_running", labels)] == 5
    assert merged[("vllm:generation_tokens_total", labels)] == 12
    assert merged[("vllm:kv_cache_usage_perc", labels)] == 0.375
    assert merged[("vllm:e2e_request_latency_seconds_count", labels)] == 2
    assert merged[("vllm:e2e_request_latency_seconds_bucket", tuple(sorted((*labels, ("le", "+Inf")))))] == 2
    assert merged[("vllm:cache_config_info", (("block_size", "16"),))] == 1
    assert merged[("pagedq:jobs_finished_total", ())] == 2
    assert not any(name == "pagedq:queue_depth" for name, _ in merged)


def test_plain_histogram_counted_observation_is_that_many_observations():
    counted, one_by_one = (PlainHistogram("h", "doc", (0.01, 0.1, 1.0)) for _ in range(2))
    counted.observe(0.05, 3)
    counted.observe(2.0)
    for value in (0.05, 0.05, 0.05, 2.0):
        one_by_one.observe(value)
    assert counted.counts == one_by_one.counts == [0, 3, 0, 1]
    assert counted.sum == pytest.approx(one_by_one.sum) == pytest.approx(2.15)
