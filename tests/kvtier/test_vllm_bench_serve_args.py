"""The outside-check wrapper (kvtier.bench.vllm_serve): its arguments are what vLLM's own `bench serve` parser
accepts and means, and the hit rates are the replicas' counter deltas. No engine is started."""

from pathlib import Path

import pytest

from kvtier.bench.vllm_serve import bench_serve_argv, hit_rates


# not `unit`: importing vllm.benchmarks.serve costs ~13 s of CPU (torch), too slow for the inner loop
def test_argv_parses_with_vllm_bench_serve_parser(tmp_path: Path) -> None:
    serve = pytest.importorskip("vllm.benchmarks.serve")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    a = parser.parse_args(bench_serve_argv(
        "http://127.0.0.1:8080", "/models/tiny", num_prompts=200, request_rate=4.0, prefix_len=256, suffix_len=64,
        num_prefixes=8, output_len=16, seed=7, result_dir=tmp_path, result_filename="arm.json", label="arm"))
    assert (a.dataset_name, a.base_url, a.endpoint, a.backend) == (
        "prefix_repetition", "http://127.0.0.1:8080", "/v1/completions", "openai")
    assert (a.prefix_repetition_prefix_len, a.prefix_repetition_suffix_len, a.prefix_repetition_num_prefixes,
            a.prefix_repetition_output_len) == (256, 64, 8, 16)
    assert (a.num_prompts, a.request_rate, a.seed, a.ignore_eos) == (200, 4.0, 7, True)
    assert a.save_result and (a.result_dir, a.result_filename) == (str(tmp_path), "arm.json")
    assert set(a.percentile_metrics.split(",")) >= {"ttft", "tpot", "e2el"}
    assert a.metric_percentiles == "50,99"


@pytest.mark.unit
def test_hit_rates_are_summed_counter_deltas() -> None:
    before = [{"queries": 100.0, "l0_hits": 10.0, "ext_hits": 0.0, "requests": 1.0},
              {"queries": None, "l0_hits": None, "ext_hits": None, "requests": None}]  # not exported yet
    after = [{"queries": 1100.0, "l0_hits": 510.0, "ext_hits": 200.0, "requests": 5.0},
             {"queries": 1000.0, "l0_hits": 300.0, "ext_hits": 100.0, "requests": 4.0}]
    h = hit_rates(before, after)
    assert (h["queries"], h["l0_hits"], h["ext_hits"]) == (1000.0, 500.0, 200.0)  # replica 2: no baseline
    assert h["l0_hit_rate"] == pytest.approx(0.5) and h["ext_hit_rate"] == pytest.approx(0.2)
    assert h["hit_rate"] == pytest.approx(0.7)
    assert h["per_replica_requests"] == [4, 0]
    assert hit_rates(before, before)["hit_rate"] is None
