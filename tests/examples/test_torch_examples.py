"""The PyTorch examples' shared command line (examples/_cli.py) and its refusals, and what the
examples take, run as the programs a user runs, before any model is built: on the CPU."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The example run as a user runs it (python examples/NAME), from `cwd`, with this run's
    PYTHONPATH made absolute (so that another cwd imports the same memra_cuda)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(Path(entry).resolve())
                                        for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry)
    return subprocess.run([sys.executable, str(EXAMPLES / name), *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def torch_stack():
    """torch, where it is installed with transformers."""
    torch = pytest.importorskip("torch", reason="needs PyTorch (pip install 'memra_cuda[torch]')")
    pytest.importorskip("transformers", reason="the examples need transformers")
    return torch


# -- the command line, in-process -----------------------------------------------------------------

@pytest.fixture(scope="module")
def cli(torch_stack):
    """examples/_cli.py, imported as an example run as a script imports it (its folder on sys.path)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(EXAMPLES))
        yield importlib.import_module("_cli")


@pytest.mark.torch
def test_the_examples_share_their_command_line_and_its_refusals(cli, capsys):
    from memra_cuda.torch import SamplingParams
    parser = cli.command_line("trees", k=False)
    args, sampling = cli.parse(parser, ["--temperature", "0.7", "--hybrid", "--state-rollback", "flip"])
    assert (args.size, args.tokens, args.state_rollback, args.model, sampling) == ("small", 256, "flip", None,
                                                                                  SamplingParams(0.7))
    assert not hasattr(args, "k") and cli.parse(cli.command_line("chains"), [])[0].k == 4
    refused = {("--state-rollback", "flip"): "add --hybrid", ("--draft", "d"): "add --model DIR",
               ("--prompt", "x"): "add --model DIR", ("--model", "m", "--hybrid"): "leave out --model",
               ("--temperature", "0"): "temperature must be > 0", ("--draft-layers", "0"): "at least one layer"}
    for argv, message in refused.items():
        with pytest.raises(SystemExit):
            cli.parse(parser, list(argv))
        assert message in capsys.readouterr().err


@pytest.mark.torch
def test_the_requests_are_the_random_models_prompts_or_a_loaded_tokenizers(cli):
    from memra_cuda.torch.testing import PROMPT
    parser = cli.command_line("chains")
    one, eight = (cli.parse(parser, ["--batch", str(b), "--tokens", "9"])[0] for b in (1, 8))
    assert cli.requests(one, None) == [(PROMPT, 9, None, 0)]
    rows = cli.requests(eight, None)
    assert len(rows) == 8 and len({tuple(r.prompt) for r in rows}) == 8 and [r.seed for r in rows] == list(range(8))

    class Words:
        eos_token_id = 1

        def encode(self, text: str) -> list[int]:
            return [len(word) for word in text.split()]

    loaded = cli.parse(parser, ["--model", "m", "--prompt", "a bb", "--prompt", "ccc", "--batch", "3", "--eos", "7"])[0]
    assert cli.requests(loaded, Words()) == [([1, 2], 256, 7, 0), ([3], 256, 7, 1), ([1, 2], 256, 7, 2)]
    assert cli.requests(cli.parse(parser, ["--model", "m"])[0], Words(), 2)[1].eos == 1  # the tokenizer's EOS


# -- the examples as programs, before any model is built ------------------------------------------

@pytest.mark.torch
def test_the_examples_say_what_they_take(torch_stack, tmp_path):
    for name in ("torch_llama.py", "torch_tree.py"):
        done = run_example(name, "--help", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert "--model DIR" in done.stdout and "--draft DIR" in done.stdout and "--size {large,small}" in done.stdout
    assert "--serve N" in run_example("torch_llama.py", "--help", cwd=tmp_path).stdout


@pytest.mark.torch
def test_auto_takes_the_pick_of_the_decoding_asked_for_and_refuses_where_the_chain_is_faster(torch_stack, tmp_path):
    """Refused before any model is built (this machine has no GPU to build one on), from any cwd:
    the picks are the checkout's, benchmarks/picks.py."""
    for argv in (["--tree", "auto", "--batch", "8"], ["--tree", "auto", "--size", "large", "--temperature", "1"]):
        done = run_example("torch_tree.py", *argv, cwd=tmp_path)
        assert done.returncode == 2 and "faster by the chain" in done.stderr, done.stderr
    done = run_example("torch_tree.py", "--tree", "auto", "--model", "somewhere", cwd=tmp_path)
    assert done.returncode == 2 and "name a --tree" in done.stderr, done.stderr
