"""`python -m memra_cuda --help` (the demo, `make demo`), on the CPU: a user who asks what the
demo does reads its whole description and what each option is for."""
from __future__ import annotations

import re
import subprocess
import sys

import memra_cuda.__main__ as demo


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
