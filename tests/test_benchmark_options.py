"""The benchmark scripts refuse mistaken options with one argparse error, before measuring anything."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "run_benchmarks.py"


def script_module(script: Path):
    """A benchmark script imported as a module (once per test process)."""
    name = f"benchmark_{script.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, script)
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


def refusal(script: Path, arguments: list, capsys, monkeypatch) -> tuple[int, str]:
    """Runs `script`'s main() in this process (its argparse checks come before anything is measured) with
    `arguments`; returns the exit status and what it wrote to stderr."""
    module = script_module(script)
    monkeypatch.setattr(sys, "argv", [str(script), *arguments])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        module.main()
    return exit.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--dtypes", "float33"], "--dtypes: float33 is not float32, bfloat16 or float16"),
        (["--prefill-limits", "mistral=abc"], "give MODEL=TOKENS pairs"),
        (["--models", "samba,gpt"], "unknown model 'gpt'"),
    ],
)
def test_mistaken_options_end_in_one_error(tmp_path, arguments, message, capsys, monkeypatch):
    status, stderr = refusal(SCRIPT, [*arguments, "--out", str(tmp_path / "out")], capsys, monkeypatch)
    assert status == 2 and message in stderr
    assert not (tmp_path / "out").exists()  # nothing measured, nothing written


SERVING = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_serving.py"


@pytest.mark.parametrize(
    "arguments, message",
    [
        ([], "--vllm-python is required"),
        (["--vllm-python", "/no/such/python"], "--vllm-python /no/such/python: no such program"),
        (["--vllm-python", sys.executable, "--requests", "0"], "--requests must be at least 1"),
        (
            ["--vllm-python", sys.executable, "--out", "/no/such/folder/out.json"],
            "the folder /no/such/folder does not",
        ),
    ],
)
def test_the_serving_benchmark_refuses_mistaken_options(arguments, message, capsys, monkeypatch):
    status, stderr = refusal(SERVING, arguments, capsys, monkeypatch)
    assert status == 2 and message in stderr


DECODE = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_speed.py"


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--dtypes", "float33"], "--dtypes: float33 is not float32, bfloat16 or float16"),
        (["--contexts", "1K"], "--contexts: give token counts separated by commas, got '1K'"),
        (["--contexts", "0"], "--contexts must be at least 1 token each"),
        (["--steps", "0"], "--steps and --repeats must be at least 1"),
        (["--out", "/no/such/folder/out.json"], "--out: the folder /no/such/folder does not exist"),
    ],
)
def test_the_decode_benchmark_refuses_mistaken_options(arguments, message, capsys, monkeypatch):
    status, stderr = refusal(DECODE, arguments, capsys, monkeypatch)
    assert status == 2 and message in stderr


FIXTURES = Path(__file__).resolve().parents[1] / "vllm_plugin" / "tests" / "make_fixtures.py"


def test_the_plugin_fixtures_script_writes_nothing_over_what_it_did_not_write(tmp_path):
    """make_fixtures.py OUT: no OUT, a file, a folder of someone else's: one error each, nothing touched."""

    def run(*args):
        return subprocess.run([sys.executable, str(FIXTURES), *args], capture_output=True, text=True, timeout=120)

    result = run()
    assert result.returncode == 1 and "usage: python vllm_plugin/tests/make_fixtures.py OUT" in result.stderr
    # the checks of OUT, in this process (the script's main() starts with them)
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES)
    sys.path.insert(0, str(FIXTURES.parent))
    try:
        fixtures = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fixtures)
    finally:
        sys.path.remove(str(FIXTURES.parent))
    (tmp_path / "a-file").write_text("mine")
    with pytest.raises(SystemExit, match="is a file"):
        fixtures.main(tmp_path / "a-file")
    assert (tmp_path / "a-file").read_text() == "mine"
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="holds files this script did not write"):
        fixtures.main(tmp_path / "theirs")
    assert [p.name for p in (tmp_path / "theirs").iterdir()] == ["notes.txt"]


SAMBAY = Path(__file__).resolve().parents[1] / "benchmarks" / "sambay_full_size.py"


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--models", "sambay,gpt"], "--models sambay,gpt: 'gpt' is not one of sambay, llama"),
        (["--release-config", "/no/such/config.json"], "--release-config /no/such/config.json: no such file"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--decode", "1K"], "--decode: give token counts of at least 1, separated by commas, got '1K'"),
        (["--prefill", "0"], "--prefill: give token counts of at least 1"),
    ],
)
def test_the_full_size_sambay_benchmark_refuses_mistaken_options(tmp_path, arguments, message):
    """Refused before the matmul timing and before any model is built (each would take minutes)."""
    config = tmp_path / "config.json"
    config.write_text("{}")
    result = subprocess.run(
        [sys.executable, str(SAMBAY), "--release-config", str(config), *arguments, "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


CACHE_SIZE = Path(__file__).resolve().parents[1] / "benchmarks" / "cache_size.py"


def test_the_cache_size_script_refuses_a_file_as_its_folder_and_writes_its_table(tmp_path):
    (tmp_path / "file").write_text("mine")
    result = subprocess.run(
        [sys.executable, str(CACHE_SIZE), "--out", str(tmp_path / "file")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "--out" in result.stderr and "is a file" in result.stderr
    assert (tmp_path / "file").read_text() == "mine"
    result = subprocess.run(
        [sys.executable, str(CACHE_SIZE), "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    table = json.loads((tmp_path / "out" / "cache_size.json").read_text())["cache_MiB"]
    assert len(set(table["Samba-421M"])) == 1  # flat: the same bytes at 1K and at 1M tokens
    full = table["Samba-421M, all full attention"]
    assert full[1] == 2 * full[0] and full[-1] == 1024 * full[0]  # linear in the context
    assert (tmp_path / "out" / "cache_size.png").stat().st_size > 0


GPU = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"
# The GPU benchmark's whole runs on tiny models take half a minute of the 10 the README's test command may take:
# .ci/run runs them in a step of its own, which sets SAMBA_HF_TEST_GPU_BENCHMARK.
gpu_benchmark_step = pytest.mark.skipif(
    not os.environ.get("SAMBA_HF_TEST_GPU_BENCHMARK"), reason="run in .ci/run's GPU benchmark step"
)
SMOKE = [
    "--smoke",
    "--prefill",
    "32,64",
    "--decode",
    "24,40",
    "--batch",
    "2",
    "--steps",
    "2",
    "--train",
    "32",
    "--graphs-max-context",
    "24",
]


def test_the_gpu_script_refuses_a_wrong_stage_a_missing_bundle_and_a_machine_without_a_gpu(tmp_path):
    """benchmarks/gpu_run.sh, as a user might start it wrongly: each is one line, exit 1, and nothing written."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_run.sh"
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "WORK": str(tmp_path / "work"),
        "BUNDLE": str(bundle),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }  # python3: this CPU-only torch
    cases = [
        (["pip"], "the stage is second, bench-kernels or nothing (all), not pip"),  # an old name
        (["second"], f"no wheels in {bundle}"),
        ([], "sees no CUDA GPU here"),
    ]
    for number, (argv, said) in enumerate(cases):
        if number == 2:
            (bundle / "transformers-5.24.0-py3-none-any.whl").write_bytes(b"")
        result = subprocess.run(["bash", str(script), *argv], capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 1 and result.stdout == "", result
        assert result.stderr.count("\n") == 1 and said in result.stderr, result.stderr
        assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


@gpu_benchmark_step
def test_the_gpu_benchmark_runs_every_measurement_on_tiny_models(tmp_path):
    """--smoke: the whole of benchmarks/gpu.py on tiny models on the CPU (the GPU machine's time is too short to find
    a bug in the script there), then its plot of the JSON."""
    out = tmp_path / "run.json"
    result = subprocess.run(
        [sys.executable, str(GPU), *SMOKE, "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = json.loads(out.read_text())
    assert set(run["models"]) == {
        "Samba-1.3B",
        "Llama-1.3B",
        "Phi-4-mini-flash",
        "Llama-3.8B",
        "Mamba-2-Hybrid",
        "NemotronH",
    }
    assert run["label"] == "torch" and run["kernels"]["selective_scan_fn"] is False  # nothing installed here
    assert set(run["sliding_attention"]) == {"32", "64"}
    assert all(
        row["window_keys_per_s"] > 0 and row["full_causal_keys_per_s"] > 0 for row in run["sliding_attention"].values()
    )
    assert all(row["conv1d_seconds"] > 0 and row["shifted_adds_seconds"] > 0 for row in run["mamba_conv"].values())
    # the scans: the one path a CPU without Triton has, forward at each length and with its backward at the longest
    assert set(run["mamba_scan"]) == {"32", "64"}
    for kind in ("samba", "mamba2"):
        assert all(
            row[f"{kind}_pytorch_seconds"] > 0 and f"{kind}_triton_seconds" not in row
            for row in run["mamba_scan"].values()
        ), kind
        assert run["mamba_scan"]["64"][f"{kind}_pytorch_train_seconds"] > 0
    assert "Triton scan is not available" in run["scan_configs"]["skipped"]  # (timed under the interpreter in CI)
    for name, row in run["models"].items():
        assert set(row["prefill"]) == {"32", "64"} and set(row["decode"]) == {"24x1", "24x2", "40x1", "40x2"}, name
        measured = [
            *row["prefill"].values(),
            *row["train"].values(),
            *(mode for entry in row["decode"].values() for mode in entry.values()),
        ]
        assert all(m.get("tokens_per_s", 0) > 0 for m in measured), (name, measured)
        assert "graphs" in row["decode"]["24x2"] and "graphs" not in row["decode"]["40x1"]  # --graphs-max-context
        # the compiled step's own time where generate compiled it, and the yardstick: the weights read once
        graphs = row["decode"]["24x2"]["graphs"]
        assert (graphs["forward_ms"] > 0) if graphs["compiled"] else graphs["forward_ms"] is None, (name, graphs)
        assert 0 < row["weights_read"]["weights_read_ms"] and row["weights_read"]["weights_gib"] > 0, name
        # transformers' models are also timed with sdpa kept off cuDNN (as samba-hf's are over a cache)
        assert all(
            ("eager_no_cudnn" in entry) == (name in ("Llama-1.3B", "Llama-3.8B", "NemotronH"))
            for entry in row["decode"].values()
        ), name
        # checking 9 tokens (8 drafts) against a one-token step, on Samba, Phi-4-mini-flash and their Llamas
        if name in ("Samba-1.3B", "Llama-1.3B", "Phi-4-mini-flash", "Llama-3.8B"):
            assert set(row["verify"]) == {"24", "40"}, name
            assert all(v["check_ms"] > 0 and v["one_step_ms"] > 0 and v["tokens"] == 9 for v in row["verify"].values())
        else:
            assert "verify" not in row, name
        assert row["decode_profile"]["ops_per_step"] > 10 and row["decode_profile"]["ms_per_step_cpu_by_op"], name
        # which attention kernels a step took (every one of these models has attention layers)
        assert any("attention" in op for op, *_ in row["decode_profile"]["attention_ops_per_step"]), name
    shown = subprocess.run(
        [sys.executable, str(GPU), "--table", str(out)], capture_output=True, text=True, timeout=300
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    rows = [line for line in shown.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 6 and "x)" in rows[1]  # a heading and the six models; Samba's ratio to Llama
    figure = tmp_path / "figure.png"
    drawn = subprocess.run(
        [sys.executable, str(GPU), "--plot", str(out), "--plot-out", str(figure)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert drawn.returncode == 0 and figure.read_bytes()[:4] == b"\x89PNG", drawn.stderr[-2000:]


@gpu_benchmark_step
def test_the_gpu_benchmark_keeps_nemotron_h_on_its_torch_path_with_kernels_triton(tmp_path):
    """#32 compares the Mamba-2-Hybrid with transformers' NemotronH on its torch path; NemotronH takes mamba-ssm
    wherever it imports (the H100 run's `--kernels triton` ran it on mamba-ssm). An importable package named
    mamba_ssm, with the one function NemotronH looks for, stands in for an installed mamba-ssm here (what is tested
    is the benchmark's hiding, not the package): NemotronH takes it, unless the benchmark hides the packages first."""
    package = tmp_path / "mamba_ssm"
    package.mkdir()
    (package / "__init__.py").write_text("def mamba_chunk_scan_combined(*args, **kwargs):\n    raise AssertionError\n")
    probe = (
        "import importlib.util, inspect, sys\n"
        "spec = importlib.util.spec_from_file_location('gpu', sys.argv[1])\n"
        "gpu = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(gpu)\n"
        "if sys.argv[2] == 'hide':\n"
        "    gpu.hide_kernel_packages()\n"
        "from transformers.models.nemotron_h import modeling_nemotron_h\n"
        "print(inspect.getclosurevars(modeling_nemotron_h.mamba2_chunk_scan).nonlocals['is_new_implementation'])\n"
        "print(gpu.kernels_present()['nemotron_h_mamba_ssm'])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    taken = {}
    for mode in ("keep", "hide"):
        result = subprocess.run(
            [sys.executable, "-c", probe, str(GPU), mode], capture_output=True, text=True, env=env, timeout=300
        )
        assert result.returncode == 0, result.stderr[-2000:]
        taken[mode] = result.stdout.split()
    assert taken == {"keep": ["True", "True"], "hide": ["False", "False"]}


def test_the_gpu_benchmark_says_in_one_line_that_there_is_no_gpu(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would measure")
    status = script_module(GPU).main(["--out", str(tmp_path / "run.json")])
    out, err = capsys.readouterr()
    assert status == 1 and out == ""
    assert err.count("\n") == 1 and "no CUDA GPU on this machine" in err
    assert not (tmp_path / "run.json").exists()


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--models", "Samba-1.3B,GPT"], "--models takes names from"),
        (["--prefill", "2k"], "--prefill takes comma-separated token counts"),
        (["--decode", "0"], "--decode takes positive numbers"),
        (["--steps", "1"], "--steps 2 or more"),
        (["--batch", "16,x"], "--batch takes comma-separated sizes"),
        (["--verify-tokens", "1"], "--verify-tokens takes 0 (not measured) or 2 or more tokens"),
        (["--plot", "/no/such/run.json"], "--plot: no such file: /no/such/run.json"),
        (["--table", "/no/such/run.json"], "--table: no such file: /no/such/run.json"),
        (["--kernels", "mamba"], "argument --kernels: invalid choice"),
        (["--out", "."], "--out . is a folder"),
    ],
)
def test_the_gpu_benchmark_refuses_mistaken_options(arguments, message, capsys, monkeypatch):
    status, stderr = refusal(GPU, arguments, capsys, monkeypatch)
    assert status == 2 and message in stderr


def test_the_gpu_benchmark_times_the_compiled_step_itself(tmp_path):
    """decode_graphs times each call of the compiled forward generate takes (on a GPU between CUDA events: the
    replay's own time, set against the weights read once). generate compiles on a CPU only when asked to
    (`_compile_all_devices`), with the eager backend here: the timing wrapper runs, and is gone afterwards."""
    import importlib.util

    import torch
    from transformers import CompileConfig

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import tiny_model

    spec = importlib.util.spec_from_file_location("gpu_benchmark", GPU)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    model = tiny_model(seed=1)
    config = CompileConfig(backend="eager")
    config._compile_all_devices = True  # (no argument of CompileConfig in transformers 5.24)
    model.generation_config.compile_config = config
    result = gpu.decode_graphs(model, context=6, batch=1, steps=4)
    assert result["compiled"] and result["forward_ms"] > 0 and result["ms_per_step"] > 0, result
    assert "get_compiled_call" not in vars(model)  # the class's method again
    weights = gpu.weights_read(model)
    assert weights["weights_gib"] * 2**30 == sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights["weights_read_ms"] > 0
    torch.compiler.reset()
