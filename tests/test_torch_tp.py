"""examples/torch_tp.py: its shard() on the CPU (two and four ranks summing through torch's
gloo: each rank's logits after sharding equal the whole model's), and, on two GPUs, the example
itself started by torchrun (round-stream over two tensor-parallel ranks equals the ranks' own
plain greedy decoding over 256 tokens, graph and overlap modes, on both ranks). Skipped with the
reason where torch, transformers, NCCL or a second GPU is missing."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs PyTorch (pip install 'memra_cuda[torch]')")
pytest.importorskip("transformers", reason="the example needs transformers")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def ranks_env(world: int) -> dict[str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "NCCL_NVLS_ENABLE": "0", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "examples"),
                                                                             os.environ.get("PYTHONPATH")]))}


@pytest.mark.parametrize("world", [2, 4])
def test_a_sharded_llama_gives_the_whole_models_logits_on_every_rank(world):
    env = ranks_env(world)
    procs = [subprocess.Popen([sys.executable, str(HERE / "torch_tp_ranks.py")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(world)]
    for rank, proc in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=240)
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        assert lines, f"rank {rank}: {stderr[-3000:]}"
        seen = json.loads(lines[-1])
        assert (seen["heads"], seen["kv_heads"], seen["q_rows"]) == (8 // world, 4 // world, 128 // world)
        assert seen["diff"] <= 1e-4 * seen["scale"], seen


@pytest.mark.gpu
def test_two_tensor_parallel_ranks_equal_their_plain_greedy_decoding(engine):
    from memra_cuda.comm import NcclUnavailable, nccl
    from memra_cuda.driver.errors import call
    try:
        nccl()
    except NcclUnavailable as exc:
        pytest.skip(f"needs NCCL (pip install 'memra_cuda[nccl]'): {exc}")
    if call("cuDeviceGetCount") < 2:
        pytest.skip("needs two GPUs (the nvidia-h200-x2 kind)")
    env = ranks_env(2)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", env["MASTER_PORT"], str(ROOT / "examples" / "torch_tp.py"),
                          "--tokens", "256", "--batch", "8"], capture_output=True, text=True, env=env, timeout=600)
    verdicts = [line for line in run.stdout.splitlines() if line.startswith("rank ")]
    assert run.returncode == 0 and len(verdicts) == 2, run.stdout[-3000:] + run.stderr[-3000:]
    assert all("graph mode: yes, overlap mode: yes" in line for line in verdicts), verdicts
