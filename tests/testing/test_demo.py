"""`python -m memra_cuda --help` (the demo, `make demo`), on the CPU: a user who asks what the
demo does reads its whole description and what each option is for; an option out of range is
the parser's error, before any engine is made; no GPU is one line and exit status 1."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

import memra_cuda.__main__ as demo
from memra_cuda.buffers.capacity import kv_capacity
from memra_cuda.buffers.geometry import Geometry
from memra_cuda.driver.errors import CudaUnavailable
from memra_cuda.driver.values import I32_MOST


def _help() -> str:
    run = subprocess.run([sys.executable, "-m", "memra_cuda", "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and not run.stderr, run.stderr
    return run.stdout


def test_help_prints_the_whole_description():
    assert demo.__doc__ and " ".join(demo.__doc__.split()) in " ".join(_help().split())


def test_help_says_what_every_option_is_for():
    options = _help().split("\noptions:\n", 1)[1]
    entries = re.split(r"\n(?=  -)", options.strip("\n"))  # an option, its help (wrapped, or on the next line)
    assert {entry.split()[0].rstrip(",") for entry in entries} == {
        "-h", "--k", "--m-rounds", "--tokens", "--mode", "--eos", "--prompt"}
    for entry in entries:
        invocation, *help_text = re.split(r"\s{2,}", entry.strip(), maxsplit=1)
        assert help_text and help_text[0].strip(), f"{invocation} has no help"


def test_an_option_out_of_range_is_a_usage_error_before_any_engine(monkeypatch, capsys):
    """`--k -1` and `--m-rounds 0` were refused by Geometry inside `with engine:`, a traceback on a
    machine with a GPU; now argparse's exit status 2 and one line naming the value, before any
    engine is made (Engine here fails the test if it is)."""
    def no_engine():
        raise AssertionError("an engine was made for options out of range")

    monkeypatch.setattr(demo, "Engine", no_engine)
    for argv, message in ((["--k", "-1"], "--k -1 --m-rounds 16: k must be an int of at least 0, not -1"),
                          (["--m-rounds", "0"], "--k 4 --m-rounds 0: m_rounds must be an int of at least 1, not 0"),
                          (["--k", "4", "--m-rounds", str(2**32)],
                           f"--k 4 --m-rounds {2**32}: m_rounds must be at most"),
                          (["--tokens", "-3"], "--tokens must be an int from 0 to 2147483647, not -3"),
                          # a row's budget is an i32: past it, the caches were allocated for it (tens of GB)
                          # and generate() refused it after, a traceback
                          (["--tokens", str(2**31)], f"--tokens must be an int from 0 to 2147483647, not {2**31}"),
                          # token ids, at their limits (a negative one met a traceback in the engine's copy)
                          (["--prompt", "5", "-1"], "--prompt and --eos take the toy's token ids, each must be an int "
                                                    "from 0 to 31999, not -1"),
                          # past the toy's vocabulary: its prefill's refusal after the engine's work, exit status 1
                          (["--prompt", "5", "32000"], "--prompt and --eos take the toy's token ids, each must be an "
                                                       "int from 0 to 31999, not 32000"),
                          (["--eos", "32000"], "--prompt and --eos take the toy's token ids, each must be an int "
                                               "from 0 to 31999, not 32000"),
                          (["--eos", "-1"], "--prompt and --eos take the toy's token ids"),
                          # a budget whose cache's positions pass an i32: ToyLM refused it after the engine was made
                          (["--tokens", str(2**31 - 1)], f"--tokens {2**31 - 1} needs a KV cache of 2147483732 entries "
                                                         "in rounds of k=4, M=16, past the 2147483647"),
                          (["--tokens", str(2**31 - 81), "--mode", "overlap"],
                           f"--tokens {2**31 - 81} needs a KV cache of 2147483732 entries in rounds of "
                           "k=4, M=16 in overlap")):
        with pytest.raises(SystemExit) as exit_:
            demo.main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"python -m memra_cuda: error: {message}" in err, err


def test_the_most_tokens_and_token_ids_the_toy_takes_pass_the_parser(monkeypatch, capsys):
    """--tokens at its limit, the most whose cache (kv_capacity) an i32 position reaches, and the
    toy's last token id are no usage error: the demo goes on to its engine; one token more is."""
    class Made(Exception):
        pass

    def engine():
        raise Made

    monkeypatch.setattr(demo, "Engine", engine)
    prompt = ["0", "1", "2", "3", "31999"]  # as long as the default one, its last token the toy's last
    for mode in ("graph", "overlap"):
        most = I32_MOST - kv_capacity(len(prompt), 0, Geometry(4, 16), overlap=mode == "overlap")
        with pytest.raises(Made):
            demo.main(["--tokens", str(most), "--mode", mode, "--prompt", *prompt, "--eos", "31999"])
        with pytest.raises(SystemExit) as exit_:
            demo.main(["--tokens", str(most + 1), "--mode", mode, "--prompt", *prompt])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"--tokens {most + 1} needs a KV cache of 2147483648 entries" in err, err


def test_no_gpu_is_one_line_and_the_status_the_examples_give(monkeypatch, capsys):
    """Without a GPU the demo exited 2, argparse's status for a command line it refuses, where
    examples/own_kernels.py, the PyTorch examples and the benchmarks exit 1 (as a script of one's
    own does, its CudaUnavailable uncaught): a wrapper took a machine without a GPU for a mistyped
    option. Now 1, in one line; 2 stays the options' alone."""
    def no_driver():
        raise CudaUnavailable("no NVIDIA driver found (libcuda could not be loaded): memra_cuda needs an NVIDIA "
                              "GPU and its driver")

    monkeypatch.setattr(demo, "Engine", no_driver)
    assert demo.main([]) == 1
    said = capsys.readouterr()
    assert not said.out and said.err.splitlines() == [
        "memra_cuda: no GPU to run the demo on: no NVIDIA driver found (libcuda could not be loaded): memra_cuda "
        "needs an NVIDIA GPU and its driver"], said.err
