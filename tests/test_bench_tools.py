"""The measuring tools in scripts/ that the GPU runs depend on: what they read, they read right."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass looks its module up while it is built
    spec.loader.exec_module(module)
    return module


def test_top_functions_skips_torn_frames_and_counts_the_rest(tmp_path: Path) -> None:
    # A frame py-spy read while the process wrote it: its name runs over a newline, so one line ends without a
    # count and the next holds only the name's tail (seen on the H100 in SGLang's server process).
    raw = tmp_path / "profile-server.txt"
    raw.write_text(
        "main (app.py:1);serve (app.py:9);send (http.py:40) 30\n"
        "main (app.py:1);tokenize (tok.py:3) 10\n"
        'main (app.py:1);spaces_between_special_tokens (smol","choices":[{"delta":{"content":" carpets"}}]}\n'
        "\n"
        "main (app.py:1);serve (app.py:12);send (http.py:41) 20\n"
    )
    report = _script("profile_processes").top_functions(raw, limit=3)
    assert report["samples"] == 60
    assert report["own"][0] == ("send (http.py)", round(50 / 60, 3))
    assert dict(report["inclusive"])["main (app.py)"] == 1.0


def test_cpu_lists_read_as_the_kernel_writes_them() -> None:
    parse = _script("isolate_schedulers").parse_cpu_list
    assert parse("0-2,8\n") == [0, 1, 2, 8]
    assert parse("5") == [5]
    assert parse("3,11") == [3, 11]


def test_schedulers_get_the_highest_cores_first_where_the_gpu_node_is_unknown() -> None:
    order = _script("isolate_schedulers").reservation_order([[0, 8], [1, 9], [2, 10]], None)
    assert order == [[2, 10], [1, 9], [0, 8]]


def test_each_scheduler_gets_whole_cores_up_to_its_cpus() -> None:
    reserve = _script("isolate_schedulers").reserve
    # Hyperthreaded: one core each is two CPUs.
    assert reserve([11, 12], [[3, 7], [2, 6], [1, 5]], cpus_each=2) == {11: [3, 7], 12: [2, 6]}
    # One thread per core: two cores each.
    assert reserve([11, 12], [[5], [4], [3], [2], [1]], cpus_each=2) == {11: [4, 5], 12: [2, 3]}
    with pytest.raises(ValueError):
        reserve([11, 12], [[1], [0]], cpus_each=2)


def test_sglang_step_rates_are_read_from_loaded_windows_only(tmp_path: Path) -> None:
    log = tmp_path / "batches.log"
    log.write_text(
        "[t] Prefill batch, #new-seq: 2, #new-token: 900, #cached-token: 0, token usage: 0.01, #running-req: 0\n"
        "[t] Decode batch, #running-req: 4, #token: 900, token usage: 0.01, gen throughput (token/s): 800.00\n"
        "[t] Decode batch, #running-req: 64, #token: 40000, token usage: 0.13, gen throughput (token/s): 9600.00\n"
        "[t] Decode batch, #running-req: 60, #token: 39000, token usage: 0.13, gen throughput (token/s): 8400.00\n"
    )
    steps = _script("sglang_steps")
    engine = steps.engine_steps("server", steps.read_lines(log), min_running=32)
    assert engine.windows == 2
    assert engine.mean_running == 62.0
    assert engine.tokens_per_s == 9000.0
    assert engine.steps_per_s_per_request == 145.0  # median of 150 and 140
    assert (engine.prefill_batches, engine.sequences_per_prefill) == (1, 2.0)
    assert (engine.new_tokens_per_prefill, engine.cached_tokens_per_prefill) == (900.0, 0.0)
    assert engine.mean_token_usage == 0.13  # the loaded windows' fill, not the warm-up's


def test_sglang_steps_split_decode_only_windows_from_those_a_prefill_interrupted(tmp_path: Path) -> None:
    # Two windows of 16 running with no prefill (2.0 and 2.2 ms a step), one with a prefill logged before it (its 40
    # steps took 40 × 2.5 ms: 16 ms more than decode alone at the median 2.1 ms), and one with two (40 ms more: 20 each).
    decode = "[t] Decode batch, #running-req: 16, #token: 9000, token usage: 0.03, gen throughput (token/s): {:.4f}\n"
    prefill = "[t] Prefill batch, #new-seq: 1, #new-token: 600, #cached-token: 16, token usage: 0.03\n"
    log = tmp_path / "batches.log"
    log.write_text(decode.format(16 / 2.0e-3) + decode.format(16 / 2.2e-3) + prefill + decode.format(16 / 2.5e-3)
                   + prefill + prefill + decode.format(16 / 3.1e-3))
    steps = _script("sglang_steps")
    windows = steps.decode_windows(steps.read_lines(log))
    assert [window.prefills_within for window in windows] == [0, 0, 1, 2]
    engine = steps.engine_steps("stack", steps.read_lines(log), min_running=12)
    assert engine.decode_only_windows == 2
    assert engine.decode_only_step_ms == pytest.approx(2.1)
    assert engine.prefill_cost_ms == pytest.approx(18.0)  # the median of 16 (one prefill) and 20 (each of two)


def test_sglang_step_rates_of_one_stream_leave_out_windows_with_more_running(tmp_path: Path) -> None:
    log = tmp_path / "batches.log"
    log.write_text(
        "[t] Decode batch, #running-req: 1, #token: 900, token usage: 0.00, gen throughput (token/s): 540.00\n"
        "[t] Decode batch, #running-req: 1, #token: 940, token usage: 0.00, gen throughput (token/s): 520.00\n"
        "[t] Decode batch, #running-req: 2, #token: 1800, token usage: 0.00, gen throughput (token/s): 900.00\n"
    )
    steps = _script("sglang_steps")
    engine = steps.engine_steps("server", steps.read_lines(log), min_running=1, max_running=1)
    assert (engine.windows, engine.tokens_per_s) == (2, 530.0)
    with pytest.raises(steps.NoLoadedWindows, match="no decode line with 3 to 4 running"):
        steps.engine_steps("server", steps.read_lines(log), min_running=3, max_running=4)


def test_sglang_steps_leave_out_an_engine_idle_in_the_run_and_compare_the_rest(tmp_path: Path) -> None:
    busy = "[t] Decode batch, #running-req: 16, #token: 9000, token usage: 0.03, gen throughput (token/s): 3200.00\n"
    idle = "[t] Decode batch, #running-req: 1, #token: 900, token usage: 0.00, gen throughput (token/s): 500.00\n"
    for name, text in (("server", busy), ("stack", busy), ("idle", idle)):
        (tmp_path / f"{name}.log").write_text(text)
    logs = [f"{name}={tmp_path / name}.log" for name in ("server", "idle", "stack")]
    completed = subprocess.run([sys.executable, str(SCRIPTS / "sglang_steps.py"), *logs, "--min-running", "12"],
                               capture_output=True, text=True, timeout=30)
    assert completed.returncode == 0
    assert "idle: no decode line with 12+ running requests (does it log at info?); left out" in completed.stderr
    assert "stack" in completed.stdout and "1.00x" in completed.stdout
    without_reference = subprocess.run([sys.executable, str(SCRIPTS / "sglang_steps.py"), logs[1], logs[0]],
                                       capture_output=True, text=True, timeout=30)
    assert without_reference.returncode == 1
    assert "idle: no decode line" in without_reference.stderr


def test_sglang_settings_are_read_field_by_field_from_the_logged_line(tmp_path: Path) -> None:
    log = tmp_path / "sglang.log"
    log.write_text(
        "[2026-11-25 17:01:00] starting\n"
        "[2026-11-25 17:01:01] server_args=ServerArgs(model_path='.gpu/smol', port=30000, page_size=16, "
        "json_model_override_args='{\"a\": 1, \"b\": 2}', kv_events_config=None, stream_interval=1)\n"
    )
    fields = _script("sglang_args_diff").server_args(log)
    assert fields == {"model_path": "'.gpu/smol'", "port": "30000", "page_size": "16",
                      "json_model_override_args": "'{\"a\": 1, \"b\": 2}'", "kv_events_config": "None",
                      "stream_interval": "1"}


def test_rounds_in_pairs_run_every_system_before_and_after_each_other() -> None:
    round_order = _script("bench_vs_sglang").round_order
    systems = ["sglang", "conveyor", "b"]
    orders = [round_order(systems, index) for index in range(6)]
    assert orders[0] == systems  # the first round runs them as named
    assert all(sorted(order) == sorted(systems) for order in orders)
    for first, second in zip(orders[0::2], orders[1::2]):
        for a in systems:
            for b in systems:
                if a != b:  # before in one round of the pair, after in the other
                    assert (first.index(a) < first.index(b)) != (second.index(a) < second.index(b))
    assert len({tuple(order) for order in orders}) == 6  # 2·N rounds of three: every order once
    assert [round_order(["x", "y"], index) for index in range(2)] == [["x", "y"], ["y", "x"]]


def test_aiperf_report_gives_two_stacks_ratio_to_each_other_round_by_round(capsys: pytest.CaptureFixture[str]) -> None:
    def row(tokens_per_s: float) -> dict[str, float]:
        return {"tok/s": tokens_per_s, "TTFT p50": 50.0, "TTFT p99": 300.0, "ITL p50": 5.0, "ITL p99": 7.0,
                "gap p99": 30.0}

    bench = _script("bench_aiperf")
    bench.print_level(bench.Level(64), {"sglang": [row(10), row(11)], "a": [row(9), row(10)],
                                        "b": [row(10), row(12.5)]})
    printed = capsys.readouterr().out
    assert "a ÷ b | tok/s by round: 0.90, 0.80" in printed
    assert "b ÷ a" not in printed  # each pair once


def test_cpu_neighbours_measure_on_a_core_whose_siblings_stay_idle() -> None:
    plan = _script("bench_cpu_neighbours").plan
    # Hyperthreaded: the last core measures, helpers take one CPU per other core before any sibling.
    measured, helpers, levels = plan([[0, 4], [1, 5], [2, 6], [3, 7]], [0, 2, 4, 6, 8])
    assert measured == 3 and 7 not in helpers
    assert helpers == [2, 1, 0, 6, 5, 4]
    assert levels == [0, 2, 4, 6]  # 8 helpers do not fit beside the measured core


def test_cpu_neighbours_workload_runs_and_reports_per_kind(capsys: pytest.CaptureFixture[str]) -> None:
    module = _script("bench_cpu_neighbours")
    assert module.scheduler_like_round(batch_size=8) > 0
    readings = [module.Reading("spin", 0, 100.0, None), module.Reading("spin", 2, 80.0, 2100.0),
                module.Reading("memory", 0, 50.0, None), module.Reading("memory", 2, 60.0, None)]
    module.report(readings, ["spin", "memory"], [0, 2])
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:4] == ["spin", "2", "80", "0.80x"] for line in lines)
    assert any(line.split()[:4] == ["memory", "2", "60", "1.20x"] for line in lines)


@pytest.fixture
def fake_aiperf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for aiperf's command line on PYTHONPATH (the real client needs a server): it notes when it ran and
    writes the summary aiperf writes, with the URL's port as its token rate."""
    fake = tmp_path / "fake" / "aiperf"
    fake.mkdir(parents=True)
    fake.joinpath("__init__.py").write_text("")
    fake.joinpath("__main__.py").write_text(
        "import importlib.util, json, sys, time\n"
        "from pathlib import Path\n"
        "argv = sys.argv[1:]\n"
        "out = Path(argv[argv.index('--output-artifact-dir') + 1])\n"
        "out.joinpath('torch-visible').write_text(str(importlib.util.find_spec('torch') is not None))\n"
        "port = int(argv[argv.index('--url') + 1].rsplit(':', 1)[1])\n"
        "started = time.time(); time.sleep(0.5)\n"
        "out.joinpath('ran.json').write_text(json.dumps([started, time.time()]))\n"
        "out.joinpath('request-count').write_text(argv[argv.index('--request-count') + 1])\n"
        "out.joinpath('seed').write_text(argv[argv.index('--random-seed') + 1])\n"
        "stat = lambda value: {'avg': value, 'p50': value, 'p99': value}\n"
        "out.joinpath('profile_export_aiperf.json').write_text(json.dumps({\n"
        "    'output_token_throughput': stat(port), 'time_to_first_token': stat(20.0),\n"
        "    'inter_token_latency': stat(4.0), 'inter_chunk_latency': stat(5.0),\n"
        "    'benchmark_duration': stat(0.5), 'request_error_rate': stat(0.0)}))\n")
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))


def test_aiperf_runs_together_overlap_in_time_and_each_keeps_its_own_summary(
        tmp_path: Path, fake_aiperf: None) -> None:
    bench = _script("bench_aiperf")
    args = bench.argparse.Namespace(model_name="m", tokenizer=str(tmp_path), min_requests=16, requests_per_stream=4,
                                    requests_per_stream_at={}, workers_max=None, run_timeout_s=30.0,
                                    hf_cache=tmp_path / "hf-cache", aiperf_site=bench.aiperf_site(tmp_path / "site"))
    urls = {"sglang": "http://127.0.0.1:30000", "conveyor": "http://127.0.0.1:8000"}
    out_dirs = {name: tmp_path / name for name in urls}
    rows = bench.run_together(args, urls, 64, 7, out_dirs)
    assert {name: row["tok/s"] for name, row in rows.items()} == {"sglang": 30000.0, "conveyor": 8000.0}
    # torch is installed here, as on the GPU machine; aiperf is kept from importing it (its tokenizer loads faster)
    assert importlib.util.find_spec("torch") is not None
    assert {(out_dirs[name] / "torch-visible").read_text() for name in urls} == {"False"}
    (first_start, first_end), (second_start, second_end) = (
        json.loads((out_dirs[name] / "ran.json").read_text()) for name in urls)
    assert first_start < second_end and second_start < first_end  # the two runs overlapped


def test_aiperf_level_named_in_requests_per_stream_at_gets_its_own_run_length(tmp_path: Path) -> None:
    bench = _script("bench_aiperf")
    args = bench.argparse.Namespace(model_name="m", tokenizer=str(tmp_path), min_requests=32, requests_per_stream=6,
                                    requests_per_stream_at=dict([bench.parse_level_number("16=24")]),
                                    workers_max=None)

    def request_count(streams: int) -> int:
        command = bench.aiperf_command(args, "http://127.0.0.1:8000", streams, 7, tmp_path / str(streams))
        return int(command[command.index("--request-count") + 1])

    assert [request_count(streams) for streams in (1, 16, 64)] == [32, 16 * 24, 64 * 6]
    with pytest.raises(bench.argparse.ArgumentTypeError):
        bench.parse_level_number("16")


def test_aiperf_finds_the_tokenizer_folder_offline_under_its_own_repository_id(tmp_path: Path) -> None:
    bench = _script("bench_aiperf")
    folder = tmp_path / "smol"
    folder.mkdir()
    folder.joinpath("tokenizer.json").write_text('{"version": "1.0"}')
    other = tmp_path / "other"
    other.mkdir()
    other.joinpath("tokenizer.json").write_text('{"version": "other"}')
    bench.offline_tokenizer_cache(other, tmp_path / "hf-cache")  # an earlier run with --out shared, another folder
    args = bench.argparse.Namespace(hf_cache=bench.offline_tokenizer_cache(folder, tmp_path / "hf-cache"),
                                    aiperf_site=bench.aiperf_site(tmp_path / "site"))
    # How aiperf resolves a tokenizer offline: the repository's snapshot in the HF cache, no network.
    lookup = ("import sys, huggingface_hub\n"
              "print(huggingface_hub.snapshot_download(sys.argv[1], local_files_only=True))")
    snapshot = subprocess.run([sys.executable, "-c", lookup, bench.TOKENIZER_REPO], env=bench.aiperf_env(args),
                              capture_output=True, text=True, check=True).stdout.strip()
    assert Path(snapshot, "tokenizer.json").read_text() == '{"version": "1.0"}'
    command = bench.aiperf_command(
        bench.argparse.Namespace(model_name="m", tokenizer=str(folder), min_requests=1, requests_per_stream=1,
                                 requests_per_stream_at={}, workers_max=None), "http://127.0.0.1:8000", 1, 7, tmp_path)
    assert command[command.index("--tokenizer") + 1] == bench.TOKENIZER_REPO


@pytest.mark.skipif(shutil.which("xz") is None, reason="xz is not installed (the GPU machine has it)")
def test_goals_wait_prints_the_goals_and_packs_what_the_run_wrote_into_one_tar(tmp_path: Path) -> None:
    run = tmp_path / "goals"
    (run / "aiperf" / "warmup" / "conveyor-0").mkdir(parents=True)
    (run / "aiperf" / "warmup" / "conveyor-0" / "aiperf.log").write_text("aiperf's own log\n")
    (run / "progress.log").write_text("[gpu-goals 07:22:52] aiperf: ok\n")
    (run / "aiperf.log").write_text("concurrency 16, 3 rounds\nconveyor   | tok/s ratio by round: 0.97×, 1.00×\n"
                                    "  c=16   output tok/s ≥ 0.97×: 0.98× met\n")
    (run / "top.log").write_text("top - 07:22:53\n" * 100)
    (run / "gpu-clocks.log").write_text(
        "2026/11/27 07:22:53.001, 0, 1980 MHz, 250.10 W, 60 %, 40, 0x0000000000000000\n")
    (run / "run.log").write_text("the runner's own output\n")
    row = {"tok/s": 100.0, "TTFT p50": 20.0, "TTFT p99": 40.0, "ITL p50": 2.0, "ITL p99": 4.0, "gap p99": 3.0}
    (run / "aiperf" / "results.json").write_text(
        json.dumps({"seed_base": 1, "levels": {"16": {"sglang": [row], "conveyor": [{**row, "tok/s": 90.0}]}}}))
    (run / "done").touch()
    out = tmp_path / "back" / "x"
    # python3 here is this interpreter; the reports `wait` runs need only the standard library, as on the GPU machine.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_goals.sh"), "wait", "5", str(out)], capture_output=True,
                          text=True, env={**os.environ, "GOALS_DIR": str(run), "PATH": path}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "tok/s ratio by round: 0.97×, 1.00×" in done.stdout and "c=16   output tok/s" in done.stdout
    assert not out.exists()  # packed, not left as a folder
    with tarfile.open(out.parent / "x.tar") as packed:
        names = set(packed.getnames())
    assert "1980" in done.stdout  # each GPU's clock under load, summarized
    assert {"x/aiperf.log", "x/progress.log", "x/top.log.xz", "x/warmup-conveyor-0-aiperf.log.xz",
            "x/gpu-clocks.log.xz", "x/gpu-clocks.txt", "x/aiperf-results.json", "x/goals-noise.txt"} <= names
    assert "x/run.log" not in names
    with tarfile.open(out.parent / "x.tar") as packed:
        noise = packed.extractfile("x/goals-noise.txt").read().decode()  # type: ignore[union-attr]
    # At 0.90× of the server's token rate, the same ITL: the stack meets one row of two, the server both.
    assert noise.splitlines()[2].split() == ["sglang", "-", "2/2"]
    assert noise.splitlines()[3].split() == ["conveyor", "1/2", "-"]


def test_gpu_clocks_counts_only_loaded_samples_and_which_were_held_back() -> None:
    clocks = _script("gpu_clocks")
    lines = [
        "2026/11/27 15:17:00.001, 0, 1980 MHz, 300.00 W, 80 %, 41, 0x0000000000000000",
        "2026/11/27 15:17:00.001, 1, 1755 MHz, 690.00 W, 95 %, 70, 0x0000000000000004",  # power cap
        "2026/11/27 15:17:02.001, 0, 1980 MHz, 310.00 W, 82 %, 42, 0x0000000000000000",
        "2026/11/27 15:17:02.001, 1, 1980 MHz, 320.00 W, 90 %, 60, 0x0000000000000000",
        "2026/11/27 15:17:04.001, 0, 345 MHz, 70.00 W, 0 %, 35, 0x0000000000000001",  # idle: left out
        "2026/11/27 15:17:04.001, 1, [N/A], 70.00 W",  # torn: left out
    ]
    first, second = clocks.summarize(lines, busy_percent=10)
    assert (first.gpu, first.num_samples, first.sm_clock_min_mhz, first.num_held_back) == (0, 2, 1980, 0)
    assert first.power_p50_w == 305
    assert (second.gpu, second.num_samples, second.sm_clock_min_mhz, second.num_held_back) == (1, 2, 1755, 1)
    assert second.temperature_max_c == 70


def test_sched_wait_reads_a_busy_process_cpu_and_names_it_by_its_command_line(tmp_path: Path) -> None:
    sched_wait = _script("sched_wait")
    marker = f"sched-wait-test-{tmp_path.name}"
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 4\nwhile time.time() < end: pass",
                             marker])
    try:
        log = tmp_path / "sched.log"
        sched_wait.sample(log, f"{sys.executable} -c", [("busy", marker)], interval_s=0.5, max_samples=4)
    finally:
        busy.kill()
        busy.wait()
    mine = [line for line in log.read_text().splitlines() if line.split()[2] == str(busy.pid)]
    assert len(mine) >= 2  # four samples, three intervals (the first may come before the child's exec)
    assert all(line.split()[1] == "busy" for line in mine)
    [row] = sched_wait.summarize(mine, min_cpu_percent=30.0)
    assert row.label == "busy" and row.intervals >= 2
    assert 30.0 <= row.cpu_percent <= 101.0
    assert row.wait_percent >= 0.0 and row.switches_per_s >= 0.0 and row.cpus_seen >= 1


def test_sched_wait_summary_keeps_loaded_intervals_only() -> None:
    summarize = _script("sched_wait").summarize
    lines = ["10:00:00 server 5 99.0 1.0 10 3", "10:00:02 server 5 98.0 3.0 30 4", "10:00:04 server 5 2.0 0.0 1 4",
             "10:00:00 conveyor 9 97.0 9.0 400 7", "not a sample line"]
    rows = {row.label: row for row in summarize(lines, min_cpu_percent=60.0)}
    assert rows["server"].intervals == 2 and rows["server"].wait_percent == 2.0 and rows["server"].cpus_seen == 2
    assert rows["conveyor"].switches_per_s == 400.0


def test_sglang_step_rates_by_time_bucket_pair_engines_that_ran_together(tmp_path: Path) -> None:
    steps = _script("sglang_steps")
    lines = [
        "[2026-11-26 04:28:41] Decode batch, #running-req: 64, token usage: 0.1, gen throughput (token/s): 12800.00\n",
        "[2026-11-26 04:28:59] Decode batch, #running-req: 64, token usage: 0.1, gen throughput (token/s): 6400.00\n",
        "[2026-11-26 04:28:50] Decode batch, #running-req: 8, token usage: 0.1, gen throughput (token/s): 9000.00\n",
        "[2026-11-26 04:29:05] Decode batch, #running-req: 50, token usage: 0.1, gen throughput (token/s): 5000.00\n",
    ]
    rates = steps.steps_by_time(lines, min_running=32, bucket_s=20)
    start = 4 * 3600 + 28 * 60 + 40
    assert rates == {start: 150.0, start + 20: 100.0}  # the median of 200 and 100; the 8-request window left out


def test_aiperf_together_runs_warm_up_and_rounds_at_once_and_reports_ratios(tmp_path: Path, fake_aiperf: None) -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_aiperf.py"), "--tokenizer", str(tmp_path), "--together",
         "--concurrency", "4", "--rounds", "2", "sglang=http://127.0.0.1:30000", "conveyor=http://127.0.0.1:15000",
         "--requests-per-stream", "8", "--min-requests", "2", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=60, check=True)
    assert "warm-up 1/1 at concurrency 4: together" in completed.stderr
    assert "round 2/2: sglang, conveyor together" in completed.stderr
    assert "tok/s ratio by round: 0.50×, 0.50×" in completed.stdout  # 15000 / 30000 in each round
    for run in ("warmup/sglang-0", "warmup/conveyor-0", "c4/r1/sglang", "c4/r1/conveyor"):
        assert (tmp_path / "out" / run / "profile_export_aiperf.json").exists()
    # A warm-up run is one request a stream; a counted one has the requests per stream asked for.
    assert (tmp_path / "out" / "warmup/sglang-0" / "request-count").read_text() == "4"
    assert (tmp_path / "out" / "c4/r1/conveyor" / "request-count").read_text() == "32"


def test_steps_around_canaries_split_each_round_at_the_stack_s_first_canary_under_load(tmp_path: Path) -> None:
    def decode(second: int, tokens_per_s: float) -> str:
        return (f"[2026-11-26 08:00:{second:02d}] Decode batch, #running-req: 100, token usage: 0.3, "
                f"gen throughput (token/s): {tokens_per_s:.2f}\n")

    def prefill(second: int, sequences: int, new_tokens: int, cached_tokens: int, running: int = 100) -> str:
        return (f"[2026-11-26 08:00:{second:02d}] Prefill batch, #new-seq: {sequences}, #new-token: {new_tokens}, "
                f"#cached-token: {cached_tokens}, token usage: 0.3, #running-req: {running}, #queue-req: 5\n")

    seconds = range(0, 41, 2)
    (tmp_path / "server-batches.log").write_text("".join(decode(second, 10000) for second in seconds))
    # The stack keeps pace until its canary joins the running batch at 20 s, then steps at 0.8x.
    (tmp_path / "conveyor-batches.log").write_text(
        prefill(2, 1, 16, 0, running=0)  # a canary while idle: not one under load
        + prefill(4, 2, 900, 0) + prefill(5, 1, 400, 0)  # a round's first requests, nothing cached yet
        + "".join(decode(second, 10000 if second <= 20 else 8000) for second in seconds)
        + prefill(20, 3, 916, 32))  # the canary (16 tokens, none cached) batched with two live requests
    done = subprocess.run([sys.executable, str(SCRIPTS / "steps_around_canaries.py"), str(tmp_path)],
                          capture_output=True, text=True, check=True)
    rows = [line.split() for line in done.stdout.splitlines()[1:]]
    assert rows == [["08:00:00", "40", "1.00x", "0.80x", "[20]"]]

    # A second run, with no canary under load and the stack stepping 0.9x: the medians over both runs' rounds.
    second = tmp_path / "second"
    second.mkdir()
    (second / "server-batches.log").write_text("".join(decode(second_s, 10000) for second_s in seconds))
    (second / "conveyor-batches.log").write_text("".join(decode(second_s, 9000) for second_s in seconds))
    both = subprocess.run([sys.executable, str(SCRIPTS / "steps_around_canaries.py"), str(tmp_path), str(second)],
                          capture_output=True, text=True, check=True)
    assert both.stdout.splitlines()[-1] == (
        "conveyor over server, medians: before the first canary: 0.95x (0.90-1.00), 2 rounds; "
        "after it: 0.80x (0.80-0.80), 1 rounds; rounds with no canary: 0.90x (0.90-0.90), 1 rounds")


def test_cpu_steal_counts_each_cpus_stolen_time_between_two_snapshots() -> None:
    cpu_steal = _script("cpu_steal")
    start = cpu_steal.read_stat("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 60 0 30 400 5 0 0 5 0 0\n"
                                "cpu1 40 0 20 400 5 0 0 35 0 0\nintr 12345\n")
    end = cpu_steal.read_stat("cpu  300 0 100 900 10 0 0 140 20 0\ncpu0 160 0 55 450 5 0 0 10 20 0\n"
                              "cpu1 140 0 45 450 5 0 0 130 0 0\nintr 23456\n")
    rows = {row.name: row for row in cpu_steal.between(start, end)}
    assert list(rows) == ["cpu", "cpu0", "cpu1"]  # the all-CPU line first, then by number
    assert (rows["cpu1"].busy_ticks, rows["cpu1"].idle_ticks, rows["cpu1"].steal_ticks) == (125, 50, 95)
    assert rows["cpu0"].busy_ticks == 125  # guest time is already in user: not counted twice
    assert cpu_steal.percent(rows["cpu1"].steal_ticks, rows["cpu1"].total_ticks) == 100.0 * 95 / 270


def test_aiperf_slowest_first_tokens_are_placed_in_the_order_requests_started(tmp_path: Path) -> None:
    records = tmp_path / "profile_export.jsonl"
    rows = [{"metadata": {"request_start_ns": 10**9 + index * 10**7, "benchmark_phase": "profiling"},
             "metrics": {"time_to_first_token": {"value": 500.0 if index in (3, 150) else 20.0, "unit": "ms"}}}
            for index in range(200)]
    rows.append({"metadata": {"request_start_ns": 0, "benchmark_phase": "warmup"},
                 "metrics": {"time_to_first_token": {"value": 900.0, "unit": "ms"}}})
    records.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    report = _script("bench_aiperf").slowest_first_tokens(records)
    assert report == "slowest 2 first tokens of 200: #4 at +0.03 s (500 ms), #151 at +1.50 s (500 ms)"


def test_aiperf_run_time_outside_its_load_is_split_into_before_the_first_request_and_after_the_last(
        tmp_path: Path) -> None:
    records = tmp_path / "profile_export.jsonl"
    second_ns = 10**9
    rows = [{"metadata": {"request_start_ns": 30 * second_ns + index * second_ns,
                          "request_end_ns": 31 * second_ns + index * second_ns, "benchmark_phase": "profiling"}}
            for index in range(6)]
    rows.append({"metadata": {"request_start_ns": 0, "request_end_ns": 99 * second_ns, "benchmark_phase": "warmup"}})
    records.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    time_around_load = _script("bench_aiperf").time_around_load
    # Launched at 2 s, first request at 30 s, last response at 36 s, exited at 45 s.
    assert time_around_load(records, 2 * second_ns, 45 * second_ns) == \
        " (28 s to its first request, 9 s after its last response)"
    assert time_around_load(tmp_path / "missing.jsonl", 0, 1) == ""


def test_aiperf_together_rates_count_only_the_time_every_system_was_streaming(tmp_path: Path) -> None:
    second_ns = 10**9

    def write(name: str, requests: list[tuple[int, int, int, int]]) -> Path:  # (start s, TTFT ms, end s, tokens)
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({
            "metadata": {"request_start_ns": start_s * second_ns, "request_end_ns": end_s * second_ns},
            "metrics": {"time_to_first_token": {"value": ttft_ms}, "output_sequence_length": {"value": tokens}}}) + "\n"
            for start_s, ttft_ms, end_s, tokens in requests))
        return path

    # sglang streams 1,000 tokens over 0-10 s; conveyor's aiperf started 2 s later and streams 800 over 2-10 s. Over
    # the 8 s both streamed, each made 100 tokens a second.
    rows: dict[str, dict[str, float]] = {"sglang": {}, "conveyor": {}}
    _script("bench_aiperf").add_shared_window_rates(
        rows, {"sglang": write("sglang", [(0, 0, 10, 1000)]), "conveyor": write("conveyor", [(1, 1000, 10, 800)])})
    assert rows["sglang"]["tok/s shared"] == pytest.approx(100.0)
    assert rows["conveyor"]["tok/s shared"] == pytest.approx(100.0)


def test_aiperf_goals_are_read_off_each_level_with_the_ones_that_apply_there() -> None:
    def row(tokens_per_s: float, ttft_p50_ms: float, ttft_p99_ms: float, itl_p99_ms: float) -> dict[str, float]:
        return {"tok/s": tokens_per_s, "TTFT p50": ttft_p50_ms, "TTFT p99": ttft_p99_ms, "ITL p50": 2.0,
                "ITL p99": itl_p99_ms, "gap p99": 3.0}

    goal_lines = _script("bench_aiperf").goal_lines
    by_round = {"tok/s": 0.99, "ITL p99": 1.01}
    assert goal_lines(1, row(96, 23.5, 40, 2.1), row(100, 20.0, 40, 2.0), by_round) == [
        "output tok/s ≥ 0.97×: 0.96× NOT met (0.99×)", "ITL p99 ≤ 1.05×: 1.05× met (1.01×)",
        "TTFT p50 added ≤ 3 ms: +3.5 ms NOT met"]
    assert goal_lines(64, row(98, 50, 300, 9.0), row(100, 45, 240, 10.0), by_round) == [
        "output tok/s ≥ 0.97×: 0.98× met (0.99×)", "ITL p99 ≤ 1.05×: 0.90× met (1.01×)",
        "TTFT p99 ≤ 1.2×: 1.25× NOT met"]
    assert len(goal_lines(256, row(100, 1, 1, 1), row(100, 1, 1, 1), by_round)) == 2  # no first-token goal at 256
    # Where two places would read as the goal itself, three say which side of it the ratio is.
    assert goal_lines(16, row(96.9, 1, 1, 2.098), row(100, 1, 1, 2.0), by_round)[:2] == [
        "output tok/s ≥ 0.97×: 0.969× NOT met (0.99×)", "ITL p99 ≤ 1.05×: 1.049× met (1.01×)"]


def test_aiperf_goals_give_the_median_of_each_round_s_own_ratio_beside_the_ratio_of_medians(
        capsys: pytest.CaptureFixture[str]) -> None:
    def row(tokens_per_s: float) -> dict[str, float]:
        return {"tok/s": tokens_per_s, "TTFT p50": 20.0, "TTFT p99": 40.0, "ITL p50": 2.0, "ITL p99": 4.0,
                "gap p99": 3.0}

    # The machine was slow in round 2 for both: round by round the stack read 1.00, 1.00, 0.82; the ratio of
    # the medians (900 / 1000) mixes rounds and reads 0.90.
    bench = _script("bench_aiperf")
    bench.print_goals({bench.Level(16): {"sglang": [row(1000), row(800), row(1100)],
                                                    "conveyor": [row(1000), row(800), row(900)]}})
    lines = capsys.readouterr().out.splitlines()
    assert "  c=16   output tok/s ≥ 0.97×: 0.90× NOT met (1.00×)" in lines
    assert "  c=16   ITL p99 ≤ 1.05×: 1.00× met (1.00×)" in lines

    # Rounds run together also carry each system's rate over only the time all streamed.
    shared_rounds = {"sglang": [{**row(1000), "tok/s shared": 1000.0}, {**row(800), "tok/s shared": 900.0}],
                     "conveyor": [{**row(900), "tok/s shared": 990.0}, {**row(800), "tok/s shared": 900.0}]}
    bench.print_goals({bench.Level(64): shared_rounds})
    lines = capsys.readouterr().out.splitlines()
    assert "  c=64   output tok/s ≥ 0.97×: 0.94× NOT met (0.95×; while all streamed 0.99×)" in lines


def test_aiperf_level_named_again_runs_again_with_fresh_prompts_and_is_reported_apart(tmp_path: Path,
                                                                                     fake_aiperf: None) -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_aiperf.py"), "--tokenizer", str(tmp_path), "--together",
         "--concurrency", "4", "8", "4", "--rounds", "2", "sglang=http://127.0.0.1:30000",
         "conveyor=http://127.0.0.1:29400", "--min-requests", "2", "--seed-base", "5", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=90, check=True)
    assert "concurrency 4#2, round 2/2: sglang, conveyor together" in completed.stderr
    assert "c=4    output tok/s ≥ 0.97×: 0.98× met" in completed.stdout
    assert "c=4#2  output tok/s ≥ 0.97×: 0.98× met" in completed.stdout
    out = tmp_path / "out"
    seeds = {(out / run / "conveyor" / "seed").read_text() for run in ("c4/r0", "c4/r1", "c8/r0", "c4-pass2/r0",
                                                                       "c4-pass2/r1")}
    assert len(seeds) == 5  # no run repeats another's prompts (the prefix cache would serve them)
    assert set(json.loads((out / "results.json").read_text())["levels"]) == {"4", "8", "4#2"}


def test_aiperf_groups_read_the_goals_off_each_system_s_mean_and_show_each_pair_apart(tmp_path: Path,
                                                                                       fake_aiperf: None) -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_aiperf.py"), "--tokenizer", str(tmp_path), "--together",
         "--concurrency", "4", "--rounds", "2", "--min-requests", "2", "--out", str(tmp_path / "out"),
         "server=http://127.0.0.1:30000", "server2=http://127.0.0.1:30002", "a=http://127.0.0.1:29000",
         "b=http://127.0.0.1:29400", "--group", "sglang=server,server2", "--group", "conveyor=a,b"],
        capture_output=True, text=True, timeout=90, check=True)
    assert "round 2/2: server, server2, a, b together" in completed.stderr
    # The fake's token rate is its URL's port: (29000 + 29400) / 2 over (30000 + 30002) / 2.
    assert "conveyor   | tok/s ratio by round: 0.97×, 0.97×" in completed.stdout
    assert "c=4    output tok/s ≥ 0.97×: 0.973× met" in completed.stdout
    assert "server ÷ server2 | tok/s by round: 1.00, 1.00" in completed.stdout  # the pair's own spread
    assert "a ÷ b | tok/s by round: 0.99, 0.99" in completed.stdout
    assert completed.stdout.count("issue 11's goals,") == 1  # the groups only, not every instance against them
    levels = json.loads((tmp_path / "out" / "results.json").read_text())["levels"]
    assert levels["4"]["conveyor"][0]["tok/s"] == 29200.0


def test_aiperf_group_of_unknown_targets_is_refused() -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_aiperf.py"), "--tokenizer", ".", "sglang=http://127.0.0.1:30000",
         "conveyor=http://127.0.0.1:8000", "--group", "s=sglang,server2", "--group", "c=conveyor,b"],
        capture_output=True, text=True, timeout=30)
    assert completed.returncode == 2
    assert "a group's members are targets" in completed.stderr


def test_aiperf_too_many_rounds_for_fresh_seeds_is_refused() -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_aiperf.py"), "--tokenizer", ".", "--rounds", "100",
         "sglang=http://127.0.0.1:30000"], capture_output=True, text=True, timeout=30)
    assert completed.returncode == 2
    assert "--rounds and each --rounds-at must be 1 to 99" in completed.stderr


def test_aiperf_together_from_runs_many_streams_at_once_and_one_stream_in_turn(tmp_path: Path,
                                                                              fake_aiperf: None) -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_aiperf.py"), "--tokenizer", str(tmp_path), "--together-from", "4",
         "--concurrency", "4", "1", "--rounds", "2", "--rounds-at", "1=3", "sglang=http://127.0.0.1:30000",
         "conveyor=http://127.0.0.1:29400", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=90, check=True)
    assert "warm-up 1/1 at concurrency 4: together" in completed.stderr
    assert "concurrency 4, round 2/2: sglang, conveyor together" in completed.stderr
    assert "concurrency 4, round 3/" not in completed.stderr
    assert "concurrency 1, round 2/3: conveyor" in completed.stderr  # one after another, the order reversed
    assert "concurrency 1, round 3/3: sglang" in completed.stderr  # its own number of rounds (--rounds-at 1=3)
    assert "c=4    output tok/s ≥ 0.97×: 0.98× met" in completed.stdout  # 29400 / 30000
    assert "c=1    TTFT p50 added ≤ 3 ms: +0.0 ms met" in completed.stdout
    assert "no per-request records (profile_export.jsonl missing)" in completed.stderr  # said, not an error


def test_after_load_phases_read_as_streams_by_seconds() -> None:
    bench = _script("bench_after_load")
    assert bench.parse_phase("256x40") == (256, 40.0)
    with pytest.raises(bench.argparse.ArgumentTypeError, match="STREAMSxSECONDS"):
        bench.parse_phase("256")


def test_sglang_steps_by_level_read_each_pass_of_an_aiperf_run_apart(tmp_path: Path) -> None:
    (tmp_path / "aiperf.log").write_text(
        "[bench-aiperf 05:00:00] warm-up 1/1 at concurrency 16: together\n"
        "[bench-aiperf 05:00:10] concurrency 16, round 1/1: sglang, conveyor together\n"
        "[bench-aiperf 05:01:00] concurrency 256, round 1/1: sglang, conveyor together\n"
        "[bench-aiperf 05:02:00] concurrency 16#2, round 1/1: sglang, conveyor together\n"
        "[bench-aiperf 05:03:00] aiperf took 60 s\n")

    def decode(stamp: str, running: int, tokens_per_s: float) -> str:
        return (f"[2026-11-27 {stamp}] Decode batch, #running-req: {running}, #token: 9000, token usage: 0.03, "
                f"gen throughput (token/s): {tokens_per_s:.2f}\n")

    # The stack keeps pace at 16 streams, then steps at half the server's rate in the second pass; at 256 streams
    # both are held at 128 running by their limit.
    (tmp_path / "server.log").write_text(decode("05:00:30", 16, 3200) + decode("05:01:30", 128, 12800)
                                         + decode("05:02:30", 16, 3200))
    (tmp_path / "stack.log").write_text(decode("05:00:30", 16, 3200) + decode("05:01:30", 128, 12800)
                                        + decode("05:02:30", 16, 1600))
    completed = subprocess.run(
        [sys.executable, str(SCRIPTS / "sglang_steps.py"), f"server={tmp_path / 'server.log'}",
         f"stack={tmp_path / 'stack.log'}", "--levels", str(tmp_path / "aiperf.log")],
        capture_output=True, text=True, timeout=30, check=True)
    tables = completed.stdout.split("\nlevel ")[1:]
    assert [table.splitlines()[0] for table in tables] == [
        "16: 12 to 16 running, 05:00:10-05:01:00", "256: 96 to 256 running, 05:01:00-05:02:00",
        "16#2: 12 to 16 running, 05:02:00-05:03:00"]
    assert "1.00x" in tables[0].splitlines()[-1]
    assert "1.00x" in tables[1].splitlines()[-1]
    assert "0.50x" in tables[2].splitlines()[-1]


def test_cpu_survey_times_every_allowed_cpu_and_marks_those_a_scheduler_would_hold(capsys) -> None:
    neighbours = _script("bench_cpu_neighbours")
    allowed = sorted(os.sched_getaffinity(0))
    neighbours.survey(rounds=2, window_s=0.02)
    out = capsys.readouterr().out
    assert sorted(os.sched_getaffinity(0)) == allowed  # the survey leaves this process where it found it
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == allowed
    assert all(float(row[1].replace(",", "")) > 0 for row in rows)
    held = neighbours.cpus_a_scheduler_would_hold(allowed)
    assert [int(row[0]) for row in rows if row[-1] == "*"] == held
    # What cpu_pinning would claim: none on a machine too small to spare them, else the highest-numbered whole cores.
    if held:
        assert max(held) == max(allowed)


def test_cpu_siblings_reads_every_other_cpu_and_leaves_this_process_where_it_was(capsys) -> None:
    neighbours = _script("bench_cpu_neighbours")
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one CPU: no other to spin on")
    neighbours.find_siblings(allowed[-1], rounds=1, window_s=0.02)
    out = capsys.readouterr().out
    assert sorted(os.sched_getaffinity(0)) == allowed
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("spinner on CPU")]
    listed = [int(row[3].rstrip(":")) for row in rows]
    assert listed and set(listed) <= set(allowed[:-1])  # the measured CPU is never its own neighbour
    assert len(listed) == min(6, len(allowed) - 1)


def test_hops_traced_beside_a_load_leave_out_the_points_stamped_without_a_request_id() -> None:
    hops = _script("trace_hops")
    idle, loaded = hops.points_of("mock"), hops.points_of("mock", loaded=True)
    assert set(hops.UNNAMED_POINTS) <= set(hops.points_of("mock", via_gateway=True))
    assert loaded == [point for point in idle if point not in hops.UNNAMED_POINTS]
    assert not set(hops.UNNAMED_POINTS) & set(hops.points_of("mock", loaded=True, via_gateway=True))
    with_sglang = hops.points_of("sglang", loaded=True)
    assert with_sglang.index("sglang.first_output") + 1 == with_sglang.index("engine.first_token")
    assert "decode.socket" not in with_sglang and with_sglang[-1] == "client_first"


def test_hops_through_the_gateway_put_its_points_around_the_stages_and_match_them_only_there(tmp_path: Path) -> None:
    hops = _script("trace_hops")
    through = hops.points_of("mock", via_gateway=True)
    assert through[:3] == ["submit", "gateway.request", "publish@processor"]
    assert through[-3:] == ["gateway.socket", "gateway.written", "client_first"]
    assert [point for point in through if not point.startswith("gateway.")] == hops.points_of("mock")
    # The gateway's own unnamed stamps (a request before its id exists, a frame off its socket) go only to requests
    # sent through it: a NATS client's request would otherwise take the next gateway request's stamps.
    (tmp_path / "gateway.jsonl").write_text(
        "\n".join(json.dumps({"point": point, "request_id": None, "t": t})
                  for point, t in [("gateway.request", 10.001), ("frames_out", 10.008), ("gateway.socket", 10.009)]))
    nats = hops.assemble({"hop1": {"submit": 10.0, "engine.first_token": 10.007}}, tmp_path)
    via = hops.assemble({"cmpl-1": {"submit": 10.0, "engine.first_token": 10.007}}, tmp_path, via_gateway=True)
    assert "gateway.request" not in nats["hop1"] and nats["hop1"]["first_frame_out"] == 10.008
    assert via["cmpl-1"]["gateway.request"] == 10.001 and via["cmpl-1"]["gateway.socket"] == 10.009


def test_gc_probe_counts_a_process_collections_and_the_report_reads_them_back(tmp_path: Path) -> None:
    probe_dir = tmp_path / "gc"
    # Three full collections, one of the youngest generation, a second apart from the first line to the last.
    code = "import gc, time\ngc.collect(0)\ngc.collect()\ntime.sleep(1.1)\ngc.collect()\ngc.collect()\n"
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS / "gc_probe"), "CONVEYOR_GC_PROBE_DIR": str(probe_dir),
           "CONVEYOR_GC_PROBE_EVERY_S": "0"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    [path] = probe_dir.glob("gc-*.jsonl")
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["counts"][2] >= 3 and last["counts"][0] >= 1
    assert last["seconds"][2] > 0

    report = _script("gc_report")
    [process] = report.read_probe(probe_dir)
    measured = report.between(process, process.samples[0].clock_s, process.samples[-1].clock_s)
    assert measured is not None
    span_s, seconds, counts = measured
    assert span_s >= 1 and counts[2] >= 2 and seconds[2] > 0


def test_gc_probe_does_nothing_without_its_folder(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "CONVEYOR_GC_PROBE_DIR"}
    env["PYTHONPATH"] = str(SCRIPTS / "gc_probe")
    code = "import gc, sitecustomize\ngc.collect()\nprint(len(gc.callbacks))"
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, check=True, timeout=60,
                            capture_output=True, text=True)
    assert result.stdout.strip() == "0"
    assert not list(tmp_path.iterdir())


def test_goals_noise_counts_the_rows_each_system_meets_against_each_other_one(tmp_path: Path) -> None:
    def row(tokens_per_s: float, itl_p99_ms: float = 4.0) -> dict[str, float]:
        return {"tok/s": tokens_per_s, "TTFT p50": 20.0, "TTFT p99": 40.0, "ITL p50": 2.0, "ITL p99": itl_p99_ms,
                "gap p99": 3.0}

    # Two levels (2 goals at 16, 3 at 1); server2 is the server's twin, 5% slower at 16 streams.
    results = {"seed_base": 1, "levels": {
        "16": {"sglang": [row(1000), row(1000)], "server2": [row(950), row(950)], "conveyor": [row(990), row(990)]},
        "1": {"sglang": [row(400), row(400)], "server2": [row(400), row(400)], "conveyor": [row(400), row(400)]}}}
    path = tmp_path / "aiperf-results.json"
    path.write_text(json.dumps(results))
    # -S: no site-packages, as on the GPU machine, whose python3 has only the standard library.
    completed = subprocess.run([sys.executable, "-S", str(SCRIPTS / "goals_noise.py"), str(path),
                                "--pair", "server2=sglang"], capture_output=True, text=True, timeout=60, check=True)
    lines = completed.stdout.splitlines()
    matrix = {line.split()[0]: line.split()[1:] for line in lines[2:5]}
    assert matrix == {"sglang": ["-", "5/5", "5/5"], "server2": ["4/5", "-", "4/5"], "conveyor": ["5/5", "5/5", "-"]}
    assert "server2 against sglang: 4 of 5 met" in lines
    assert "  c=16   output tok/s ≥ 0.97×: 0.95× NOT met" in lines

    missing = subprocess.run([sys.executable, str(SCRIPTS / "goals_noise.py"), str(path), "--pair", "b=sglang"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "not in every level" in missing.stderr and "b" in missing.stderr
