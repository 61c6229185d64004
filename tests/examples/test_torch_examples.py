"""The PyTorch examples as the programs a user runs, on the CPU: their shared command line
(examples/_cli.py) and its refusals, and what they take, before any model is built; and where
torch and transformers are missing, where torch reaches no CUDA device and where torch_tp.py is
run without torchrun, each says in one line what is missing and how to get it (no traceback)."""
from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from memra_cuda.comm.launch import free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *argv: str, cwd: Path | None = None, paths: tuple[Path, ...] = (),
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The example run as a user runs it (python examples/NAME), from `cwd`, with `paths` ahead of
    this run's PYTHONPATH (made absolute, so that another cwd imports the same memra_cuda)."""
    env = dict(os.environ if env is None else env)
    inherited = [str(Path(entry).resolve()) for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *inherited])
    return subprocess.run([sys.executable, str(EXAMPLES / name), *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def torch_stack():
    """torch, where it is installed with transformers."""
    torch = pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")
    pytest.importorskip("transformers", reason="the examples need transformers")
    return torch


# -- the command line, in-process -----------------------------------------------------------------

def model_dir(folder: Path) -> Path:
    """A folder that parses as --model's: config.json and a tokenizer's file (no weights: nothing here loads it)."""
    for name in ("config.json", "tokenizer.json"):
        (folder / name).write_text("{}")
    return folder


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
    with pytest.raises(SystemExit):
        cli.parse(cli.command_line("chains"), ["--k", "0"])
    assert "--k takes at least 1, not 0" in capsys.readouterr().err
    sampled = cli.parse(parser, ["--temperature", "0.7", "--top-k", "5", "--top-p", "0.9"])[1]
    assert sampled == SamplingParams(0.7, 5, 0.9)
    refused = {("--state-rollback", "flip"): "add --hybrid", ("--draft", "d"): "add --model DIR",
               ("--prompt", "x"): "add --model DIR", ("--model", "m", "--hybrid"): "leave out --model",
               ("--temperature", "0"): "temperature must be finite", ("--draft-layers", "0"): "at least one layer",
               # sampling's refusals named by the options (they were SamplingParams' words alone: "top_p must be")
               ("--temperature", "1", "--top-p", "2"): "--temperature 1.0 --top-k 0 --top-p 2.0: top_p must be in",
               ("--top-k", "5"): "add --temperature T", ("--top-p", "0.9"): "add --temperature T",
               ("--batch", "0"): "--batch takes at least 1, not 0", ("--tokens", "-1"): "--tokens takes at least 0",
               ("--m-rounds", "0"): "--m-rounds takes at least 1, not 0",
               # the most, at parsing too (each was refused by the decoder, after the models were built)
               ("--batch", "65536"): "batch must be an int from 1 to 65535, not 65536",
               ("--m-rounds", str(2**31)): "m_rounds must be at most",
               ("--tokens", str(2**31)): f"--tokens takes at most {2**31 - 1}", ("--eos", "-1"): "--eos is a token id",
               # the random model's, at parsing (a RequestRefused, or self_draft's or build_model's refusal, after
               # the model was built)
               ("--eos", "32000"): "--eos is a token id of the random model's vocabulary (0 to 31999), not 32000",
               ("--draft-layers", "8"): "--draft-layers takes at most 7 of the small model's layers",
               ("--draft-layers", "3", "--hybrid"): "--draft-layers takes at most 2 of the small model's layers"}
    for argv, message in refused.items():
        with pytest.raises(SystemExit):
            cli.parse(parser, list(argv))
        assert message in capsys.readouterr().err


@pytest.mark.torch
def test_the_requests_are_the_random_models_prompts_or_a_loaded_tokenizers(cli, tmp_path):
    from memra_cuda.torch import Request
    from memra_cuda.torch.testing import PROMPT
    parser = cli.command_line("chains")
    one, eight = (cli.parse(parser, ["--batch", str(b), "--tokens", "9"])[0] for b in (1, 8))
    assert cli.requests(one, None) == [Request(PROMPT, 9, None, 0)]
    rows = cli.requests(eight, None)
    assert len(rows) == 8 and len({tuple(r.prompt) for r in rows}) == 8 and [r.seed for r in rows] == list(range(8))

    class Words:
        eos_token_id = 1

        def encode(self, text: str) -> list[int]:
            return [len(word) for word in text.split()]

    m = str(model_dir(tmp_path))
    loaded = cli.parse(parser, ["--model", m, "--prompt", "a bb", "--prompt", "ccc", "--batch", "3", "--eos", "7"])[0]
    assert cli.requests(loaded, Words()) == [Request([1, 2], 256, 7, 0), Request([3], 256, 7, 1),
                                             Request([1, 2], 256, 7, 2)]
    assert cli.requests(cli.parse(parser, ["--model", m])[0], Words(), 2)[1].eos == 1  # the tokenizer's EOS
    # a text the tokenizer makes no tokens of met the decoder's RequestRefused as a traceback, once the models loaded
    empty = cli.parse(parser, ["--model", m, "--prompt", "a", "--prompt", " "])[0]
    with pytest.raises(SystemExit, match=re.escape("--prompt ' ' is no tokens to the tokenizer of ")):
        cli.requests(empty, Words())


@pytest.mark.torch
def test_a_model_or_draft_that_is_no_model_directory_is_refused_at_parsing(cli, capsys, tmp_path):
    """Each was found only past the GPU check, as the model loaded; a model directory without its
    tokenizer only once the target's weights had loaded."""
    parser = cli.command_line("chains")
    for folder in ("m", "bare"):
        (tmp_path / folder).mkdir()
    model = model_dir(tmp_path / "m")
    (tmp_path / "file").write_text("x")
    (tmp_path / "bare" / "config.json").write_text("{}")
    no_model = "holds no config.json: a model directory is what transformers' save_pretrained writes"  # load_model's
    refused = {("--model", str(tmp_path / "missing")): f"--model: {tmp_path / 'missing'} {no_model}",
               ("--model", str(tmp_path / "file")): f"--model: {tmp_path / 'file'} {no_model}",
               ("--model", str(model), "--draft", str(tmp_path)): f"--draft: {tmp_path} {no_model}",
               ("--model", str(tmp_path / "bare")): f"--model: {tmp_path / 'bare'} holds a model but no tokenizer "
                                                    "(none of tokenizer.json"}  # load_tokenizer's
    for argv, message in refused.items():
        with pytest.raises(SystemExit):
            cli.parse(parser, list(argv))
        assert message in capsys.readouterr().err
    bare = str(tmp_path / "bare")  # a draft's tokenizer is its target's
    assert cli.parse(parser, ["--model", str(model), "--draft", bare])[0].draft == bare


@pytest.mark.torch
def test_a_model_or_draft_that_load_model_refuses_is_refused_at_parsing(cli, capsys, tmp_path):
    """A directory whose config.json or weights load_model refuses before any weight is made (an
    unknown activation, weights of another shape) met that refusal as a traceback, past the GPU
    check, once the target (for --draft: and its tokenizer) had loaded: the parser's error now,
    naming the option; the directory unedited parses."""
    import json
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    for name in ("good", "act", "shape"):
        LlamaForCausalLM(config).save_pretrained(tmp_path / name)
        (tmp_path / name / "tokenizer.json").write_text("{}")
        edits = dict(act=dict(hidden_act="wibble"), shape=dict(intermediate_size=128)).get(name, {})
        written = json.loads((tmp_path / name / "config.json").read_text())
        (tmp_path / name / "config.json").write_text(json.dumps({**written, **edits}))
    parser = cli.command_line("chains")
    good = str(tmp_path / "good")
    refused = {("--model", str(tmp_path / "act")): f"--model: {tmp_path / 'act' / 'config.json'}'s hidden_act names "
                                                   "activation 'wibble'",
               ("--model", good, "--draft", str(tmp_path / "shape")): f"--draft: {tmp_path / 'shape'}'s weights do "
                                                                       "not match its config.json: 6 of another shape"}
    for argv, message in refused.items():
        with pytest.raises(SystemExit):
            cli.parse(parser, list(argv))
        assert message in capsys.readouterr().err
    assert cli.parse(parser, ["--model", good, "--draft", good])[0].draft == good


@pytest.mark.torch
def test_serve_takes_at_most_as_many_requests_as_a_batch_has_rows_at_parsing(cli, capsys, monkeypatch):
    """--serve had no most: every request is built before the first runs, so --serve 10**9 built
    requests until memory ran out, past the GPU check and the models. The parser's error naming
    the most now, MAX_BATCH (what the example builds without --serve, one a row); at the most,
    the example goes on to the GPU check."""
    from memra_cuda.buffers import MAX_BATCH
    llama = importlib.import_module("torch_llama")  # beside _cli, on the path the cli fixture gives

    class Parsed(Exception):
        """The example's GPU check, reached once its command line is read."""

    def parsed() -> None:
        raise Parsed

    monkeypatch.setattr(llama._needs, "gpu", parsed)
    for serve in (MAX_BATCH + 1, 10**9):
        with pytest.raises(SystemExit) as refused:
            llama.main(["--serve", str(serve)])
        assert refused.value.code == 2
        assert f"--serve takes at most {MAX_BATCH} requests" in capsys.readouterr().err
    for serve in ("0", "-2"):  # the least by itself (said with the modes it refuses: "N >= 1 ..., in any mode")
        with pytest.raises(SystemExit) as refused:
            llama.main(["--serve", serve])
        assert refused.value.code == 2
        assert f"error: --serve takes at least 1 request, not {serve}\n" in capsys.readouterr().err
    with pytest.raises(Parsed):
        llama.main(["--serve", str(MAX_BATCH), "--batch", "8"])


# -- the examples as programs, before any model is built ------------------------------------------

@pytest.mark.torch
def test_the_examples_say_what_they_take(torch_stack, tmp_path):
    for name in ("torch_llama.py", "torch_tree.py"):
        done = run_example(name, "--help", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert "--model DIR" in done.stdout and "--draft DIR" in done.stdout and "--size {large,small}" in done.stdout
    assert "--serve N" in run_example("torch_llama.py", "--help", cwd=tmp_path).stdout
    for mode in ("overlap", "device"):  # a server steps one burst at a time: refused before any model is built
        done = run_example("torch_llama.py", "--serve", "4", "--mode", mode, cwd=tmp_path)
        assert done.returncode == 2 and "in any mode but overlap and device" in done.stderr, done.stderr


@pytest.mark.torch
def test_auto_takes_the_pick_of_the_decoding_asked_for_and_refuses_where_the_chain_is_faster(torch_stack, tmp_path):
    """Refused before any model is built (this machine has no GPU to build one on), from any cwd:
    the picks are the checkout's, benchmarks/picks.py."""
    for argv in (["--tree", "auto", "--batch", "8"], ["--tree", "auto", "--size", "large", "--temperature", "1"]):
        done = run_example("torch_tree.py", *argv, cwd=tmp_path)
        assert done.returncode == 2 and "faster by the chain" in done.stderr, done.stderr
    done = run_example("torch_tree.py", "--tree", "auto", "--model", str(model_dir(tmp_path)), cwd=tmp_path)
    assert done.returncode == 2 and "name a --tree" in done.stderr, done.stderr


@pytest.mark.torch
def test_a_tree_the_decoder_would_refuse_is_refused_before_any_model_is_built(torch_stack, tmp_path):
    """A sampled tree drawing more children a node than a draw gives, or a tree whose rounds of
    M a burst overrun a ring, was TreeLlama's refusal, a traceback after both models were built;
    the parser's error now (exit 2; this machine has no GPU to build them on)."""
    for argv, said in ((["--tree", "dynamic:2,4,9", "--temperature", "0.7"], "a sampled node draws at most 8"),
                       (["--tree", "dynamic:3,4,2", "--m-rounds", str(2**30)], "m_rounds must be at most"),
                       # a tree parse_tree refuses, named by the option ("size must be ..." named none)
                       (["--tree", "static:0"], "--tree static:0: size must be an int of at least 1, not 0"),
                       (["--tree", "bogus"], "--tree bogus: a tree is \"static:N[,DEPTH]\""),
                       (["--tree", "bogus"], '(or "auto", the pick measured fastest)')):  # which parse_tree knows not
        done = run_example("torch_tree.py", *argv, cwd=tmp_path)
        assert done.returncode == 2 and said in done.stderr, done.stderr


@pytest.mark.torch
@pytest.mark.parametrize("name", ["torch_llama", "torch_tree", "torch_tp"])
def test_an_example_runs_as_a_module_of_the_checkout_too(torch_stack, name):
    """python -m examples.NAME from the checkout's root, as the benchmarks and the demo run: the
    PyTorch examples met ModuleNotFoundError for _needs, their own module beside them."""
    checkout = EXAMPLES.parent  # python's first path under -m: `examples` is found there
    done = subprocess.run([sys.executable, "-m", f"examples.{name}", "--help"], cwd=checkout, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "usage: " in done.stdout and "--batch" in done.stdout, done.stderr
    done = subprocess.run([sys.executable, "-m", f"examples.{name}", "--batch", "0"], cwd=checkout,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--batch takes at least 1, not 0" in done.stderr, done.stderr


# -- what is missing, in one line -------------------------------------------------------------

TORCH_EXAMPLES = ("torch_llama.py", "torch_tree.py", "torch_tp.py")
# What torchrun sets for a rank, which torch.distributed's env:// rendezvous reads.
LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# A sitecustomize that makes torch and transformers unimportable, as where they are not installed.
WITHOUT_TORCH = '''
import sys


class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Absent())
'''


def one_line(done: subprocess.CompletedProcess, name: str) -> str:
    """The example's one line on stderr, after asserting it ended with status 1 and said nothing else."""
    assert done.returncode == 1 and not done.stdout and "Traceback" not in done.stderr, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{Path(name).stem}: "), done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def torch_without_cuda(torch_stack):
    """torch and transformers, without a CUDA device torch can reach (this CPU machine's)."""
    if torch_stack.cuda.is_available():
        pytest.skip("torch reaches a CUDA device here: the examples run")
    return torch_stack


@pytest.mark.parametrize("name", TORCH_EXAMPLES)
def test_without_torch_an_example_names_the_torch_extra_in_one_line(name, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(WITHOUT_TORCH)
    line = one_line(run_example(name, cwd=tmp_path, paths=(tmp_path,)), name)
    assert "no module named 'torch'" in line and "torch extra" in line and "pip install" in line, line
    assert f"{EXAMPLES.parent}[torch]" in line, line  # the checkout's extra, from any cwd


@pytest.mark.parametrize("name", TORCH_EXAMPLES)
def test_without_torch_help_gives_the_examples_description_and_what_to_install(name, tmp_path):
    """The README says each example's --help says what it takes; without torch it was the refusal,
    exit status 1, so what an example does could not be read before installing what it needs. Now
    its description (the docstring, its usage among it) and the install line, exit status 0."""
    (tmp_path / "sitecustomize.py").write_text(WITHOUT_TORCH)
    done = run_example(name, "--help", cwd=tmp_path, paths=(tmp_path,))
    assert done.returncode == 0 and not done.stderr, done.stdout + done.stderr
    described = ast.get_docstring(ast.parse((EXAMPLES / name).read_text(encoding="utf-8")), clean=False)
    assert described and done.stdout.startswith(described.strip()), done.stdout
    last = done.stdout.rstrip().splitlines()[-1]
    assert "torch extra" in last and "pip install" in last and f"{EXAMPLES.parent}[torch]" in last, done.stdout


@pytest.mark.torch
@pytest.mark.parametrize("name", TORCH_EXAMPLES)
def test_where_torch_reaches_no_cuda_device_an_example_says_so_in_one_line(name, torch_without_cuda, tmp_path):
    """torch_tp.py as torchrun starts a rank of one, so that it gets as far as the device."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port())) if name == "torch_tp.py" else None
    line = one_line(run_example(name, cwd=tmp_path, env=env), name)
    assert "CUDA" in line and "NVIDIA GPU" in line, line
    if torch_without_cuda.version.cuda is None:
        assert f"PyTorch {torch_without_cuda.__version__} is built without CUDA" in line, line


@pytest.mark.torch
def test_torch_tp_refuses_its_sizes_before_its_ranks_start(torch_stack, tmp_path):
    """--k 0, --batch 0, a negative --tokens or an M past the ring's room: each was refused on
    every rank, after it had joined the process group, built and sharded the model and decoded
    the reference; the parser's error now (exit 2), as the other examples' are, with no launcher."""
    for argv, said in ((["--k", "0"], "--k takes at least 1, not 0"), (["--batch", "0"], "--batch takes at least 1"),
                       (["--tokens", "-1"], "--tokens takes at least 0"),
                       (["--m-rounds", str(2**31)], "m_rounds must be at most")):
        done = run_example("torch_tp.py", *argv, cwd=tmp_path)
        assert done.returncode == 2 and said in done.stderr, done.stderr


@pytest.mark.torch
def test_torch_tp_run_without_torchrun_says_how_to_start_its_ranks(torch_stack, tmp_path):
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER}
    line = one_line(run_example("torch_tp.py", "--batch", "2", cwd=tmp_path, env=env), "torch_tp.py")
    assert "RANK" in line and line.endswith(f"torchrun --nproc-per-node 2 {EXAMPLES / 'torch_tp.py'} --batch 2"), line
