"""A real target and draft for the benchmarks (issue 40): random-weight models agree by construction,
so speculative decoding measured on them says little; this trains a byte-level BPE tokenizer and a Llama
target on the machine's own Python sources, then a Llama draft distilled from the target over the same
text (--draft-learns data: on the text alone), on one H200, and keeps them as Hugging Face directories
in a cache that a second run finds.

    python3 -m benchmarks.pair [--quick] [--measure] [--cache DIR] [--target-layers N --target-hidden H
        --draft-layers N --draft-hidden H] [--target-steps N --draft-steps N] [...]

The corpus is every .py file of the interpreter's stdlib and site-packages (no download, and every
machine has one), each content once; the held-out files are chosen by a hash of their path, so the
split needs no list, and scored in windows spread over all of them (and by package, to show where a
model is weak).
The cache key is a hash of all that decides the result (corpus, settings, this file, library
versions, GPU), so a changed input trains anew and an unchanged one reuses: `<cache>/<key>/target`,
`<cache>/<key>/draft` (each loads alone with from_pretrained), `report.json` and `heldout.json` (a
pool of held-out prompts, so a benchmark needs no corpus). A run reproduces: training stops at a
step count (the defaults' are what 160 s and 65 s of an H200 took, 717 and 1290), from seeded
weights, over windows drawn by a seeded generator, its learning rate a function of the step, through
deterministic kernels (torch.use_deterministic_algorithms: flash attention's backward without its
atomic adds, cuBLAS on a fixed workspace). Without those, two runs of one key on one H200
(2026-12-04) differed by 0.022 nats/token in the target's held-out loss, past the 0.02 a pair's
figures are read to (the wall-clock budgets of 0.3, whose step counts followed the GPU's speed,
moved the draft's by 0.10). Imports no memra_cuda: it makes the models that memra_cuda is measured
with.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .needs import PAIR, needs

try:
    import tokenizers
    import torch
    import torch.nn.functional as F
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM,
                              PreTrainedTokenizerFast)
except ModuleNotFoundError:
    if __name__ == "__main__":  # the program: a missing one said in one line (a CPU will do: no GPU asked for)
        needs("benchmarks.pair", PAIR, gpu=False)
    raise  # imported, or a package's own dependency missing: the import's error

EOT = "<|endoftext|>"  # between documents; the tokenizer's bos, eos and pad (it adds none by itself)
HELDOUT_OF_256 = 5  # a file is held out when its path's sha256 starts with a byte below this: 2.0 %
REPO = Path(__file__).resolve().parents[1]
POOL = 512  # held-out prompts kept in heldout.json, of which the evaluation uses the first --prompts
SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}  # under stdlib: not the stdlib's own code
TOP_K, CHAINS = (1, 2, 4, 8), (2, 4, 6, 8)
DEFAULTS: dict[str, Any] = dict(
    device="cuda" if torch.cuda.is_available() else "cpu", max_files=0, max_file_kb=1024, vocab=8192,
    tokenizer_mb=32.0, seq_len=1024, target_layers=12, target_hidden=768, draft_layers=2, draft_hidden=384,
    target_batch=64, draft_batch=128, target_lr=1e-3, draft_lr=3e-3, target_steps=717, draft_steps=1290,
    draft_learns="target", precision="amp", eval_tokens=1_000_000, prompts=64, prompt_len=128, new_tokens=128,
    decode_tokens=64)
QUICK: dict[str, Any] = dict(  # the whole pipeline on a CPU in seconds: tiny corpus, shapes and budgets
    device="cpu", max_files=400, vocab=1024, tokenizer_mb=2.0, seq_len=128, target_layers=2, target_hidden=128,
    draft_layers=1, draft_hidden=64, target_batch=8, draft_batch=8, target_steps=24, draft_steps=24,
    eval_tokens=16384, prompts=8, prompt_len=32, new_tokens=32, decode_tokens=16)

CHOICES = dict(precision=("amp", "bf16"), draft_learns=("target", "data"))
HELP = dict(  # --help's words for the settings whose names don't say enough
    device="cuda where there is one", max_files="0: all; else the files whose path hashes lowest",
    max_file_kb="larger files are left out", tokenizer_mb="text the BPE merges are learnt from",
    target_batch="sequences of --seq-len a step", draft_batch="sequences of --seq-len a step",
    target_steps="optimizer steps of training", draft_steps="optimizer steps of training",
    precision="amp: fp32 weights, bf16 autocast; bf16: all bf16",
    draft_learns="target: the trained target's distribution at each token (distilled, forward KL); data: the "
                 "next token",
    eval_tokens="held-out tokens the loss is taken over",
    prompts="held-out prompts the draft is scored on", new_tokens="the target's greedy tokens a prompt",
    decode_tokens="tokens timed at batch 1")


@dataclass
class Doc:
    rel: str  # the root's name and the path under it ("stdlib/json/decoder.py"): the same on every machine
    text: str
    digest: str  # sha256 of the file's bytes, for the cache key
    size: int

    @property
    def heldout(self) -> bool:
        return path_hash(self.rel)[0] < HELDOUT_OF_256


def path_hash(rel: str, use: str = "") -> bytes:
    """The held-out split's hash (use ""), or one salted by its use: a sample ordered by the split's own
    hash would begin with every held-out file."""
    return hashlib.sha256((use + rel).encode()).digest()


def list_files(max_bytes: int) -> list[tuple[str, Path]]:
    """The .py files of stdlib, purelib and platlib, each once (roots and files resolved, so a venv's
    links or a root inside another add nothing twice), sorted by relative path. Files over max_bytes
    are left out: they are generated tables (unicode data, protobuf descriptors), not code, and one
    of them would hold a tokenizer thread alone."""
    paths, roots = sysconfig.get_paths(), dict[Path, str]()
    for name in ("stdlib", "purelib", "platlib"):
        roots.setdefault(Path(paths[name]).resolve(), name)
    seen: set[Path] = set()
    files = []
    for root, name in roots.items():
        for here, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and Path(here, d).resolve() not in roots)
            for f in sorted(n for n in names if n.endswith(".py")):
                try:
                    real = Path(here, f).resolve()
                    size = real.stat().st_size
                except OSError:
                    continue
                if 0 < size <= max_bytes and real not in seen:
                    seen.add(real)
                    files.append((f"{name}/{Path(here, f).relative_to(root).as_posix()}", real))
    return sorted(files)


def read_docs(files: list[tuple[str, Path]], max_files: int) -> list[Doc]:
    """The files' texts, skipping unreadable and non-UTF-8 ones; with max_files, the files whose path
    hashes lowest (a sample of every root and package, the same on each run)."""
    if max_files:
        files = sorted(sorted(files, key=lambda f: path_hash(f[0], "sample:"))[:max_files])

    def read(item: tuple[str, Path]) -> Doc | None:
        try:
            data = item[1].read_bytes()
            return Doc(item[0], data.decode("utf-8"), hashlib.sha256(data).hexdigest(), len(data))
        except (OSError, UnicodeDecodeError):
            return None

    with ThreadPoolExecutor(16) as pool:  # reading tens of thousands of small files waits on the disk, not the GIL
        docs = [d for d in pool.map(read, files) if d is not None and d.text.strip()]
    unique, seen = [], set()  # a file whose bytes came before (a vendored copy) is left out: a held-out copy
    for d in docs:           # of a training file would be no held-out text
        if d.digest not in seen:
            seen.add(d.digest)
            unique.append(d)
    return unique


def package(rel: str) -> str:
    """What a file is counted under in the corpus's make-up and the held-out loss: the stdlib whole,
    else the top-level package or module of site-packages ("torch", "six")."""
    root, _, rest = rel.partition("/")
    return root if root == "stdlib" else rest.split("/")[0].removesuffix(".py")


def make_up(docs: list[Doc], top: int = 10) -> dict[str, float]:
    """Megabytes of the corpus by package(), the `top` largest and the rest as "other"."""
    sizes: dict[str, int] = {}
    for d in docs:
        sizes[package(d.rel)] = sizes.get(package(d.rel), 0) + d.size
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])
    out = {name: round(size / 1e6, 1) for name, size in ranked[:top]}
    if len(ranked) > top:
        out["other"] = round(sum(size for _, size in ranked[top:]) / 1e6, 1)
    return out


def cache_key(args: argparse.Namespace, docs: list[Doc]) -> tuple[str, dict[str, Any]]:
    """A short hash of everything that decides what a run trains, and that everything itself."""
    corpus = hashlib.sha256("\n".join(f"{d.rel}\t{d.size}\t{d.digest}" for d in docs).encode()).hexdigest()
    device = torch.device(args.device)
    inputs = dict(settings={k: v for k, v in sorted(vars(args).items()) if k not in ("cache", "measure", "quick")},
                  corpus=corpus, files=len(docs), code=hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
                  torch=torch.__version__, transformers=transformers.__version__, tokenizers=tokenizers.__version__,
                  python=sys.version.split()[0],
                  gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:12], inputs


def train_tokenizer(docs: list[Doc], vocab: int, megabytes: float) -> Tokenizer:
    """Byte-level BPE (any text encodes, no unknown token) on the training files that hash lowest up
    to `megabytes` of text: merges learnt from a fifth of the corpus are nearly those of all of it,
    at a fifth of the time."""
    chosen, total = [], 0
    for d in sorted(docs, key=lambda d: path_hash(d.rel, "tokenizer:")):
        if total >= megabytes * 2**20:
            break
        chosen.append(d.text)
        total += len(d.text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((chosen[i:i + 256] for i in range(0, len(chosen), 256)), trainer=trainer)
    return tok


def tokenize(tok: Tokenizer, docs: list[Doc]) -> tuple[np.ndarray, np.ndarray]:
    """One uint16 stream of the documents, each followed by EOT, and where each document starts (one
    more entry: the end). encode_batch spreads a chunk's documents over every core; chunks keep the
    Encodings (tokens and all) of only a few thousand documents alive at once."""
    eot = np.array([tok.token_to_id(EOT)], dtype=np.uint16)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # the fast one skips offsets; tokenizers >= 0.21
    parts, starts, n = [], [0], 0
    for i in range(0, len(docs), 2048):
        for enc in encode([d.text for d in docs[i:i + 2048]], add_special_tokens=False):
            parts += [np.array(enc.ids, dtype=np.uint16), eot]
            n += len(enc.ids) + 1
            starts.append(n)
    return (np.concatenate(parts) if parts else np.zeros(0, np.uint16)), np.array(starts)


def llama(layers: int, hidden: int, vocab: int, seq_len: int, eot: int, device: torch.device) -> LlamaForCausalLM:
    """Heads of 64 (as Llama's), no grouped KV, MLP 8/3 of hidden rounded to 128, untied head: the
    shape of the models round-stream serves. pad_token_id stays unset: it would freeze EOT's row."""
    if hidden % 64:
        raise SystemExit(f"pair: hidden sizes are multiples of 64 (heads of 64), not {hidden}")
    shape: dict[str, Any] = dict(  # a dict: attn_implementation is a config kwarg that LlamaConfig's stub lacks
        vocab_size=vocab, hidden_size=hidden, intermediate_size=max(128, round(hidden * 8 / 3 / 128) * 128),
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
        max_position_embeddings=seq_len, tie_word_embeddings=False, bos_token_id=eot, eos_token_id=eot,
        attn_implementation="sdpa")
    with device:  # initialised where it trains: no host-side init and copy
        return LlamaForCausalLM(LlamaConfig(**shape))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def windows(data: torch.Tensor, starts: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = data[starts[:, None] + torch.arange(length + 1, device=data.device)].long()
    return w[:, :-1], w[:, 1:]


@contextmanager
def deterministic() -> Iterator[None]:
    """Within, every kernel gives the same bits from one run to the next (flash attention's backward
    without its atomic adds, cuBLAS on CUBLAS_WORKSPACE_CONFIG's fixed slices), or raises naming
    itself; the setting as it was after."""
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def train(model: LlamaForCausalLM, data: torch.Tensor, args: argparse.Namespace, batch: int, lr: float,
          steps: int, seed: int, name: str, teacher: Any = None) -> dict[str, Any]:
    """AdamW on random windows of the stream (drawn by a generator seeded with `seed`) for `steps`
    steps, the learning rate warmed up over the first 5 % and decayed (cosine, to a tenth) by the
    steps' share done. --precision amp: fp32 master weights under bf16 autocast (pure bf16 loses
    the small late updates); bf16: bf16 weights and optimizer state, faster a step. With a
    `teacher`, the model learns the teacher's distribution at every token (forward KL), not the
    data's next token: see learnt()."""
    device, amp = data.device, args.precision == "amp"
    if not amp:
        model.bfloat16()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    seq = min(args.seq_len, len(data) - 1)
    model.train()
    loss, start = torch.zeros(()), time.perf_counter()
    for step in range(steps):
        progress = step / steps
        rate = min(1.0, max(progress, 1e-3) / 0.05) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr * rate
        x, y = windows(data, torch.randint(0, len(data) - seq, (batch,), generator=gen, device=device), seq)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=x).logits
            taught = None if teacher is None else learnt(teacher, x)
        loss = divergence(logits, y, taught)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % max(steps // 8, 1) == 0:  # .item() waits for the GPU: eight times a run
            print(f"  {name}: {time.perf_counter() - start:6.1f} s  step {step + 1:5d}  "
                  f"{(step + 1) * batch * seq / 1e6:7.1f} M tokens  loss {loss.item():.3f}", flush=True)
    sync(device)
    took = time.perf_counter() - start
    return dict(steps=steps, tokens=steps * batch * seq, seconds=round(took, 1), train_loss=round(loss.item(), 4),
                learns="data" if teacher is None else "target", tokens_per_s=round(steps * batch * seq / took))


@torch.no_grad()
def learnt(teacher: Any, x: torch.Tensor) -> torch.Tensor:
    """The teacher's log-probabilities over the windows `x` ([batch][seq][vocab], fp32): what a
    distilled draft learns. A draft is judged by how often the target accepts its tokens, which at
    T = 1 is E[sum min(p, q)] under the target's own text, not by how well it predicts the data:
    trained on the data alone, the pair's draft (held-out 1.97 nats/token) beat the target (2.12)
    at the data, and at T = 1 about 0.60 of its drafts were accepted (2.26 tokens a round at k = 3),
    where E[sum min(p, q)] along the target's greedy text read 0.78. On a CPU pair of 3 x 192 and
    1 x 128 (400 steps each), distilling took E[sum min(p, q)] along the target's T = 1 samples
    from 0.65 to 0.84 and the greedy top-1 agreement from 0.64 to 0.71. The draft's steps each
    cost the target's forward over the same windows too."""
    return teacher(input_ids=x).logits.float().log_softmax(-1)


def divergence(logits: torch.Tensor, y: torch.Tensor, taught: torch.Tensor | None) -> torch.Tensor:
    """The loss a token, averaged: KL(teacher || model) where a teacher taught (its log-probabilities),
    else the next token's negative log-likelihood. cross_entropy's nll_loss has no deterministic CUDA
    kernel (it raises under deterministic()); gather's backward and kl_div's have one."""
    logp = logits.float().log_softmax(-1)
    if taught is None:
        return -logp.gather(-1, y[..., None]).mean()
    return F.kl_div(logp, taught, reduction="sum", log_target=True) / logp[..., 0].numel()


@torch.no_grad()
def heldout_losses(model: Any, data: torch.Tensor, seq_len: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Each scored token's loss (nats), [windows][seq], and the windows' starts: `tokens` of the
    held-out stream in windows of seq_len spread evenly over all of it (the stream is in path
    order, so its first million tokens would be the alphabet's first packages), the same windows
    for every run and both models."""
    model.eval()
    seq = min(seq_len, len(data) - 1)
    count = max(1, min(tokens, len(data) - 1) // seq)
    starts = np.arange(count) * (len(data) - 1 - seq) // max(count - 1, 1)
    losses = []
    for i in range(0, count, 16):
        x, y = windows(data, torch.from_numpy(starts[i:i + 16]).to(data.device), seq)
        logits = model(input_ids=x).logits.float()
        losses.append(F.cross_entropy(logits.transpose(1, 2), y, reduction="none").cpu().numpy())
    return np.concatenate(losses), starts


def by_package(losses: np.ndarray, starts: np.ndarray, doc_starts: np.ndarray, docs: list[Doc],
               top: int = 8) -> dict[str, list[float]]:
    """package() -> [tokens scored, mean loss] of the held-out windows' tokens, the `top` most
    scored and the rest as "other": where a model is weak (generated tables, say, against code)."""
    # the token scored at window w's column j is the stream's starts[w] + 1 + j, in the held-out document before it
    where = np.searchsorted(doc_starts, starts[:, None] + 1 + np.arange(losses.shape[1]), side="right") - 1
    names = np.array([package(d.rel) for d in docs])[np.minimum(where, len(docs) - 1)]
    groups = {name: losses[names == name] for name in np.unique(names)}
    ranked = sorted(groups, key=lambda name: -groups[name].size)
    out = {name: [int(groups[name].size), round(float(groups[name].mean()), 4)] for name in ranked[:top]}
    if len(ranked) > top:
        rest = np.concatenate([groups[name] for name in ranked[top:]])
        out["other"] = [int(rest.size), round(float(rest.mean()), 4)]
    return out


def cache_arg(model: Any) -> str:
    """Recent transformers (5.24 here) call forward's past_key_values `cache` and warn on the old name;
    older ones (the H200's 5.17) may know only the old one."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def decode(model: Any, ids: torch.Tensor, new: int, timed: bool = False,
           sampled: torch.Generator | None = None) -> tuple[torch.Tensor, float]:
    """Greedy decoding through HF's KV cache, one forward a token, as `generate(do_sample=False)` does
    but never stopping at EOT (an early stop would pad the rows the draft is scored on); with `timed`,
    also the seconds of the decode steps after the prefill; with a generator, sampled at T = 1
    through it instead (the text a T = 1 round meets)."""
    cache, name = DynamicCache(), cache_arg(model)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        if sampled is None:
            return logits.argmax(-1)
        return torch.multinomial(logits[:, -1].float().softmax(-1), 1, generator=sampled)

    tok = pick(model(input_ids=ids, use_cache=True, **{name: cache}).logits[:, -1:])
    out = [tok]
    sync(ids.device)
    start = time.perf_counter()
    for _ in range(new - 1 + timed):
        tok = pick(model(input_ids=tok, use_cache=True, **{name: cache}).logits[:, -1:])
        out.append(tok)
    sync(ids.device)
    return torch.cat(out[:new], 1), time.perf_counter() - start


def decode_ms(model: Any, prompt: torch.Tensor, tokens: int) -> float:
    """Milliseconds a token of eager batch-1 decoding, best of three after a warm-up: what a step costs
    the serving loop, which at these sizes is launches and kernel latency, not FLOPs."""
    decode(model, prompt, 4)
    return min(decode(model, prompt, tokens, timed=True)[1] for _ in range(3)) / tokens * 1000


def tokens_per_round(agree: np.ndarray, k: int) -> float:
    """Tokens a greedy chain of k drafts yields a round along each row: the agreeing prefix (at most
    k) and one token of the target's (the correction, or the bonus after k)."""
    tokens = rounds = 0
    for row in agree:
        j = 0
        while j < len(row):
            accepted = 0
            while accepted < k and j + accepted < len(row) and row[j + accepted]:
                accepted += 1
            step = min(accepted + 1, len(row) - j)
            tokens, rounds, j = tokens + step, rounds + 1, j + step
    return tokens / max(rounds, 1)


@torch.no_grad()
def agreement(target: Any, draft: Any, prompts: torch.Tensor, new: int) -> dict[str, Any]:
    """The draft scored along the target's own continuations, greedy for the top-k agreement and
    T = 1 samples (seeded) for E[sum min(p, q)], the share of a T = 1 round's drafts the target
    accepts: one forward of each over prompt + continuation gives both distributions at every
    continued position at once. Along the greedy text the pair's overlap read 0.78, where its T = 1
    rounds accepted about 0.60 a draft: the greedy text is the one both models find likeliest."""
    cont, _ = decode(target, prompts, new)
    t, d = both(target, draft, prompts, cont)
    hit = d.topk(max(TOP_K), -1).indices == cont[..., None]
    t1, _ = decode(target, prompts, new, sampled=torch.Generator(device=prompts.device).manual_seed(0))
    p, q = (logits.softmax(-1) for logits in both(target, draft, prompts, t1))
    return dict(prompts=len(prompts), prompt_len=prompts.shape[1], new_tokens=new,
                top={k: round(hit[..., :k].any(-1).float().mean().item(), 4) for k in TOP_K},
                tokens_per_round={k: round(tokens_per_round(hit[..., 0].cpu().numpy(), k), 3) for k in CHAINS},
                overlap_t1=round(torch.minimum(p, q).sum(-1).mean().item(), 4),
                target_self=round((t.argmax(-1) == cont).float().mean().item(), 4))  # KV decode vs one forward


def both(target: Any, draft: Any, prompts: torch.Tensor, cont: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's and the draft's logits (fp32) at each continued position of prompt + cont."""
    seq, p = torch.cat([prompts, cont], 1), prompts.shape[1]
    return target(input_ids=seq).logits[:, p - 1:-1].float(), draft(input_ids=seq).logits[:, p - 1:-1].float()


def prompt_pool(tok: Tokenizer, docs: list[Doc], stream: np.ndarray, starts: np.ndarray, args: argparse.Namespace
                ) -> list[dict[str, Any]]:
    """Up to POOL prompts of prompt_len tokens, one a held-out file of at least prompt_len + new_tokens
    tokens, at an offset set by its path's hash (not its start: licence headers are easy), ordered by
    that hash so the first few mix stdlib and packages."""
    need, pool = args.prompt_len + args.new_tokens, list[dict[str, Any]]()
    for i in sorted(range(len(docs)), key=lambda i: path_hash(docs[i].rel, "prompt:")):
        length = starts[i + 1] - 1 - starts[i]
        if length >= need and len(pool) < POOL:
            off = int.from_bytes(path_hash(docs[i].rel, "prompt:")[8:12], "little") % (length - need + 1)
            ids = stream[starts[i] + off:starts[i] + off + args.prompt_len].tolist()
            pool.append(dict(path=docs[i].rel, start=int(off), ids=ids, text=tok.decode(ids)))
    return pool


def show(r: dict[str, Any]) -> None:
    for name in ("target", "draft"):
        m = r[name]
        print(f"{name:6s} {m['layers']:2d} x {m['hidden']:4d}  {m['params'] / 1e6:6.1f} M params  "
              f"{m['seconds']:6.1f} s  {m['tokens'] / 1e6:6.1f} M tokens ({m['steps']} steps)  "
              f"held-out {m['heldout_loss']:.3f} nats/token  decode {m['decode_ms']:.2f} ms/token", flush=True)
    print("held-out loss by package (tokens scored; target, draft): " + ", ".join(
        f"{name} {tokens / 1e3:.0f} k {loss:.2f} {r['draft']['heldout_by_package'].get(name, [0, float('nan')])[1]:.2f}"
        for name, (tokens, loss) in r["target"]["heldout_by_package"].items()))
    a = r["agreement"]
    print(f"target/draft decode cost: {r['decode_ratio']:.2f} (the issue asks >= 8)")
    print(f"the draft along the target's greedy continuation of {a['prompts']} held-out prompts "
          f"({a['prompt_len']} + {a['new_tokens']} tokens):")
    print("  top-k agreement: " + "  ".join(f"top-{k} {v:.1%}" for k, v in a["top"].items()))
    print("  greedy chain tokens/round: " + "  ".join(f"k={k} {v:.2f}" for k, v in a["tokens_per_round"].items()))
    print(f"  temperature 1, along the target's samples: E[sum min(p, q)] = {a['overlap_t1']:.3f}   (target's "
          f"argmax of one forward = its "
          f"KV-cache greedy token: {a['target_self']:.1%})")
    print("phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in r["phases"].items()), flush=True)


def measure(args: argparse.Namespace, where: Path | None) -> None:
    """Decode cost alone, for choosing shapes: of the cached pair, or else of random-weight models of
    the given shapes (a step's cost hardly depends on its weights)."""
    device, models_ = torch.device(args.device), {}
    for name in ("target", "draft"):
        if where is not None:
            model: Any = AutoModelForCausalLM.from_pretrained(where / name, local_files_only=True, dtype=torch.bfloat16)
            models_[name] = model.to(device)
        else:
            shape = (getattr(args, f"{name}_layers"), getattr(args, f"{name}_hidden"))
            models_[name] = llama(*shape, args.vocab, args.seq_len, 0, device).bfloat16()
    gen = torch.Generator(device).manual_seed(0)
    vocab = models_["draft"].config.vocab_size
    prompt = torch.randint(1, vocab, (1, args.prompt_len), device=device, generator=gen)
    ms = {name: decode_ms(m.eval(), prompt, args.decode_tokens) for name, m in models_.items()}
    print(f"decode at batch 1 ({'cached' if where else 'random-weight'} models): target {ms['target']:.2f} ms/token, "
          f"draft {ms['draft']:.2f} ms/token, ratio {ms['target'] / ms['draft']:.2f}", flush=True)


def build(args: argparse.Namespace, docs: list[Doc], out: Path, phases: dict[str, float], key: str) -> dict[str, Any]:
    """Tokenizer, target, draft, evaluation, written into `out` (a temporary directory)."""
    device, clock = torch.device(args.device), time.perf_counter()

    def phase(name: str) -> None:
        nonlocal clock
        phases[name] = round(time.perf_counter() - clock, 1)
        print(f"pair: {name} {phases[name]:.1f} s", flush=True)
        clock = time.perf_counter()

    train_docs, held_docs = [d for d in docs if not d.heldout], [d for d in docs if d.heldout]
    tok = train_tokenizer(train_docs, args.vocab, args.tokenizer_mb)
    eot, vocab = tok.token_to_id(EOT) or 0, tok.get_vocab_size()  # EOT is the first token learnt: 0
    phase("tokenizer training")
    (train_np, _), (held_np, held_starts) = tokenize(tok, train_docs), tokenize(tok, held_docs)
    chars = sum(len(d.text) for d in train_docs)
    print(f"pair: {len(train_np) / 1e6:.1f} M training tokens ({chars / max(len(train_np), 1):.2f} characters a "
          f"token), {len(held_np) / 1e6:.2f} M held-out tokens from {len(held_docs)} files", flush=True)
    train_data = torch.from_numpy(train_np.astype(np.int32)).to(device)
    held_data = torch.from_numpy(held_np.astype(np.int32)).to(device)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT,
                                   model_max_length=args.seq_len)  # the context it was trained on
    phase("tokenizing")
    report: dict[str, Any] = dict(key=key, corpus=dict(files=len(docs), train_files=len(train_docs),
                                  heldout_files=len(held_docs), train_tokens=len(train_np), heldout_tokens=len(held_np),
                                  chars_per_token=round(chars / max(len(train_np), 1), 3)), vocab=vocab)
    trained = {}
    for i, name in enumerate(("target", "draft")):
        layers, hidden = getattr(args, f"{name}_layers"), getattr(args, f"{name}_hidden")
        torch.manual_seed(args.seed + i)
        model = llama(layers, hidden, vocab, args.seq_len, eot, device)
        teacher = trained["target"] if name == "draft" and args.draft_learns == "target" else None
        with deterministic():
            stats = train(model, train_data, args, getattr(args, f"{name}_batch"), getattr(args, f"{name}_lr"),
                          getattr(args, f"{name}_steps"), args.seed + i, name, teacher)
        model.bfloat16().eval()  # scored as saved: bf16
        losses, starts = heldout_losses(model, held_data, args.seq_len, args.eval_tokens)
        stats.update(layers=layers, hidden=hidden, params=sum(p.numel() for p in model.parameters()),
                     heldout_loss=round(float(losses.mean()), 4),
                     heldout_by_package=by_package(losses, starts, held_starts[:-1], held_docs))
        model.save_pretrained(out / name)
        fast.save_pretrained(out / name)
        report[name], trained[name] = stats, model
        phase(name)
    pool = prompt_pool(tok, held_docs, held_np, held_starts, args)
    if pool:
        prompts = torch.tensor([p["ids"] for p in pool[:args.prompts]], device=device)
        report["agreement"] = agreement(trained["target"], trained["draft"], prompts, args.new_tokens)
    else:
        report["agreement"] = dict(prompts=0, prompt_len=args.prompt_len, new_tokens=args.new_tokens, top={},
                                   tokens_per_round={}, overlap_t1=float("nan"), target_self=float("nan"))
    prompt = torch.tensor([pool[0]["ids"] if pool else [eot] * args.prompt_len], device=device)
    for name in ("target", "draft"):
        report[name]["decode_ms"] = round(decode_ms(trained[name], prompt, args.decode_tokens), 3)
    report["decode_ratio"] = round(report["target"]["decode_ms"] / report["draft"]["decode_ms"], 2)
    report["heldout_paths"] = [d.rel for d in held_docs]
    (out / "heldout.json").write_text(json.dumps(dict(prompt_len=args.prompt_len, prompts=pool), indent=0))
    phase("evaluation")
    return report


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.pair", description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", default=os.environ.get("MEMRA_PAIR_CACHE", str(REPO / ".cache" / "pair")),
                   help="where pairs are kept (default $MEMRA_PAIR_CACHE, else .cache/pair in the repository)")
    p.add_argument("--quick", action="store_true", help="tiny corpus, shapes and budgets, on the CPU: a test")
    p.add_argument("--measure", action="store_true", help="only decode cost (of the cached pair, else random weights)")
    p.add_argument("--seed", type=int, default=0, help="the target's; the draft's is one more (default 0)")
    for name, value in DEFAULTS.items():
        extra: dict[str, Any] = dict(choices=CHOICES[name]) if name in CHOICES else {}
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=None,
                       help=f"{HELP.get(name, '')} (default {value!r})", **extra)
    args = p.parse_args(argv)
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, QUICK.get(name, value) if args.quick else value)
    refuse(p, args)
    return args


def refuse(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The parser's error for a setting no run can take, here: it met a traceback (or a SystemExit)
    only as it was used, after a minute of listing files and training the tokenizer, or none (a
    negative step count trained nothing)."""
    if args.seed < 0:
        p.error(f"--seed takes 0 or more, not {args.seed}")
    for name, value in DEFAULTS.items():
        got, flag = getattr(args, name), "--" + name.replace("_", "-")
        if isinstance(value, float) and not (math.isfinite(got) and got > 0):
            p.error(f"{flag} takes a finite number above 0, not {got}")
        if isinstance(value, int) and got < (name != "max_files"):  # --max-files 0: every file
            p.error(f"{flag} takes {name != 'max_files':d} or more, not {got}")
        if name.endswith("_hidden") and got % 64:
            p.error(f"{flag} takes a multiple of 64 (heads of 64), not {got}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device takes a torch device (cpu, cuda, cuda:1), not {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch sees no GPU")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    start = time.perf_counter()
    # deterministic cuBLAS needs a workspace of fixed slices, read when its first handle is made
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    transformers.utils.logging.disable_progress_bar()  # save_pretrained's shard bar, noise in a log
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    docs = read_docs(list_files(args.max_file_kb * 1024), args.max_files)
    key, inputs = cache_key(args, docs)
    where, phases = Path(args.cache) / key, {"listing": round(time.perf_counter() - start, 1)}
    megabytes = make_up(docs)
    print(f"pair: {len(docs)} files, {sum(d.size for d in docs) / 1e6:.1f} MB listed in {phases['listing']:.1f} s; "
          f"key {key}; MB by package: " + ", ".join(f"{name} {mb}" for name, mb in megabytes.items()), flush=True)
    if (where / "report.json").exists():
        print(f"reusing {where}", flush=True)
        if args.measure:
            measure(args, where)
        else:
            show(json.loads((where / "report.json").read_text()))
        return 0
    if args.measure:
        print(f"pair: nothing cached at {where}", flush=True)
        measure(args, None)
        return 0
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=where.parent))  # renamed whole once complete
    try:
        report = build(args, docs, tmp, phases, key)
        report["corpus"]["megabytes"] = megabytes
        report.update(inputs=inputs, phases=phases | {"total": round(time.perf_counter() - start, 1)})
        (tmp / "report.json").write_text(json.dumps(report, indent=1))
        os.rename(tmp, where)
    except OSError:
        if not (where / "report.json").exists():
            raise
        print(f"pair: another run wrote {where} first", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    show(json.loads((where / "report.json").read_text()))
    print(f"pair: {where}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
