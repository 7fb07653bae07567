"""The `autopar` command line, called in-process through main(argv) (and once as a real console script)."""
from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys

import pytest

from autopar.cli import main
from autopar.plan import Plan

TINY = ["llama-tiny", "--mesh", "2x2", "--axes", "dp,tp", "--device", "cpu", "--batch", "4", "--seq", "32"]


@pytest.fixture(scope="module")
def plan_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    solver, mega = str(d / "solver.json"), str(d / "megatron.json")
    assert main(["plan", *TINY, "-o", solver, "--summary"]) == 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *TINY, "--recipe", "megatron", "-o", mega]) == 0
    return solver, mega, out.getvalue()


def test_plan_writes_a_loadable_json(plan_files):
    p = Plan.load(plan_files[0])
    assert p.mesh.axis_names == ("dp", "tp") and p.mesh.shape == (2, 2) and p.device == "cpu"
    m = Plan.load(plan_files[1])
    assert m.solver_stats["recipe"] == "megatron" and "tp" in m.techniques


def test_plan_prints_the_table(plan_files):
    out = plan_files[2]
    assert out.startswith("autopar plan") and "\x1b" not in out
    assert "tok_embeddings.weight" in out and "#0 dp=S(0) tp=R" in out and "recipe       megatron" in out


def test_explain(plan_files, capsys):
    assert main(["explain", plan_files[1], "layers.1.attention.wq.weight"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("parameter layers.*.attention.wq.weight") and "dp=R tp=S(0)" in out


def test_diff(plan_files, capsys):
    assert main(["diff", plan_files[0], plan_files[1]]) == 0
    out = capsys.readouterr().out
    assert "plan diff: solver.json -> megatron.json" in out and "step time" in out
    assert "layers.*.attention.wo.weight" in out and "dp=R tp=S(1)" in out


def test_report(plan_files, tmp_path, capsys):
    html, png = tmp_path / "r.html", tmp_path / "png"
    assert main(["report", plan_files[1], "-o", str(html), "--png", str(png)]) == 0
    assert html.read_text().count("data:image/png;base64,") == len(os.listdir(png)) >= 3


@pytest.mark.slow
def test_compare_with_a_plan_file_alone(plan_files, capsys):
    """The plan file records its model, mesh and config: nothing needs retyping."""
    p = Plan.load(plan_files[0])
    assert p.model == {"source": "builtin", "name": "llama-tiny", "batch": 4, "seq": 32}
    assert p.config["device"] == "cpu"
    assert main(["compare", plan_files[0], "--recipes", "ddp,hsdp"]) == 0
    out, err = capsys.readouterr()
    assert "autopar" in out and "ddp" in out and "1.00x" in out
    assert "not run: hsdp needs two data axes" in " ".join(out.split())
    assert "different model" not in err
    assert main(["compare", plan_files[0], "--recipes", "ddp", "--batch", "8"]) == 0  # an override is honoured
    assert "different model" in capsys.readouterr().err


def test_program_prints_a_ranks_code_collectives_and_buckets(plan_files, capsys):
    assert main(["program", plan_files[1], "--rank", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("autopar program") and "3 of 4 on dp=2 x tp=2 (coordinates dp=1, tp=1)" in out
    # Megatron over tp: the row-parallel outputs are all-reduced over tp, data-parallel gradients in buckets.
    assert re.search(r"forward +all_reduce +tp ", out) and re.search(r"backward +all_reduce +dp .*bucket of", out)
    assert "layers.*.attention.wq.weight" in out and "dp=R tp=S(0)" in out
    assert "def forward" in out and "_c10d_functional" in out
    assert main(["program", plan_files[1], "--rank", "1", "--no-code"]) == 0
    out = capsys.readouterr().out
    assert "def forward" not in out and "coordinates dp=0, tp=1" in out
    assert main(["program", plan_files[1], "--rank", "4"]) == 2
    assert "--rank 4 is outside the plan's mesh of 4 ranks" in capsys.readouterr().err


def test_plan_of_a_live_model_says_what_it_needs(tmp_path, capsys):
    import torch

    import autopar
    from autopar.models.llama import LLAMA_TINY, Llama, cross_entropy_loss

    p = autopar.plan(Llama(LLAMA_TINY), autopar.fake_mesh(2, "dp", "cpu"), (torch.zeros(4, 16, dtype=torch.long),),
                     loss_fn=cross_entropy_loss, config=autopar.Config(solver=autopar.SolverConfig(show_progress=False)))
    path = str(tmp_path / "live.json")
    p.save(path)
    for argv in (["program", path], ["compare", path]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "made in Python from a live autopar.models.llama.Llama" in err and "path/to/model.py:" in err, err


@pytest.mark.parametrize("argv, message", [
    (["plan", "llama-huge", "--mesh", "2x2"], "unknown model 'llama-huge'; built-in models: llama3-8b"),
    (["plan", "llama-tiny", "--mesh", "2x2", "--axes", "dp"], "--mesh 2x2 has 2 axes but --axes names 1"),
    (["plan", "llama-tiny", "--mesh", "2x2", "--device", "tpu"], "unknown device 'tpu'; known devices: a100"),
    (["plan", "llama-tiny", "--mesh", "2by2"], "--mesh '2by2' must look like 8 or 8x8"),
    (["plan", "llama-tiny", "--mesh", "2x2", "--links", "ib"], "--links gives 1 link kinds for 2 axes"),
    (["plan", "llama-tiny", "--mesh", "2x2", "--seq", "4096"], "--seq 4096 exceeds llama-tiny's max_seq_len 64"),
    (["plan", "llama-tiny", "--mesh", "2x2", "--recipe", "zero9"], "unknown recipe 'zero9'"),
    (["plan", "nofile.py:build", "--mesh", "2"], "model file 'nofile.py' does not exist"),
    (["compare", "llama-tiny", "--mesh", "2x2", "--recipes", "ddp,zero9"], "unknown recipe 'zero9'"),
    (["explain", "missing.json", "x"], "plan file 'missing.json' does not exist"),
    (["plan"], "the following arguments are required: model"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("autopar: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err and out == ""


def test_unknown_name_in_explain(plan_files, capsys):
    assert main(["explain", plan_files[0], "layers.0.attention.wz.weight"]) == 2
    err = capsys.readouterr().err
    assert "neither a parameter nor a node" in err and err.count("\n") == 1


def test_user_model_file(tmp_path, capsys):
    f = tmp_path / "mlp.py"
    f.write_text("import torch\n"
                 "def build_model():\n    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),"
                 " torch.nn.Linear(32, 4))\n"
                 "def example_inputs(batch=8):\n    return (torch.randn(batch, 16),)\n"
                 "def loss(out, x):\n    return out.pow(2).mean()\n")
    out_json = tmp_path / "p.json"
    assert main(["plan", f"{f}:build_model", "--loss", f"{f}:loss", "--mesh", "2", "--device", "cpu",
                 "-o", str(out_json), "--summary"]) == 0
    assert Plan.load(str(out_json)).mesh.axis_names == ("dp",)


@pytest.mark.parametrize("command", ["plan", "compare", "explain", "diff", "report", "demo"])
def test_help(command, capsys):
    assert main([command, "--help"]) == 0
    assert "usage: autopar " + command in capsys.readouterr().out


@pytest.mark.slow
def test_console_script_errors_without_traceback():
    exe = os.path.join(os.path.dirname(sys.executable), "autopar")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "autopar.cli"]
    r = subprocess.run(cmd + ["plan", "gpt5", "--mesh", "4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("autopar: error: unknown model 'gpt5'") and "Traceback" not in r.stderr


@pytest.mark.slow
def test_plan_precision_flag(tmp_path):
    path = str(tmp_path / "bf16.json")
    assert main(["plan", *TINY, "--precision", "bf16", "-o", path, "--summary"]) == 0
    assert Plan.load(path).mixed_precision == "bf16"
    assert main(["plan", *TINY, "--precision", "fp8"]) != 0
