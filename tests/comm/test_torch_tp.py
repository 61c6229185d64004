"""Tensor-parallel ranks: memra_cuda.torch.shard on the CPU (two and four ranks summing through
torch's gloo: each rank's logits after sharding equal the whole model's), and, on two GPUs,
examples/torch_tp.py run by torchrun as the program it is (round-stream over two tensor-parallel
ranks equals the ranks' own plain greedy decoding over 256 tokens, graph and overlap modes, on
both ranks). Skipped with the reason where torch, transformers, NCCL or a second GPU is missing."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from memra_cuda.comm.launch import free_port, launch

pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")
pytest.importorskip("transformers", reason="the example needs transformers")

pytestmark = pytest.mark.torch
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # the checkout: examples/ and the package


def ranks_env() -> dict[str, str]:
    """The ranks import memra_cuda from this checkout."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.mark.parametrize("world", [2, 4])
def test_a_sharded_llama_gives_the_whole_models_logits_on_every_rank(world):
    for ended in launch([sys.executable, str(HERE / "torch_tp_ranks.py")], world, ranks_env(), timeout=240):
        lines = [line for line in ended.stdout.splitlines() if line.startswith("{")]
        assert lines, f"rank {ended.rank}: {ended.stderr[-3000:]}"
        seen = json.loads(lines[-1])
        assert (seen["heads"], seen["kv_heads"], seen["q_rows"]) == (8 // world, 4 // world, 128 // world)
        assert seen["diff"] <= 1e-4 * seen["scale"], seen


def test_shard_refuses_what_it_cannot_split_and_changes_nothing_then():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from memra_cuda.torch.testing import RecurrentLayer
    from memra_cuda.torch import shard
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="3 ranks cannot share 4 heads"):
        shard(model, 0, 3, lambda t: None)
    attention = model.model.layers[1]
    model.model.layers[1] = RecurrentLayer(attention, config, 0.01)
    with pytest.raises(ValueError, match="recurrent layer's state is not split"):
        shard(model, 0, 2, lambda t: None)
    model.model.layers[1] = attention
    model.model.layers[1].mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(64))
    with pytest.raises(ValueError, match="bias"):
        shard(model, 0, 2, lambda t: None)
    # no function to sum with: taken, every layer split, "'NoneType' object is not callable" at the first forward
    model.model.layers[1].mlp.down_proj.bias = None
    for reduce in (None, "all_reduce"):
        with pytest.raises(TypeError, match=re.escape(f"reduce is a function summing a tensor over the ranks in "
                                                      f"place (an all-reduce), not {reduce!r}")):
            shard(model, 0, 2, reduce)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (64, 64) and model.config.num_attention_heads == 4


@pytest.mark.gpu
def test_two_tensor_parallel_ranks_equal_their_plain_greedy_decoding(engine):
    from nccl_ranks import need_nccl, two_gpus  # beside this file
    need_nccl()
    two_gpus()
    ended = launch([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                    str(free_port()), str(ROOT / "examples" / "torch_tp.py"), "--tokens", "256", "--batch", "8"], 1,
                   ranks_env(), 300)
    run = ended[0]
    verdicts = [line for line in run.stdout.splitlines() if line.startswith("rank ")]
    assert run.returncode == 0 and len(verdicts) == 2, run.stdout[-3000:] + run.stderr[-3000:]
    assert all("graph mode: yes, overlap mode: yes" in line and "logits are the whole model's" in line
               for line in verdicts), verdicts
