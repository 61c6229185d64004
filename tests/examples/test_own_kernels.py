"""examples/own_kernels.py's command line, on the CPU: what its options get wrong (a prompt's
token id outside the vocabulary its --help states, k and M out of range) is the parser's error,
exit status 2, said before any engine is made. The decoding itself: test_own_kernels_gpu.py."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def own_kernels(monkeypatch):
    """The example, imported as it runs as a script (its folder on sys.path), with an Engine that
    fails the test if it is made."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    module = importlib.import_module("own_kernels")

    def no_engine():
        raise AssertionError("an engine was made for options out of range")

    monkeypatch.setattr(module, "Engine", no_engine)
    return module


def test_options_out_of_range_are_usage_errors_before_any_engine(own_kernels, capsys):
    for argv, message in ((["--prompt", "17", "1000"], "--prompt takes token ids from 0 to 999, not 1000"),
                          (["--prompt", "-1", "5", "4000"], "--prompt takes token ids from 0 to 999, not -1 4000"),
                          # named by the options, as the demo's are (they were "k must be ...": no option's name)
                          (["--k", "-1"], "--k -1 --m-rounds 8: k must be an int of at least 0, not -1"),
                          (["--m-rounds", "0"], "--k 4 --m-rounds 0: m_rounds must be an int of at least 1, not 0"),
                          (["--tokens", "-2"], "--tokens must be an int of at least 0, not -2"),
                          # an engine was made, and the model compiled, for caches past an i32's positions
                          (["--tokens", str(2**31)], f"--tokens {2**31} needs a KV cache of 2147483692 entries in "
                                                     "rounds of k=4, M=8, past the 2147483647 an i32 position "
                                                     "reaches")):
        with pytest.raises(SystemExit) as exit_:
            own_kernels.main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"examples/own_kernels.py: error: {message}" in err, err
    with pytest.raises(AssertionError, match="an engine was made"):  # the largest id is taken
        own_kernels.main(["--prompt", "0", "999"])
