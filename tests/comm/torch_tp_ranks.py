"""One rank of tests/comm/test_torch_tp.py's CPU check of memra_cuda.torch.shard (what
examples/torch_tp.py runs its ranks on): torch's gloo on the host for the all-reduce, a small
random Llama on the CPU, launched as torchrun would. It prints one JSON line: how far this
rank's logits after sharding are from the whole model's."""
from __future__ import annotations

import json

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from memra_cuda.torch import shard

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same weights on every rank
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    ids = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 3]])
    with torch.no_grad():
        whole = model(ids).logits
        shard(model, rank, world, dist.all_reduce)
        mine = model(ids).logits
    print(json.dumps(dict(rank=rank, diff=float((mine - whole).abs().max()), scale=float(whole.abs().max()),
                          heads=model.config.num_attention_heads, kv_heads=model.config.num_key_value_heads,
                          q_rows=model.model.layers[0].self_attn.q_proj.weight.shape[0])), flush=True)
    dist.destroy_process_group()
