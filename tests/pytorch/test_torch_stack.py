"""memra_cuda.torch's model side on the CPU (torch and transformers, no GPU), against Hugging
Face's own forward on tiny random Llamas: a Stack's rows at their own positions, a tree's nodes
under the ancestor mask with stale entries past them, a paged cache and its compaction, the
recurrent state of a hybrid stack (padded prefills, copy slots, a tree's parents), the
self-speculative and the separate draft, SamplingParams against Hugging Face's warpers, loading
a checkpoint directory, and what the decoders refuse before any device work."""
from __future__ import annotations

import functools
import itertools
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest

from memra_cuda import DynamicTree, TreeShape

torch = pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")
pytest.importorskip("transformers", reason="memra_cuda.torch's models need transformers")
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402

from memra_cuda.errors import NotFused, RequestRefused  # noqa: E402
from memra_cuda.torch.compiled import stack_for  # noqa: E402
from memra_cuda.torch.testing import RecurrentLayer, separate_draft  # noqa: E402
from memra_cuda.buffers.capacity import kv_capacity  # noqa: E402
from memra_cuda.torch import (CopyState, LiveState, PagedKV, Room, SamplingParams, SpeculativeLlama, Stack,  # noqa: E402
                              StaticKV, TreeLlama, TreeMask, buffer, capacity_for, load_model,
                              load_tokenizer, self_draft)

pytestmark = pytest.mark.torch

VOCAB, CAPACITY = 97, 48
TOL = dict(atol=1e-5, rtol=1e-4)


def tiny(layers: int = 3, seed: int = 0, vocab: int = VOCAB) -> LlamaForCausalLM:
    """A random Llama small enough for the CPU, grouped KV heads (4 query heads, 2 KV)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def hybrid(layer: int = 1) -> LlamaForCausalLM:
    """tiny() with one layer a gated linear recurrence (RecurrentLayer)."""
    model = tiny()
    model.model.layers[layer] = RecurrentLayer(model.model.layers[layer], model.config, 0.5)
    return model.eval().requires_grad_(False)


def hf_logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    """Hugging Face's logits after the last of `tokens`."""
    return model(torch.tensor([tokens])).logits[0, -1]


def ancestors(tree: TreeShape, node: int) -> list[int]:
    """`node`'s root path, root first."""
    path = [node]
    while tree.parent[path[-1]] >= 0:
        path.append(tree.parent[path[-1]])
    return path[::-1]


def mask_words(tree: TreeShape, rows: int) -> torch.Tensor:
    """TreeBufs.mask_d's words for `tree`, [rows][T+1][W] int32: node j at bit j % 32 of word j // 32."""
    words = np.zeros((rows, tree.nodes, -(-tree.nodes // 32)), np.uint32)
    for i in range(tree.nodes):
        for j in ancestors(tree, i):
            words[:, i, j // 32] |= np.uint32(1 << j % 32)
    return torch.from_numpy(words.view(np.int32))


# -- rows at their own positions ----------------------------------------------------------------

@pytest.mark.parametrize("layout", [StaticKV, PagedKV], ids=["static", "paged"])
def test_rows_at_their_own_positions_give_hugging_faces_logits(layout):
    """Three rows prefilled to different lengths (one of a single token: nothing to prefill), then
    stepped together, one token and then three a row (a verify), each at its own positions:
    every token's logits are Hugging Face's over that row's sequence alone."""
    model = tiny()
    rows_give_hugging_faces_logits(model, Stack(model, CAPACITY, batch=3, cache=layout))


def rows_give_hugging_faces_logits(model: LlamaForCausalLM, stack) -> None:
    """The check of rows at their own positions, for any stack of `model` of three rows (a
    CompiledStack's too)."""
    rows = [[1, 5, 9, 3, 4, 8], [2], [7, 7, 1, 30, 2, 6, 11, 40, 3, 9, 12]]
    stack.prefill(range(3), [row[:-1] for row in rows])
    assert stack.kv.lengths[:, :].tolist() == [[5, 0, 10]] * len(stack.kv.lengths)
    for width in (1, 3):
        tokens = torch.tensor([row[-1:] + [(13 * r + i) % VOCAB for i in range(width - 1)]
                               for r, row in enumerate(rows)])
        positions = torch.tensor([[len(row) - 1 + i for i in range(width)] for row in rows])
        got = stack.logits(tokens, positions)
        for r, row in enumerate(rows):
            for i in range(width):
                torch.testing.assert_close(got[r, i], hf_logits(model, row + tokens[r, 1:i + 1].tolist()), **TOL)
        rows = [row + tokens[r, 1:].tolist() + [int(got[r, -1].argmax())] for r, row in enumerate(rows)]


def test_a_garbage_position_is_clamped_into_the_cache():
    stack = Stack(tiny(), 16)
    stack.logits(torch.tensor([[3, 4]]), torch.tensor([[-7, 1 << 40]]))
    assert stack.kv.positions.tolist() == [[0, 15]]


@pytest.mark.parametrize(("row", "written"), [(-1, 0), (7, 2)])
def test_a_garbage_row_is_clamped_into_the_batch(row, written):
    """A row past the batch writes its last row's K and V, and a negative one the first's: a
    device value is clamped as positions are (a row of 7 was an index error after the K and V of
    the rows before it were written, on a GPU a device-side assert; -1 wrote the last row as
    torch indexes, then failed)."""
    stack = Stack(tiny(), 16, batch=3)
    before = [k.clone() for k in stack.kv.k]
    with torch.no_grad():
        hidden = stack.append(torch.tensor([[5, 6]]), torch.tensor([[0, 1]]), rows=torch.tensor([row]))
    assert hidden.shape[:2] == (1, 2)
    changed = [r for r in range(3) if not torch.equal(before[0][r], stack.kv.k[0][r])]
    assert changed == [written]


# -- trees --------------------------------------------------------------------------------------

TREE = TreeShape.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])  # 7 nodes, depth 3


def tree_forward(model: LlamaForCausalLM, layout, static: bool) -> tuple[Stack, dict]:
    """Two rows prefilled, stale entries written past their roots, then every node of TREE in one
    forward: K/V at slot root + node, RoPE at root + depth, attending under TreeMask."""
    stack = Stack(model, CAPACITY, batch=2, cache=layout)
    prompts = [[1, 5, 9, 3, 4], [2, 8, 6, 1, 7, 30, 31, 9, 4]]
    stack.prefill(range(2), [p[:-1] for p in prompts])
    start = torch.tensor([[len(p) - 1] for p in prompts])  # the root's slot: the pending token's position
    stale = start + torch.arange(12)
    stack.append(torch.full((2, 12), 50), stale)  # entries of an earlier round, past the root
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, TREE.nodes), generator=gen)
    tokens[:, 0] = torch.tensor([p[-1] for p in prompts])
    depth = torch.tensor([len(ancestors(TREE, i)) - 1 for i in range(TREE.nodes)])
    mask = TreeMask(mask_words(TREE, 2), CAPACITY, model.dtype, TREE if static else None).at(start)
    logits = stack.logits(tokens, start + depth, slots=start + torch.arange(TREE.nodes),
                          mask=mask.rows(0, TREE.nodes))
    return stack, dict(prompts=prompts, tokens=tokens, start=start, logits=logits)


@pytest.mark.parametrize("static", [True, False], ids=["static", "from-words"])
@pytest.mark.parametrize("layout", [StaticKV, PagedKV], ids=["static-kv", "paged"])
def test_a_trees_nodes_see_the_prefix_and_their_ancestors_only(layout, static):
    """Each node's logits are Hugging Face's over the prompt and the node's root path: not its
    siblings, not their subtrees, not the stale entries past the root."""
    model = tiny()
    _, seen = tree_forward(model, layout, static)
    for r, prompt in enumerate(seen["prompts"]):
        for node in range(TREE.nodes):
            path = prompt[:-1] + [int(seen["tokens"][r, i]) for i in ancestors(TREE, node)]
            torch.testing.assert_close(seen["logits"][r, node], hf_logits(model, path), **TOL,
                                       msg=lambda m, r=r, node=node: f"row {r}, node {node}: {m}")


def test_a_paged_cache_compacts_the_accepted_path_as_the_layers_kernel_does():
    """PagedKV.compact moves each row's accepted path to the slots after the root, depth by depth
    (a later depth's source never an earlier one's destination), as kernel 15 moves a static
    cache's: the same entries at every slot, in logical order."""
    model = tiny()
    paged, seen = tree_forward(model, PagedKV, True)
    static, _ = tree_forward(model, StaticKV, True)
    path = torch.tensor([[0, 2, 5, 0], [0, 1, 3, 6]])  # row 0 accepted [1], [1, 0]; row 1 [0], [0, 0], [0, 0, 0]
    accepted, start = torch.tensor([[2], [3]]), seen["start"]
    paged.kv.compact(path.int(), accepted.int(), start.int())
    for kv in (*static.kv.k, *static.kv.v):  # a layer's tensor each, [B][heads][capacity][d]
        before = kv.clone()
        for row in range(2):
            for d in range(1, int(accepted[row]) + 1):
                kv[row, :, start[row, 0] + d] = before[row, :, start[row, 0] + path[row, d]]
    for layer in range(3):
        for mine, want in zip(paged.kv.gather(layer, torch.arange(2)), (static.kv.k[layer], static.kv.v[layer])):
            torch.testing.assert_close(mine, want, atol=0, rtol=0)


# -- recurrent state ----------------------------------------------------------------------------

def test_a_padded_prefill_leaves_each_rows_own_state_and_logits():
    """Rows of 7 and 3 prompt tokens prefilled together (the shorter padded, its padding masked
    out of the recurrence) leave the states and logits each leaves alone."""
    model, prompts = hybrid(), [[1, 5, 9, 3, 4, 8, 2], [7, 7, 1]]
    both = Stack(model, CAPACITY, batch=2)
    both.prefill(range(2), prompts)
    assert isinstance(both.state, LiveState)
    for row, prompt in enumerate(prompts):
        alone = Stack(model, CAPACITY)
        alone.prefill([0], [prompt])
        torch.testing.assert_close(both.state.live[:, row], alone.state.live[:, 0], **TOL)
    nxt = torch.tensor([[3], [4]])
    positions = torch.tensor([[7], [3]])
    together = both.logits(nxt, positions)
    for row, prompt in enumerate(prompts):
        alone = Stack(model, CAPACITY)
        alone.prefill([0], [prompt])
        torch.testing.assert_close(together[row, 0], alone.logits(nxt[row:row + 1], positions[row:row + 1])[0, 0],
                                   **TOL)


def stepped_states(model: LlamaForCausalLM, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The live state after each of `tokens`, stepped one at a time after `prompt`."""
    stack = Stack(model, CAPACITY)
    stack.prefill([0], [prompt])
    states = []
    for i, token in enumerate(tokens):
        stack.logits(torch.tensor([[token]]), torch.tensor([[len(prompt) + i]]))
        states.append(stack.state.live[:, 0].clone())
    return states


def test_a_verify_leaves_the_state_after_each_token_in_its_slot_and_live_untouched():
    model, prompt, tokens = hybrid(), [1, 5, 9, 3], [4, 8, 2, 6]
    stack = Stack(model, CAPACITY, state=lambda layers, batch, shape, device: CopyState(layers, batch, shape,
                                                                                         device, k=3))
    stack.prefill([0], [prompt])
    live = stack.state.live.clone()
    stack.logits(torch.tensor([tokens]), torch.tensor([[4, 5, 6, 7]]))
    torch.testing.assert_close(stack.state.live, live, atol=0, rtol=0)
    for i, want in enumerate(stepped_states(model, prompt, tokens)):
        torch.testing.assert_close(stack.state.slots[:, 0, i], want, **TOL)


def test_a_states_k_is_a_count_of_drafts():
    """CopyState(k=-1) made no slot and k=True two, and the verify's store met a bare IndexError
    (FlipState's likewise): k is refused by name where it is given, k = 0 (one slot) taken."""
    from memra_cuda.torch.state import FlipState
    for k, error, message in ((-1, ValueError, "k must be an int of at least 0, not -1"),
                              (True, TypeError, "k must be an integer, not True"),
                              (2.0, TypeError, "k must be an integer, not 2.0")):
        for make in (lambda: CopyState(1, 2, (3,), "cpu", k=k),
                     lambda: FlipState(1, 2, (3,), "cpu", k=k, engine=None)):  # type: ignore[arg-type]
            with pytest.raises(error, match=message):
                make()
    assert CopyState(1, 2, (3,), "cpu", k=0).slots.shape == (1, 2, 1, 3)



def test_a_states_sizes_are_counts_refused_by_name():
    """LiveState(1, True, (4,)) was a batch of one, LiveState(-1, ...) met torch's "negative
    dimension", a shape of ("4",) or 4 its zeros() error naming no argument (CopyState's and
    FlipState's likewise): each refused by name as the state is made, before FlipState asks its
    engine for anything; a state of one layer, one row and one word taken."""
    from memra_cuda.torch.state import FlipState
    for args, error, message in (((1, True, (4,)), TypeError, "batch must be an integer, not True"),
                                 ((-1, 1, (4,)), ValueError, "layers must be an int of at least 1, not -1"),
                                 ((1, 0, (4,)), ValueError, "batch must be an int from 1 to 65535, not 0"),
                                 ((1, 1, ("4",)), TypeError, "a state's shape\\[0\\] must be an integer, not '4'"),
                                 ((1, 1, (4, 0)), ValueError, "a state's shape\\[1\\] must be an int of at least 1"),
                                 ((1, 1, 4), TypeError, "a state's shape must be a list, a tuple or a 1-D array")):
        for make in (lambda: LiveState(*args, "cpu"), lambda: CopyState(*args, "cpu", k=1),
                     lambda: FlipState(*args, "cpu", k=1, engine=None)):  # type: ignore[arg-type]
            with pytest.raises(error, match=message):
                make()
    assert LiveState(1, 1, (1,), "cpu").live.shape == (1, 1, 1)


def test_a_trees_nodes_step_from_their_parents_state():
    """A hybrid verify over TREE's nodes (parents given) leaves in slot i the state after node i's
    root path, stepped token by token."""
    model, prompt = hybrid(), [1, 5, 9, 3]
    stack = Stack(model, CAPACITY, state=lambda layers, batch, shape, device: CopyState(layers, batch, shape,
                                                                                         device, k=TREE.nodes - 1))
    stack.prefill([0], [prompt[:-1]])
    tokens = torch.tensor([[prompt[-1], 11, 12, 13, 14, 15, 16]])
    start = torch.tensor([[len(prompt) - 1]])
    depth = torch.tensor([len(ancestors(TREE, i)) - 1 for i in range(TREE.nodes)])
    mask = TreeMask(mask_words(TREE, 1), CAPACITY, model.dtype, TREE).at(start)
    stack.logits(tokens, start + depth, slots=start + torch.arange(TREE.nodes), mask=mask.rows(0, TREE.nodes),
                 parents=torch.tensor([TREE.parent]).clamp(min=0))
    for node in range(TREE.nodes):
        path = [int(tokens[0, i]) for i in ancestors(TREE, node)]
        want = stepped_states(model, prompt[:-1], path)[-1]
        torch.testing.assert_close(stack.state.slots[:, 0, node], want, **TOL, msg=lambda m, n=node: f"node {n}: {m}")


# -- drafts -------------------------------------------------------------------------------------

def test_a_self_speculative_draft_is_the_targets_first_layers_and_head():
    model = tiny()
    draft = self_draft(model, 2)
    assert draft.config.num_hidden_layers == 2 and model.config.num_hidden_layers == 3
    assert draft.model.layers[1] is model.model.layers[1] and draft.lm_head is model.lm_head
    ids = [1, 5, 9, 3, 4]
    stack = Stack(draft, CAPACITY)
    stack.prefill([0], [ids[:-1]])
    torch.testing.assert_close(stack.logits(torch.tensor([[4]]), torch.tensor([[4]]))[0, 0], hf_logits(draft, ids),
                               **TOL)
    assert stack.prefix_of(Stack(model, CAPACITY)) and not Stack(model, CAPACITY).prefix_of(stack)
    for layers, error in ((0, ValueError), (3, ValueError), ("1", TypeError), (True, TypeError), (1.5, TypeError)):
        with pytest.raises(error, match="layers \\(a self-speculative draft takes 1 to 2 of the target's 3\\)"):
            self_draft(model, layers)


def test_a_separate_draft_holds_copies_of_the_targets_first_layers_and_shares_nothing():
    model = tiny()
    draft = separate_draft(model, 2, torch.float32)
    assert draft.config.num_hidden_layers == 2 and len(draft.model.layers) == 2
    theirs = {p.data_ptr() for p in model.parameters()}
    assert not any(p.data_ptr() in theirs for p in draft.parameters()), "a separate draft shares no tensor"
    assert not Stack(draft, CAPACITY).prefix_of(Stack(model, CAPACITY))
    ids = [1, 5, 9, 3, 4]
    torch.testing.assert_close(hf_logits(draft, ids), hf_logits(self_draft(model, 2), ids), atol=0, rtol=0)
    assert separate_draft(model).dtype == torch.bfloat16


# -- sampling -----------------------------------------------------------------------------------

@pytest.mark.parametrize("params", [SamplingParams(0.7), SamplingParams(1.3, top_k=5),
                                    SamplingParams(1.0, top_p=0.8), SamplingParams(0.5, top_k=20, top_p=0.9)],
                         ids=["temperature", "top-k", "top-p", "all"])
def test_sampling_params_are_hugging_faces_logits_processors(params):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    logits = torch.randn(4, 3, 50, generator=torch.Generator().manual_seed(2)) * 3
    scores = logits.view(-1, 50)
    scores = TemperatureLogitsWarper(params.temperature)(None, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    torch.testing.assert_close(params.probs(logits), scores.softmax(-1).view(4, 3, 50), atol=1e-6, rtol=1e-5)
    for bad in (dict(temperature=0.0), dict(top_k=-1), dict(top_p=0.0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_sampling_params_refuse_what_is_no_law_and_a_small_temperature_is_nearly_greedy():
    """A bool is no temperature or top_p (True was 1), an infinite temperature no law of the
    model's (every token alike), a string a TypeError naming it, not a comparison's; a
    temperature of 1e-38 gives the likeliest token all the mass, where dividing first gave NaN."""
    for bad, error, named in ((dict(temperature=True), TypeError, "temperature must be a real number"),
                              (dict(temperature="1"), TypeError, "temperature must be a real number"),
                              (dict(temperature=math.inf), ValueError, "temperature must be finite and > 0"),
                              (dict(temperature=math.nan), ValueError, "temperature must be finite and > 0"),
                              (dict(top_p=True), TypeError, "top_p must be a real number"),
                              (dict(top_p=math.nan), ValueError, "top_p must be in"),
                              (dict(top_k=True), TypeError, "top_k must be an integer")):
        with pytest.raises(error, match=named):
            SamplingParams(**bad)
    params = SamplingParams(np.float32(0.5), np.int64(3), np.float64(0.9))
    assert [type(v) for v in (params.temperature, params.top_k, params.top_p)] == [float, int, float]
    logits = torch.tensor([[1.0, 3.0, 2.0], [-1e4, 5.0, 5.0 - 1e-3]])
    probs = SamplingParams(1e-38).probs(logits)
    assert torch.isfinite(probs).all() and probs.argmax(-1).tolist() == [1, 1] and probs.max(-1).values.min() == 1


def test_hugging_faces_reference_refuses_what_a_decoder_refuses_before_the_model_runs(monkeypatch):
    """hf_generate (and hf_greedy), what every decoder is checked against, took what no decoder
    takes: a token outside the vocabulary met the embedding's IndexError (a device assert on a
    GPU), a budget of 2.5 or True ran (3 tokens, 1), an EOS outside the vocabulary or negative
    stopped no row, a float prompt met the embedding's dtype error, no prompts max()'s, a float
    for `sampling` an AttributeError. Each is refused now as a decoder's generate_batch refuses its
    requests (RequestRefused naming the row), before the model runs; at the limits (the last token
    and EOS of the vocabulary, a budget of 2**31 - 1) the model is asked as before, and a budget of 0
    gives no tokens, as a decoder's does (Hugging Face's generate refused it)."""
    from memra_cuda.torch import hf_generate, hf_greedy
    model = tiny(1)
    want = hf_greedy(model, [1, VOCAB - 1], 3, eos=VOCAB - 1)
    assert len(want) <= 3 and all(0 <= token < VOCAB for token in want)
    asked = []
    monkeypatch.setattr(model, "generate", lambda ids, **given: asked.append((ids.tolist(), given)) or ids)
    for args, given, error, named in (
            (([[1, VOCAB]], 3), {}, RequestRefused, f"request 0 refused: its prompt's token {VOCAB} \\(at 1\\) is "
                                                     f"outside the vocabulary of {VOCAB} tokens"),
            (([[1], [-1]], 3), {}, RequestRefused, "request 1 refused: its prompt's token -1"),
            (([[1, 2.0]], 3), {}, RequestRefused, "request 0 refused: its prompt must be a sequence of at least one"),
            (([[]], 3), {}, RequestRefused, "its prompt must be a sequence of at least one token id"),
            (("abc", 3), {}, TypeError, "hf_generate's prompts must be a list, a tuple or a 1-D array of prompts"),
            (([], 3), {}, ValueError, "^hf_generate takes at least one prompt$"),
            (({1: [1]}, 3), {}, TypeError, "hf_generate's prompts must be a list"),
            (([[1]], 2.5), {}, RequestRefused, "max_new_tokens must be an integer, not 2.5"),
            (([[1]], True), {}, RequestRefused, "max_new_tokens must be an integer, not True"),
            (([[1]], -1), {}, RequestRefused, "max_new_tokens must be an int from 0 to 2147483647, not -1"),
            (([[1]], 2**31), {}, RequestRefused, "max_new_tokens must be an int from 0 to 2147483647, not 2147483648"),
            (([[1]], 3), dict(eos=VOCAB), RequestRefused, f"its EOS {VOCAB} is outside the vocabulary of {VOCAB}"),
            (([[1]], 3), dict(eos=-1), RequestRefused, "eos must be None or an int of at least 0, not -1"),
            (([[1]], 3), dict(sampling=0.7), TypeError, "sampling is a memra_cuda.torch.SamplingParams"),
            # a draft that is no model met "'str' object has no attribute 'generation_config'"
            (([[1]], 3), dict(assistant="draft"), TypeError, "hf_generate's assistant is a transformers causal LM "
                                                             "\\(a draft model\\) or None, not 'draft'"),
            (([[1]], 3), dict(k=0), ValueError, "k \\(the assistant's drafts a round\\) must be an int of at least 1")):
        with pytest.raises(error, match=named):
            hf_generate(model, *args, **given)
    with pytest.raises(RequestRefused, match="request 0 refused: its prompt must be a sequence"):
        hf_greedy(model, "abc", 3)
    assert asked == []
    assert hf_generate(model, [[1], [2, 3]], 0) == [[], []] and asked == []
    hf_generate(model, [np.array([1, VOCAB - 1])], 2**31 - 1, eos=VOCAB - 1)
    assert asked == [([[1, VOCAB - 1]], dict(attention_mask=asked[0][1]["attention_mask"], max_new_tokens=2**31 - 1,
                                             min_new_tokens=0, eos_token_id=VOCAB - 1, pad_token_id=0,
                                             do_sample=False))]


# -- loading ------------------------------------------------------------------------------------

def save_pair(where) -> tuple:
    """A tiny target and a draft of another shape saved as Hugging Face directories, with one
    word-level tokenizer beside each."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w1")
    target, draft = tiny(4, seed=1), tiny(2, seed=2)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(where / name)
        tokenizer.save_pretrained(where / name)
    return target, draft


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_directory_loads_for_inference_with_its_tokenizer(tmp_path, dtype):
    target, _ = save_pair(tmp_path)
    loaded = load_model(tmp_path / "target", dtype=dtype, device="cpu")
    assert loaded.dtype == dtype and not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    assert loaded.config._attn_implementation == "sdpa" and loaded.config.num_hidden_layers == 4
    torch.testing.assert_close(loaded.lm_head.weight.float(), target.lm_head.weight.to(dtype).float(), atol=0, rtol=0)
    tokenizer = load_tokenizer(tmp_path / "draft")
    assert tokenizer.encode("w5 w9 w3") == [5, 9, 3] and tokenizer.eos_token_id == 1
    if dtype == torch.float32:
        stack = Stack(loaded, CAPACITY)
        stack.prefill([0], [[5, 9]])
        torch.testing.assert_close(stack.logits(torch.tensor([[3]]), torch.tensor([[2]]))[0, 0],
                                   hf_logits(target, [5, 9, 3]), **TOL)


def test_a_device_the_machine_lacks_is_refused_before_a_missing_directory():
    """load_model on a machine without CUDA (its default device "cuda") said first that the
    directory held no config.json, and only once one was found that the machine has no GPU: the
    device, which no directory mends, is refused first. A GPU one past the machine's stands for
    it where the machine has CUDA."""
    device = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=re.escape(f"device {device!r} is not on this machine")):
        load_model("/nowhere/at/all", device=device)


@pytest.mark.parametrize("device", ["gpu", "cuda:99", 3.5, "meta", "xpu:99", "mps:99"])
def test_a_device_the_machine_lacks_is_refused_before_the_checkpoint_is_read(tmp_path, monkeypatch, device):
    """load_model(device="gpu") (or a GPU past the machine's, an Intel or Apple one past its
    count, the meta device, where weights are shapes alone) met torch's error, or none, only once
    every weight had been read: a ValueError naming the device now comes first."""
    import transformers
    save_pair(tmp_path)
    read = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: read.append(a))
    with pytest.raises(ValueError, match=re.escape(f"device {device!r} is ")):
        load_model(tmp_path / "target", device=device)
    assert not read


def test_a_directorys_own_python_is_never_run(tmp_path, monkeypatch):
    """A config.json whose auto_map names the directory's own module made transformers ask at a
    terminal whether to run it (and run it on a yes): both loaders say no, whoever is asked."""
    import transformers
    save_pair(tmp_path)
    told = []
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        real = cls.from_pretrained

        def recorded(*args, real=real, **kwargs):
            told.append(kwargs.get("trust_remote_code"))
            return real(*args, **kwargs)
        monkeypatch.setattr(cls, "from_pretrained", recorded)
    load_model(tmp_path / "target", device="cpu")
    load_tokenizer(tmp_path / "target")
    assert told == [False, False]


def test_a_directory_without_a_model_is_refused_by_name(tmp_path):
    for load in (functools.partial(load_model, device="cpu"), load_tokenizer):
        with pytest.raises(FileNotFoundError, match="holds no config.json"):
            load(tmp_path / "nowhere")
    tiny().save_pretrained(tmp_path / "alone")  # a model saved without its tokenizer
    with pytest.raises(FileNotFoundError, match=r"holds a model but no tokenizer \(none of tokenizer.json, "):
        load_tokenizer(tmp_path / "alone")
    # a dtype by a name torch does not have met AttributeError: module 'torch' has no attribute 'bf16'
    with pytest.raises(ValueError, match="dtype is a floating-point torch.dtype of 2 bytes or more or one of "
                                         ".*'bfloat16'.*, not 'bf16'"):
        load_model(tmp_path, dtype="bf16")



def edited(directory, **fields) -> None:
    """`directory`'s config.json with `fields` set."""
    import json
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **fields}))


@pytest.mark.parametrize("fields, error, message", [
    (dict(hidden_size=-64), ValueError, "hidden_size must be an int of at least 1, not -64"),
    (dict(vocab_size=0), ValueError, "vocab_size must be an int of at least 1, not 0"),
    (dict(hidden_size="64"), TypeError, "hidden_size must be an integer, not '64'"),
    (dict(num_attention_heads=4, num_key_value_heads=3), ValueError,
     r"num_key_value_heads \(3\) does not divide its num_attention_heads \(4\)"),
    (dict(num_attention_heads=5, num_key_value_heads=5, head_dim=None), ValueError,
     r"num_attention_heads \(5\) does not divide its hidden_size \(64\)"),
    (dict(rope_scaling={"rope_type": "wibble", "factor": 2.0}), ValueError, "rope_scaling names rope type 'wibble'"),
    (dict(num_hidden_layers=5), ValueError, "num_hidden_layers is 5, but its weights hold 4 layers"),
    (dict(num_hidden_layers=2**20), ValueError, "num_hidden_layers is 1048576, but its weights hold 4 layers"),
    (dict(dtype="wibble"), ValueError, "dtype names no floating-point dtype of torch's, not 'wibble'"),
    (dict(dtype=None, torch_dtype="int8"), ValueError, "torch_dtype names no floating-point dtype of torch's, "
                                                       "not 'int8'"),
    (dict(hidden_act="wibble"), ValueError, "hidden_act names activation 'wibble', none transformers knows"),
    (dict(rms_norm_eps=-1e-6), ValueError, "rms_norm_eps must be a finite number of at least 0, not -1e-06"),
    (dict(rms_norm_eps=float("nan")), ValueError, "rms_norm_eps must be a finite number of at least 0, not nan"),
    (dict(rms_norm_eps="1e-6"), TypeError, "rms_norm_eps must be a real number, not '1e-6'"),
    (dict(pad_token_id=VOCAB), ValueError, f"pad_token_id must be None or an int from -{VOCAB} to {VOCAB - 1} "
                                           f"\\(its embedding's padding_idx\\), not {VOCAB}"),
    (dict(pad_token_id=-VOCAB - 1), ValueError, f"pad_token_id must be None or an int from -{VOCAB} to "
                                                f"{VOCAB - 1} \\(its embedding's padding_idx\\), not -{VOCAB + 1}"),
])
def test_a_config_json_that_does_not_hold_is_refused_by_its_field_before_any_weight(tmp_path, monkeypatch, fields,
                                                                                    error, message):
    """transformers met a negative size with torch's "negative dimension", a string with an error of
    no ValueError's kind, KV heads that do not divide the heads with a shape mismatch, an unknown
    rope type with a KeyError, naming no field; a layer count past the weights' initialised the
    layers they lack at random (2**20 of them: for ever); a dtype torch lacks met torch's
    AttributeError ("module 'torch' has no attribute 'wibble'"), an unknown activation a KeyError
    of its name alone, a pad_token_id past the vocabulary torch's AssertionError ("Padding_idx must
    be within num_embeddings"), and a negative or NaN rms_norm_eps loaded a model whose logits were
    NaN."""
    import transformers
    save_pair(tmp_path)
    edited(tmp_path / "target", **fields)
    read = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: read.append(a))
    with pytest.raises(error, match=re.escape(str(tmp_path / "target" / "config.json")) + "'s " + message):
        load_model(tmp_path / "target", device="cpu")
    assert not read


@pytest.mark.parametrize("text, message", [("{not json", "is not JSON: "), ("[1, 2]", "holds a JSON object, not list")])
def test_a_config_json_that_is_no_json_object_is_refused_by_name(tmp_path, text, message):
    save_pair(tmp_path)
    (tmp_path / "target" / "config.json").write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'target' / 'config.json'} {message}")):
        load_model(tmp_path / "target", device="cpu")


def test_a_config_json_at_its_limits_is_taken(tmp_path):
    """An rms_norm_eps of 0 (a norm without one) and a float64 dtype are configs transformers
    makes: the checks above stop short of them."""
    from memra_cuda.torch import models
    save_pair(tmp_path)
    edited(tmp_path / "target", rms_norm_eps=0.0, dtype="float64", torch_dtype="wibble", pad_token_id=VOCAB - 1)
    models._check_config(tmp_path / "target", None)  # beside a dtype, transformers reads no torch_dtype
    edited(tmp_path / "target", pad_token_id=-VOCAB)  # -1, some Llamas' "none", is the last token's, as torch reads it
    models._check_config(tmp_path / "target", None)
    # a quantized checkpoint names its storage's dtype (FP8 ones on the Hub: "torch_dtype": "float8_e4m3fn");
    # its weights are the quantizer's to read, and load_model's own dtype is the model's
    edited(tmp_path / "target", dtype=None, torch_dtype="float8_e4m3fn",
           quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    models.check_model(tmp_path / "target")
    edited(tmp_path / "target", torch_dtype="wibble")  # a name torch lacks is refused still
    with pytest.raises(ValueError, match="torch_dtype names no floating-point dtype of torch's, not 'wibble'"):
        models.check_model(tmp_path / "target")


@pytest.mark.parametrize("fields, error", [
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}), "KeyError: \"Missing required keys in "
                                                                       "`rope_parameters` for 'rope_type'='linear'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "x"}), "TypeError: unsupported operand"),
    (dict(attention_bias="yes"), "StrictDataclassFieldValidationError: Validation error for field 'attention_bias'"),
])
def test_a_config_json_transformers_makes_no_model_of_is_refused_naming_the_file(tmp_path, monkeypatch, fields, error):
    """What transformers refuses as it reads config.json or makes its model met its own error, a
    KeyError, a TypeError from deep inside ("'str' and 'Tensor'"), or huggingface_hub's
    StrictDataclassError, which is none of ValueError's kind, none naming the file: a ValueError
    naming it now, transformers' words after it, before any weight is made."""
    import transformers
    save_pair(tmp_path)
    edited(tmp_path / "target", **fields)
    read = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: read.append(a))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'target' / 'config.json'} makes no model transformers "
                                                   "builds: ") + error):
        load_model(tmp_path / "target", device="cpu")
    assert not read


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float8_e4m3fn])
def test_a_dtype_no_model_is_made_in_is_refused_before_the_directory(tmp_path, dtype):
    """load_model(dtype=torch.int64) met transformers' refusal once the checkpoint was read, and a
    float8 dtype "TypeError: couldn't find storage object Float8_e4m3fnStorage"."""
    with pytest.raises(ValueError, match=re.escape(f"dtype is a floating-point torch.dtype of 2 bytes or more or one "
                                                   f"of ('auto', 'bfloat16', 'float16', 'float32'), not {dtype}")):
        load_model(tmp_path / "nowhere", dtype=dtype, device="cpu")


def test_weights_of_no_floating_point_dtype_are_refused_by_name_before_any_weight(tmp_path, monkeypatch):
    """A checkpoint whose norm is i32 and head bool under a float model (no quantization_config)
    loaded, each cast to the model's dtype (the head 0s and 1s), transformers saying nothing."""
    import transformers
    from safetensors.torch import load_file, save_file
    save_pair(tmp_path)
    path = tmp_path / "target" / "model.safetensors"
    weights = load_file(path)
    weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.int32)
    weights["lm_head.weight"] = weights["lm_head.weight"] > 0
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"].half()  # a float: cast, as ever
    save_file(weights, path, metadata={"format": "pt"})
    read = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: read.append(a))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'target'}'s weights are of no floating-point dtype "
                                                   "where its model's are floats: 2 (lm_head.weight: BOOL, "
                                                   "model.norm.weight: I32)")):
        load_model(tmp_path / "target", device="cpu")
    assert not read


@pytest.mark.parametrize("text, said", [("{}", "KeyError: 'added_tokens'"), ("{not json", "JSONDecodeError: ")])
def test_a_tokenizer_transformers_cannot_read_is_refused_naming_the_directory(tmp_path, text, said):
    """A tokenizer.json that is no tokenizer met transformers' KeyError ('added_tokens') or json's
    JSONDecodeError, naming no file: a ValueError naming the directory, their words after it."""
    from memra_cuda.torch import load_tokenizer
    save_pair(tmp_path)
    (tmp_path / "draft" / "tokenizer.json").write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'draft'} holds a tokenizer transformers cannot read: "
                                                   f"{said}")):
        load_tokenizer(tmp_path / "draft")


def test_weights_that_are_no_safetensors_file_are_refused_naming_the_file(tmp_path):
    """safetensors' own error on a file that is not one named no file."""
    save_pair(tmp_path)
    path = tmp_path / "target" / "model.safetensors"
    path.write_bytes(b"\x10" * 64)
    with pytest.raises(ValueError, match=re.escape(f"{path} is no safetensors file: ")):
        load_model(tmp_path / "target", device="cpu")


@pytest.mark.parametrize("kind", ["missing", "unexpected"])
def test_weights_that_do_not_match_the_config_are_refused_not_made_up(tmp_path, kind):
    """A checkpoint without its lm_head (a tied model's, under a config that unties it) loaded with a
    randomly initialised head, and one with a tensor the model has no place for loaded without it,
    transformers only logging either: a silently wrong model, now a ValueError naming the key."""
    from safetensors.torch import load_file, save_file
    save_pair(tmp_path)
    path = tmp_path / "target" / "model.safetensors"
    weights = load_file(path)
    if kind == "missing":
        del weights["lm_head.weight"]
    else:
        weights["model.extra.weight"] = torch.zeros(2)
    save_file(weights, path, metadata={"format": "pt"})
    key = "lm_head.weight" if kind == "missing" else "model.extra.weight"
    with pytest.raises(ValueError, match=re.escape(f"weights do not match its config.json: 1 {kind} ({key})")):
        load_model(tmp_path / "target", device="cpu")


def test_a_layer_count_short_of_the_weights_is_refused_not_truncated(tmp_path):
    """num_hidden_layers one short of the weights' loaded a model without its last layer."""
    save_pair(tmp_path)
    edited(tmp_path / "target", num_hidden_layers=3)
    with pytest.raises(ValueError, match=re.escape("weights do not match its config.json: 9 unexpected "
                                                   "(model.layers.3.input_layernorm.weight, ")):
        load_model(tmp_path / "target", device="cpu")


def shaped(directory, count: int, *mismatches: tuple) -> str:
    """load_model's refusal of weights of another shape than `directory`'s config.json makes: a
    pattern of its start, naming `count` and the first of `mismatches` (name, the weights' shape,
    config.json's)."""
    first = "; ".join(f"{name}: {list(found)} in the weights, {list(made)} by config.json"
                      for name, found, made in mismatches)
    return re.escape(f"{directory}'s weights do not match its config.json: {count} of another shape ({first}")


@pytest.mark.parametrize("fields, count, first", [
    (dict(hidden_size=128), 39, ("model.embed_tokens.weight", (VOCAB, 64), (VOCAB, 128))),
    (dict(intermediate_size=128), 12, ("model.layers.0.mlp.gate_proj.weight", (96, 64), (128, 64))),
    (dict(vocab_size=100), 2, ("model.embed_tokens.weight", (VOCAB, 64), (100, 64))),
    (dict(num_key_value_heads=4), 8, ("model.layers.0.self_attn.k_proj.weight", (32, 64), (64, 64))),
    (dict(head_dim=32), 16, ("model.layers.0.self_attn.q_proj.weight", (64, 64), (128, 64))),
], ids=["hidden", "intermediate", "vocab", "kv_heads", "head_dim"])
def test_weights_of_another_shape_than_the_config_makes_are_refused_by_name_before_any_weight(
        tmp_path, monkeypatch, fields, count, first):
    """A config.json edited to another size met transformers' RuntimeError "You set
    `ignore_mismatched_sizes` to `False`, thus raising an error. For details look at the above
    report!", naming no tensor (the report went to its log), once the model was made: a
    ValueError naming the directory, the tensors and both shapes now, from the safetensors
    headers against the model config.json makes on the meta device, before from_pretrained."""
    import transformers
    save_pair(tmp_path)
    edited(tmp_path / "target", **fields)
    read = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: read.append(a))
    with pytest.raises(ValueError, match=shaped(tmp_path / "target", count, first)):
        load_model(tmp_path / "target", device="cpu")
    assert not read


def test_another_models_weights_are_refused_naming_the_first_tensors_of_another_shape(tmp_path):
    """A model.safetensors of another model (as deep, half as wide) under the directory's config.json."""
    import shutil
    save_pair(tmp_path)
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "narrow")
    shutil.copy(tmp_path / "narrow" / "model.safetensors", tmp_path / "target" / "model.safetensors")
    with pytest.raises(ValueError, match=shaped(tmp_path / "target", 39, ("model.embed_tokens.weight", (VOCAB, 32),
                                                                         (VOCAB, 64)),
                                                 ("model.layers.0.self_attn.q_proj.weight", (32, 32), (64, 64)),
                                                 ("model.layers.0.self_attn.k_proj.weight", (16, 32), (32, 64)))
                       + re.escape("; ...)")):
        load_model(tmp_path / "target", device="cpu")


def test_sharded_weights_are_checked_shard_by_shard(tmp_path, monkeypatch):
    """A checkpoint saved in shards (model.safetensors.index.json): each shard's header is read,
    so a size edited is refused as with one file, and the directory unedited loads as it did."""
    import transformers
    target = tiny(4, seed=1)
    target.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    loaded = load_model(tmp_path / "sharded", device="cpu")
    torch.testing.assert_close(loaded.lm_head.weight, target.lm_head.weight, atol=0, rtol=0)
    edited(tmp_path / "sharded", intermediate_size=128)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: None)
    with pytest.raises(ValueError, match=shaped(tmp_path / "sharded", 12,
                                                ("model.layers.0.mlp.gate_proj.weight", (96, 64), (128, 64)))):
        load_model(tmp_path / "sharded", device="cpu")


def test_weights_of_another_shape_that_only_loading_meets_are_refused_by_name_too(tmp_path, monkeypatch):
    """Where the headers are not compared (a model whose weights transformers converts as it
    loads, a quantized one, keys by other names), loading meets the shapes: transformers'
    report of them (ignore_mismatched_sizes=True, so that it reports rather than raises) is
    refused by name, with the keys missing beside them. The comparison of the headers is taken
    away here to reach it."""
    from safetensors.torch import load_file, save_file
    from memra_cuda.torch import models
    save_pair(tmp_path)
    path = tmp_path / "target" / "model.safetensors"
    weights = load_file(path)
    del weights["model.norm.weight"]
    save_file(weights, path, metadata={"format": "pt"})
    edited(tmp_path / "target", intermediate_size=128)
    monkeypatch.setattr(models, "_check_shapes", lambda directory, saved: None, raising=False)
    first = [(f"model.layers.0.mlp.{name}_proj.weight", found, made)
             for name, found, made in (("gate", (96, 64), (128, 64)), ("up", (96, 64), (128, 64)),
                                       ("down", (64, 96), (64, 128)))]
    with pytest.raises(ValueError, match=shaped(tmp_path / "target", 12, *first)
                       + re.escape("; ...); 1 missing (model.norm.weight)")):
        load_model(tmp_path / "target", device="cpu")


# -- the face -----------------------------------------------------------------------------------

def test_every_public_name_of_memra_cuda_torch_says_what_it_is():
    import memra_cuda.torch as memra_torch
    assert len(set(memra_torch.__all__)) == len(memra_torch.__all__)
    undocumented = [name for name in memra_torch.__all__ if not (getattr(memra_torch, name).__doc__ or "").strip()]
    assert not undocumented, undocumented


# -- refusals before any device work ------------------------------------------------------------

def test_a_stack_refuses_what_it_cannot_run():
    with pytest.raises(TypeError, match="has no model.embed_tokens"):
        Stack(torch.nn.Linear(2, 2), CAPACITY)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=32)
    windowed = MistralForCausalLM(config).eval()
    with pytest.raises(ValueError, match="sliding window of 32 positions"):
        Stack(windowed, 48)
    assert Stack(windowed, 32).kv.capacity == 32
    # compiled, its cache is whole blocks of 128, past the window: it runs through its modules
    assert isinstance(stack_for(windowed, 32), Stack)
    with pytest.raises(NotFused, match="sliding window of 32 positions"):
        stack_for(windowed, 32, compiled=True)


def test_a_stack_refuses_a_prefill_of_rows_it_does_not_hold_before_touching_them():
    """A row past the batch would be a device-side assert on a GPU (the context lost), a row
    twice two prefills racing for its KV, a prompt short or over silently misplaced."""
    def endless():  # itertools.count(), which was listed whole before a row was checked: for ever
        for row in itertools.count():
            assert row <= 2, "rows were read past the first that is none of the batch's"
            yield row

    stack = Stack(tiny(), CAPACITY, batch=2)
    stack.prefill([0, 1], [[1, 2, 3], [4, 5]])
    lengths = stack.kv.lengths.clone()
    for rows, prompts, error, why in (
            ([0, 2], [[1], [2]], ValueError, "a row must be an int from 0 to 1, not 2"),
            ([-1], [[1]], ValueError, "a row must be an int from 0 to 1, not -1"),
            ([1, 1], [[1], [2]], ValueError, "a prefill's rows must be distinct rows of 0..1, not \\[1, 1\\]"),
            (endless(), [[1], [2]], ValueError, "a row must be an int from 0 to 1, not 2"),
            ((row for row in itertools.repeat(1)), [[1]], ValueError, "distinct rows of 0..1, not \\[1, 1, 1\\]"),
            (torch.tensor([0, 0]), [[1], [2]], ValueError, "a prefill's rows must be distinct rows"),  # 0-d tensors
            ([True], [[1]], TypeError, "a row must be an integer, not True"),
            ([0, 1], [[1]], ValueError, "one prompt for each of distinct rows of 0..1"),
            # a token outside the vocabulary faults the device in the embedding lookup; a float was truncated
            ([0], [[1, VOCAB]], ValueError, f"row 0's prompt token {VOCAB} \\(at 1\\) is outside the vocabulary"),
            ([1], [[-1]], ValueError, "row 1's prompt token -1 \\(at 0\\) is outside"),
            ([0], [[1, 1.7]], TypeError, "row 0's prompt must be token ids"),
            ([0], [[True, 1]], TypeError, "row 0's prompt must be token ids"),
            # len() met these deep inside: "object of type 'generator' has no len()"
            ([0], [(token for token in [1, 2])], TypeError, "row 0's prompt must be token ids"),
            ([1], [np.int64(5)], TypeError, "row 1's prompt must be token ids"),
            # what is no sequence of rows, or of prompts (a dict's keys were read as prompts): named
            (0, [[1, 2]], TypeError, "a prefill's rows are a sequence of row indices, not 0"),
            # bytes are no rows: a bytearray or bytes were read as their ints, b"\\x00\\x01" rows 0 and 1
            (b"\x00\x01", [[1], [2]], TypeError, "a prefill's rows are a sequence of row indices, not b"),
            (bytearray(b"\x01"), [[1]], TypeError, "a prefill's rows are a sequence of row indices, not bytearray"),
            # a set's order is its hashes': {1, 0} was rows 0 and 1, each given the other's prompt; a dict's its keys'
            ({1, 0}, [[1], [2]], TypeError, "a prefill's rows are a sequence of row indices, not \\{0, 1\\}"),
            ({1: [1]}, [[1]], TypeError, "a prefill's rows are a sequence of row indices, not \\{1: \\[1\\]\\}"),
            ([0], bytearray(b"\x01"), TypeError, "a prefill's prompts must be a list, a tuple or a 1-D array"),
            ([0], {0: [1, 2]}, TypeError, "a prefill's prompts must be a list, a tuple or a 1-D array")):
        with pytest.raises(error, match=why):
            stack.prefill(rows, prompts)
    assert torch.equal(stack.kv.lengths, lengths), "a refused prefill changed a row"


def test_a_caches_rows_are_copied_only_from_a_cache_of_its_layout_each_row_checked_first():
    """StaticKV.copy_rows (a self-speculative draft's prefill: the target's first layers' rows)
    took a device index it never checked (a row past the batch is a device-side assert on a GPU,
    a row twice two copies racing) from any cache (one of another capacity met a shape error
    after the K of earlier layers were copied, a PagedKV's pages were read as rows). Each is
    refused naming what, nothing copied; rows as a list, a range or a tensor are the same rows."""
    from types import SimpleNamespace

    from memra_cuda.torch import PagedKV
    config = SimpleNamespace(num_key_value_heads=2, head_dim=4, hidden_size=8, num_attention_heads=2)

    def filled(kind=StaticKV, layers=3, batch=3, capacity=16, dtype=torch.float32, **extra):
        cache = kind(config, layers, batch, capacity, dtype, "cpu", **extra)
        for i, kv in enumerate(cache.k + cache.v):
            kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(i)))
        cache.lengths.copy_(torch.arange(layers * batch, dtype=torch.int32).view(layers, batch))
        return cache
    target = filled()
    for rows in ([2, 0], range(0, 3, 2), torch.tensor([0, 2])):
        draft = StaticKV(config, 2, 3, 16, torch.float32, "cpu")
        draft.copy_rows(target, rows)
        for mine, theirs in zip(draft.k + draft.v, target.k[:2] + target.v[:2]):
            assert torch.equal(mine[[0, 2]], theirs[[0, 2]]) and not mine[1].any()
        assert torch.equal(draft.lengths, target.lengths[:2] * torch.tensor([1, 0, 1], dtype=torch.int32))
    paged = filled(PagedKV, page=4)
    draft = PagedKV(config, 1, 3, 16, torch.float32, "cpu", page=4)
    draft.copy_rows(paged, [1])
    assert torch.equal(draft.gather(0, torch.tensor([1]))[0], paged.gather(0, torch.tensor([1]))[0])
    draft = StaticKV(config, 2, 3, 16, torch.float32, "cpu")
    for other, rows, error, why in (
            (target, [3], ValueError, "a row must be an int from 0 to 2, not 3"),
            (target, [-1], ValueError, "a row must be an int from 0 to 2, not -1"),
            (target, [True], TypeError, "a row must be an integer, not True"),
            (target, [1.0], TypeError, "a row must be an integer"),
            (target, [1, 1], ValueError, "copy_rows' rows must be distinct rows of 0..2, not \\[1, 1\\]"),
            (target, 1, TypeError, "copy_rows' rows are a sequence of row indices, not 1"),
            (filled(capacity=32), [0], ValueError, "capacity 32.* into a StaticKV of 2 layer.s., batch 3, capacity 16"),
            (filled(batch=4), [0], ValueError, "batch 4"),
            (filled(layers=1), [0], ValueError, "StaticKV of 1 layer"),
            (filled(dtype=torch.float64), [0], ValueError, "torch.float64"),
            (paged, [0], ValueError, "not a PagedKV of 3 layer"),
            (target.k[0], [0], TypeError, "copy_rows copies from a StaticKV or a PagedKV, not a Tensor")):
        with pytest.raises(error, match=why):
            draft.copy_rows(other, rows)
    assert not any(kv.any() for kv in draft.k + draft.v) and not draft.lengths.any(), "a refused copy wrote"


class Fickle(list):
    """A prompt whose tokens change once they have been read: the ones a prefill checked, then
    one outside the vocabulary at every later read."""

    def __init__(self, tokens):
        super().__init__(tokens)
        self.reads = 0

    def __iter__(self):
        self.reads += 1
        return iter(list.__iter__(self) if self.reads == 1 else [VOCAB] * len(self))


def test_a_prefill_runs_the_prompts_it_checked():
    """A prefill checked its prompts, then read them again to fill the cache: a prompt that read
    otherwise the second time put a token outside the vocabulary in the embedding lookup (an
    IndexError here, a device fault on a GPU), and numpy's uint64 ids, checked as ids, met torch's
    "promotion for uint64" error. What is prefilled is the checked copy: the list's logits."""
    want = Stack(tiny(), CAPACITY, batch=2)
    want.prefill([0, 1], [[1, 2, 3], [4, 5]])
    tokens, positions = torch.tensor([[7], [8]]), torch.tensor([[3], [2]])
    for prompt in (Fickle([1, 2, 3]), np.array([1, 2, 3], dtype=np.uint64)):
        stack = Stack(tiny(), CAPACITY, batch=2)
        stack.prefill([0, 1], [prompt, [4, 5]])
        torch.testing.assert_close(stack.logits(tokens, positions), want.logits(tokens, positions), **TOL)


def test_a_rank_outside_the_world_is_refused_before_its_share_is_cut():
    """Its share of every layer would be empty, and its all-reduce would add zeros silently."""
    from memra_cuda.torch import shard
    model = tiny()
    before = [w.clone() for w in model.parameters()]
    for rank, world in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match=f"rank {rank} is not one of a world of {world} ranks"):
            shard(model, rank, world, lambda out: None)
    for rank, world, named in ((True, 2, "rank"), ("0", 2, "rank"), (0.0, 2, "rank"), (0, 2.0, "world")):
        with pytest.raises(TypeError, match=f"{named} must be an integer"):
            shard(model, rank, world, lambda out: None)
    assert all(torch.equal(w, was) for w, was in zip(model.parameters(), before)), "a refused shard changed the model"


def test_the_decoders_refuse_their_models_and_options_before_any_device_work():
    """Each refusal is raised before a CUDA stream is made (this machine may have none)."""
    model = tiny()
    draft = self_draft(model)
    cases = [
        (lambda: SpeculativeLlama(model, tiny(1, vocab=VOCAB + 1)), "vocabulary \\(98 tokens\\)"),
        (lambda: SpeculativeLlama(hybrid(), self_draft(hybrid(), 2)), "must be attention"),
        (lambda: SpeculativeLlama(model, draft, state_rollback="swap"), '"copy" or "flip", not \'swap\''),
        (lambda: SpeculativeLlama(model, draft, k=0), "k \\(no drafts: GraphedGreedy, or a request's max_draft=0\\) "
                                                      "must be an int of at least 1, not 0"),
        (lambda: SpeculativeLlama(model, draft, m_rounds=0), "m_rounds must be an int of at least 1"),
        (lambda: SpeculativeLlama(model, draft, capacity=-1), "capacity must be a Room or an int from 1 to 2147483520"),
        (lambda: SpeculativeLlama(model, draft, draft_sampling=SamplingParams()), "give sampling= too"),
        (lambda: SpeculativeLlama(model, draft, capacity=Room(0, 8)), "prompt_len must be an int of at least 1"),
        (lambda: TreeLlama(model, draft, TREE, capacity=Room(4, -1)), "tokens must be an int of at least 0"),
        (lambda: TreeLlama(model, draft, TREE, candidates=33),
         "the kernels rank at most 32\\) must be an int from 2 to 32, not 33"),
        (lambda: TreeLlama(model, draft, TREE, candidates=1), "candidates \\(the tree draws 2 a node.* not 1"),
        (lambda: TreeLlama(tiny(vocab=8), self_draft(tiny(vocab=8)), TreeShape.chain(2), candidates=9),
         "from 1 to 8, not 9"),
        (lambda: TreeLlama(model, draft, TREE, candidates=2, sampling=SamplingParams()), "candidates= is for greedy"),
        (lambda: TreeLlama(model, draft, TREE, state_rollback="swap"), "not 'swap'"),
        (lambda: SpeculativeLlama(model, draft, widths=(2,), skip_done=True), "skip_done takes no widths"),
        (lambda: SpeculativeLlama(hybrid(), self_draft(hybrid()), skip_done=True), "skip_done takes no hybrid target"),
        (lambda: TreeLlama(hybrid(), self_draft(hybrid()), TREE, skip_done=True), "skip_done takes no hybrid target"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message):
            make()
    with pytest.raises(TypeError, match="TreeShape or a DynamicTree"):
        TreeLlama(model, draft, [[0], [1]])
    with pytest.raises(TypeError, match="capacity is a Room\\(prompt_len, tokens\\) or an int of slots, "
                                        "not \\(512, 256\\)"):
        SpeculativeLlama(model, draft, capacity=(512, 256))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Tensor is not device memory"):
        buffer(torch.zeros(3))
    # a law that is not a SamplingParams met .probs after the warm-up; a draft left out, .config
    for make, message in ((lambda: SpeculativeLlama(model, draft, sampling=0.7), "sampling is a memra_cuda.torch"),
                          (lambda: SpeculativeLlama(model, draft, sampling=SamplingParams(), draft_sampling={}),
                           "draft_sampling is a memra_cuda.torch.SamplingParams"),
                          (lambda: SpeculativeLlama(model, None), "the draft is a transformers causal LM"),
                          (lambda: TreeLlama(None, draft, TREE), "the model is a transformers causal LM")):
        with pytest.raises(TypeError, match=message):
            make()
    for make in (lambda: SpeculativeLlama(model, draft, skip_done=None),
                 lambda: TreeLlama(model, draft, TREE, skip_done=1)):
        with pytest.raises(TypeError, match="^skip_done must be True or False"):
            make()
    with pytest.raises(TypeError, match="candidates .* must be an integer, not 'abc'"):
        TreeLlama(model, draft, TREE, candidates="abc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="page must be an int from 1 to 64, not 0"):
        PagedKV(model.config, 1, 1, 64, torch.float32, "cpu", page=0)
    # a page past the capacity was allocated whole for every row (4096 positions for 16; 2**40 tried 140 TB)
    for page in (65, 2**40):
        with pytest.raises(ValueError, match=f"page must be an int from 1 to 64, not {page}"):
            PagedKV(model.config, 1, 1, 64, torch.float32, "cpu", page=page)
    assert PagedKV(model.config, 1, 1, 64, torch.float32, "cpu", page=64).pool_k.shape[1:4] == (1, 2, 64)  # one a row
    # the default page over a cache shorter than it: a stack's PagedKV of 8 slots, as before the bound
    assert Stack(model, 8, cache=PagedKV).kv.pool_k.shape[1:4] == (1, 2, 16)
    with pytest.raises(ValueError, match="page must be an int from 1 to 16, not 17"):
        PagedKV(model.config, 1, 1, 8, torch.float32, "cpu", page=17)
    with pytest.raises(TypeError, match="paged cache"):
        PagedKV(model.config, 1, 1, 64, torch.float32, "cpu").data()


def test_a_greedy_tree_asking_more_candidates_than_the_vocabulary_is_refused_before_any_device_work(monkeypatch):
    """A greedy tree whose node asks for more candidates than the vocabulary holds (a rank of 9 or a
    dynamic branch of 12 over 8 tokens), candidates= left out, was taken: torch.topk refused it
    past both models' stacks, and up to 4 ranks the argmaxes gave token 0 twice (3 over 2 tokens). Refused by name
    before the decoder's stream is made; as many candidates as tokens pass, and a sampled tree
    short of tokens too (its node draws void children, docs/trees.md)."""
    stop_at_the_stream(monkeypatch)
    model = tiny(vocab=8)
    draft = self_draft(model)
    for tree, draws in ((TreeShape.from_choices([[9]]), 10), (DynamicTree(2, 4, 12), 12)):
        for candidates in (None, 9):  # given, it was "from 10 to 8"
            with pytest.raises(ValueError, match=re.escape(f"a greedy tree asks a node for {draws} candidates (its "
                                                           "highest rank + 1, a dynamic tree's branch), more than "
                                                           "the vocabulary's 8 tokens")):
                TreeLlama(model, draft, tree, candidates=candidates)
    two = tiny(vocab=2)  # 3 ranks by argmaxes: the third was token 0 again
    with pytest.raises(ValueError, match="a greedy tree asks a node for 3 candidates .* vocabulary's 2 tokens"):
        TreeLlama(two, self_draft(two), TreeShape.from_choices([[0], [2]]))
    for tree, sampling in ((TreeShape.from_choices([[7]]), None), (DynamicTree(2, 4, 8), None),
                           (DynamicTree(2, 4, 8), SamplingParams()), (TreeShape.from_choices([[0], [1]]), None)):
        with pytest.raises(_NoStream):
            TreeLlama(model, draft, tree, sampling=sampling)


def test_a_room_is_sized_by_the_geometry_of_the_decoder_it_is_given_to():
    """A Room (the longest prompt and the most new tokens a row holds) is the cache capacity_for
    gives for the decoder's own geometry: a chain's (k, M, B), a tree's (its depth and nodes), the
    plain loop's (None: the prompt but its last token, and the budget); each rounded to 16
    slots, and a bool or a float refused by name."""
    from memra_cuda import Geometry
    from memra_cuda.torch.kv import as_capacity
    room = Room(40, 96)
    for geometry in (Geometry(4, 16), Geometry(2, 8, 64), Geometry.of_tree(TREE, 16, 4)):
        assert room.entries(geometry) == as_capacity(room, geometry) == capacity_for(40, 96, geometry)
        assert room.entries(geometry) >= kv_capacity(40, 96, geometry, overlap=True)
        assert room.entries(geometry) % 16 == 0
    assert room.entries(None) == capacity_for(40, 96, None) == 144  # 39 + 96, to 16's
    assert Room(1, 0).entries(None) == 16 and as_capacity(48, Geometry(4, 16)) == 48
    with pytest.raises(TypeError, match="prompt_len"):
        Room(True, 8)
    with pytest.raises(TypeError, match="tokens"):
        Room(8, 2.5)
    with pytest.raises(TypeError, match="capacity"):
        as_capacity((40, 96), Geometry(4, 16))


def test_capacity_for_refuses_a_cache_past_the_most_a_row_holds_where_it_is_asked():
    """capacity_for gave a size past MOST_SLOTS, which the decoder it was given to refused as its
    "capacity", a number the caller never wrote: refused now where it is asked, naming the
    prompt_len and tokens, at the first size past the limit; the largest under it is given."""
    from memra_cuda import Geometry
    from memra_cuda.torch.attention import MOST_SLOTS
    from memra_cuda.torch.kv import as_capacity
    assert MOST_SLOTS % 16 == 0  # so a need of MOST_SLOTS is itself the size, and one more rounds past it
    for geometry in (None, Geometry(4, 16), Geometry(2, 8, 64), Geometry.of_tree(TREE, 16, 4)):
        beyond = 0 if geometry is None else kv_capacity(1, 0, geometry, overlap=True)  # its need past p - 1 + t
        largest = MOST_SLOTS + 1 - beyond  # the longest prompt whose need is MOST_SLOTS, with no token
        assert capacity_for(largest, 0, geometry) == capacity_for(1, largest - 1, geometry) == MOST_SLOTS
        assert as_capacity(Room(largest, 0), geometry) == MOST_SLOTS
        for prompt_len, tokens in ((largest + 1, 0), (1, largest)):
            named = (f"prompt_len {prompt_len} and tokens {tokens} take a cache of {MOST_SLOTS + 16} slots a row, "
                     f"past the most a row holds, {MOST_SLOTS}")
            with pytest.raises(ValueError, match=named):
                capacity_for(prompt_len, tokens, geometry)
            with pytest.raises(ValueError, match=named):
                as_capacity(Room(prompt_len, tokens), geometry)


class Prefilled:
    """A stack's prefill alone, for a decoder's host side: the rows and heads it was given at its
    unchecked entry (_prefill_trusted), which a decoder hands the prompts it has checked; its
    public prefill, which would check them a second time, fails the test. Its cache's capacity
    is CAPACITY (a decoder's longest_prompt reads it)."""

    def __init__(self):
        self.calls = []
        self.kv = SimpleNamespace(capacity=CAPACITY)

    def prefill(self, rows, heads):
        raise AssertionError("a decoder's stack was given checked prompts through its public prefill, checked again")

    def _prefill_trusted(self, rows, heads):
        self.calls.append((list(rows), [list(head) for head in heads]))


def test_a_decoders_admission_takes_every_prompt_a_server_takes(monkeypatch):
    """A Server takes a prompt that is an array as well formed (rounds.serving.malformed), so a
    speculative decoder's admission must too: its check of the prompts was `not prompt`, which
    raises for an array, so the request sat at the queue's head and every step raised. The
    decoder here is its host side alone: stand-in stacks, no stream, tensors on the CPU."""
    from memra_cuda.torch import decoder as decoders
    decoder = object.__new__(decoders.RoundDecoder)
    decoder.stream, decoder.shared, decoder.sampling, decoder.vocab = None, False, None, 100
    decoder.target, decoder.draft = Prefilled(), Prefilled()
    monkeypatch.setattr(decoders, "uploaded", lambda values, dtype, device: torch.tensor(values, dtype=dtype))
    checked = decoder._checked_prompts([1, 0], [np.array([5, 6, 7]), (8,)], None)
    assert decoder._fill_trusted([1, 0], *checked) == ([2, 0], [7, 8])
    assert decoder.target.calls == decoder.draft.calls == [([1, 0], [[5, 6], []])]
    for prompt, error in ((np.array([], np.int64), ValueError), ((token for token in [5, 6]), TypeError),
                          (np.int64(5), TypeError)):  # the last two met len() deep inside
        with pytest.raises(error, match="row 0's prompt must be a sequence of at least one token id"):
            decoder._checked_prompts([0], [prompt], None)
    with pytest.raises(ValueError, match="need one prompt for each of the 2 rows, not 1"):
        decoder._checked_prompts([0, 1], [[5]], None)


def test_a_prefills_prompts_seeds_and_caps_past_its_rows_are_refused_by_their_count_unread():
    """A speculative decoder's prefill listed its prompts, seeds and caps whole before comparing
    their count with its rows': range(10**10) given for one of them met a MemoryError (tens of
    GB) to be refused as one a row. Past the rows' count each is refused by its len(), unread
    (an Unread sequence's items are never asked for); at the count they are read as before. The
    decoder here is its host side alone: no stream, no model."""
    from memra_cuda.rounds.serving import Driven
    from memra_cuda.torch import decoder as decoders
    from stand_in import Unread
    decoder = object.__new__(decoders.RoundDecoder)
    decoder.vocab, decoder.batch, decoder.k, decoder.driven = 100, 2, 4, Driven()
    decoder.target = SimpleNamespace(kv=SimpleNamespace(capacity=16))  # longest_prompt's
    decoder._prefill_trusted = lambda *args: args  # what the checks pass on
    for given in (dict(prompts=Unread(3)), dict(prompts=range(10**10)), dict(seeds=Unread(3)),
                  dict(caps=Unread(3)), dict(caps=range(10**10))):
        name = next(iter(given))
        args = {"prompts": [[1], [2]], **given}
        with pytest.raises(ValueError, match=f"a prefill's {name} holds at most 2 .*, not (3|10000000000)$"):
            decoder.prefill([0, 1], **args)
    rows, prompts, seeds, caps = decoder.prefill([0, 1], [[1], (2, 3)], seeds=[5, 6], caps=[4, 0])  # at the count
    assert (rows, prompts, seeds, caps) == ([0, 1], [[1], [2, 3]], [5, 6], [4, 0])
    with pytest.raises(ValueError, match="need one seed for each of the 2 rows, not 1"):
        decoder.prefill([0, 1], [[1], [2]], seeds=[5])


def test_a_decoders_room_reads_a_mode_by_its_name_as_the_mode():
    """room(request, "overlap") compared the name with Mode.OVERLAP, and measured a burst of
    "graph"'s without the one in flight: a request past overlap's room was said to fit. A mode's
    name is the mode (as_mode, as generate_batch and server() read it): at overlap's most budget
    the request fits, one more is refused, by name as by Mode, and a name of no mode is a
    ValueError naming the choices. The decoder here is its host side alone: no stream, no model."""
    from memra_cuda import Geometry
    from memra_cuda.rounds import Request
    from memra_cuda.rounds.stream import Mode, as_mode
    from memra_cuda.torch import decoder as decoders
    decoder = object.__new__(decoders.RoundDecoder)
    geometry, capacity = Geometry(4, 16, 1), 256
    decoder.rounds = SimpleNamespace(round=SimpleNamespace(capacity=SimpleNamespace(geometry=geometry)),
                                     rounds_per_step=lambda mode: 1 if as_mode(mode) is Mode.READBACK else 16)
    decoder.target = SimpleNamespace(kv=SimpleNamespace(capacity=capacity))
    most = max(n for n in range(capacity) if kv_capacity(10, n, geometry, overlap=True) <= capacity)
    assert kv_capacity(10, most + 1, geometry) <= capacity, "graph's room is overlap's: nothing to tell apart"
    for mode in (Mode.OVERLAP, "overlap"):
        assert decoder.room(Request([1] * 10, most), mode) is None
        assert decoder.room(Request([1] * 10, most + 1), mode) == (
            f"10 prompt tokens and {most + 1} new need a KV cache of {capacity + 1} entries in overlap mode; "
            f"these hold {capacity}")
    assert decoder.room(Request([1] * 10, most + 1), "graph") is None
    with pytest.raises(ValueError, match="mode must be one of .*, not 'overlapped'"):
        decoder.room(Request([1] * 10, 1), "overlapped")


@pytest.mark.parametrize(("steps", "error"), [(2.5, TypeError), (0, ValueError), (True, TypeError)])
def test_the_plain_loop_refuses_a_burst_of_no_whole_steps_before_anything_is_made(steps, error):
    """GraphedGreedy's `steps` (a burst's steps, which size its output and its loop) is checked
    as a size, naming it, before any stream or tensor is made."""
    from memra_cuda.torch import GraphedGreedy
    with pytest.raises(error, match="steps"):
        GraphedGreedy(tiny(), 64, steps=steps)


def test_the_plain_loop_refuses_a_burst_of_more_steps_than_a_row_holds_before_anything_is_made(monkeypatch):
    """GraphedGreedy's `steps` is at most a row's cache slots (its capacity in whole blocks: 128 for
    64 or 128, 256 for 129): no request takes more tokens than its row holds, so every step past
    them is past every row's stop. steps=2**40 was taken, to torch's out of memory for its output
    (16 TB) after the stream and the model's fused weights. At the most, it gets as far as its stream."""
    from memra_cuda.torch import GraphedGreedy

    stop_at_the_stream(monkeypatch)
    model = tiny()
    for capacity, most in ((64, 128), (128, 128), (129, 256), (Room(10, 54), 128)):
        for steps in (most + 1, 2**40):
            said = rf"^steps \(a row's cache holds {most} slots\) must be an int from 1 to {most}, not {steps}$"
            with pytest.raises(ValueError, match=said):
                GraphedGreedy(model, capacity, steps=steps)
        with pytest.raises(_NoStream):
            GraphedGreedy(model, capacity, steps=most)


@pytest.mark.parametrize(("batch", "error"), [(True, TypeError), (2.0, TypeError), (0, ValueError), (-1, ValueError)])
def test_the_plain_loop_refuses_a_batch_of_no_rows_before_anything_is_made(batch, error):
    """GraphedGreedy's `batch`, its rows (a Server's slots), is checked as a size, naming it,
    before any stream or tensor is made: True made a loop of one row whose server() then raised
    TypeError, 0 one that no server takes, -1 met torch's negative dimension."""
    from memra_cuda.torch import GraphedGreedy
    with pytest.raises(error, match="batch must be an"):
        GraphedGreedy(tiny(), 64, batch=batch)


def test_a_speculative_decoders_server_parks_the_rows_it_names_each_checked_first():
    """A RoundDecoder's rows as its server drives them (decoder._Slots.park): as many rows as the
    batch stopped every row, so [0, 0] of two rows parked row 1 too (its request ended as if it
    had stopped) and [5, 9] parked both without a word. Now each row is checked before any is
    stopped, a row named twice stops once, and every row stops at once only where every row is
    named; more rows than the batch are refused, itertools.repeat(0) (read for ever) too (the
    host side alone: the buffers' calls recorded)."""
    from memra_cuda.rounds.serving import Driven
    from memra_cuda.rounds.stream import Mode
    from memra_cuda.torch.decoder import _Slots

    class Bufs:
        def __init__(self):
            self.calls = []

        def set_stop(self, budget):
            self.calls.append(("all", budget))

        def set_stop_row(self, row, budget):
            self.calls.append((row, budget))

    decoder = type("Decoder", (), dict(batch=2, vocab=VOCAB, bufs=Bufs(), driven=Driven()))()
    slots = _Slots(decoder, Mode.GRAPH)
    for rows, error, named in (([5, 9], ValueError, "row 5 is not one of the decoder's 2"),
                               ([0, -1], ValueError, "row -1 is not one of the decoder's 2"),
                               ([True], TypeError, "a row must be an integer, not True"),
                               (b"\x00\x01", TypeError, "park\\(\\) takes rows, ints of the decoder's 2, not b'"),
                               (bytearray(2), TypeError, "park\\(\\) takes rows"),
                               ("01", TypeError, "park\\(\\) takes rows"),
                               (3, TypeError, "park\\(\\) takes rows"),
                               ([0, 0, 0], ValueError, "park\\(\\) names more rows than the decoder's 2"),
                               (itertools.repeat(0), ValueError, "park\\(\\) names more rows")):  # read for ever
        with pytest.raises(error, match=named):
            slots.park(rows)
        assert decoder.bufs.calls == []
    slots.park([0, 0])
    assert decoder.bufs.calls == [(0, 0)]
    slots.park(range(2))
    assert decoder.bufs.calls[1:] == [("all", 0)]


def test_the_plain_loop_parks_only_rows_it_has_and_each_checked_before_any_is_parked():
    """GraphedGreedy.park (a Server's Decoder, public) indexed its rows' stops by what it was
    given: -1 parked the last row, whose request a server then ended as stopped, its tokens cut
    short, and True parked row 1; a row past the batch raised IndexError after the ones before it
    were parked, and itertools.repeat(1) was read for ever. Each is refused now, naming it, with
    no row parked (the host side alone: no stream, no model)."""
    from memra_cuda.rounds.serving import Driven
    from memra_cuda.torch import GraphedGreedy
    from memra_cuda.torch.greedy import _Stop
    decoder = object.__new__(GraphedGreedy)
    decoder.batch, decoder.driven = 2, Driven()
    stops = [_Stop(None, 5), _Stop(None, 5)]
    decoder._stops = list(stops)
    for rows, error, named in (([-1], ValueError, "row -1 is not one of the decoder's 2"),
                               ([0, 2], ValueError, "row 2 is not one of the decoder's 2"),
                               ([True], TypeError, "a row must be an integer, not True"),
                               ([1.0], TypeError, "a row must be an integer, not 1.0"),
                               (b"\x01", TypeError, "park\\(\\) takes rows, ints of the decoder's 2, not b'"),
                               (memoryview(b"\x01"), TypeError, "park\\(\\) takes rows"),
                               ([1, 1, 1], ValueError, "park\\(\\) names more rows than the decoder's 2"),
                               (itertools.repeat(1), ValueError, "park\\(\\) names more rows")):  # read for ever
        with pytest.raises(error, match=named):
            decoder.park(rows)
        assert decoder._stops == stops
    decoder.park([np.int64(1)])  # the last row, at the limit
    decoder.park([1, 1])  # as many as the batch, a row twice
    assert decoder._stops == [stops[0], None]


def test_a_serve_interrupted_leaves_the_rows_to_the_next_serve():
    """serve() makes its own server, which no caller holds; interrupted mid-burst (Ctrl-C), it
    lived on in the traceback (a REPL keeps the last one, pytest.raises its own) with requests in
    flight that nobody could step or cancel, and every later serve(), server() and
    generate_batch of the decoder was refused for them. Now that server drives the rows no more
    (the plain loop over a stand-in graph and stack: the host side alone)."""
    from types import SimpleNamespace

    from memra_cuda.rounds.serving import Driven
    from memra_cuda.torch import GraphedGreedy, Request

    class Graph:  # a burst's replay: every column the replay's count; the second interrupted
        replays = 0

        def replay(self):
            self.replays += 1
            if self.replays == 2:
                raise KeyboardInterrupt
            decoder.out.fill_(self.replays)

    decoder = object.__new__(GraphedGreedy)
    decoder.batch, decoder.steps, decoder.vocab, decoder.eager, decoder.stream = 2, 4, VOCAB, False, None
    decoder.stack = SimpleNamespace(kv=SimpleNamespace(capacity=64), capture_prefills=lambda: None,
                                    _prefill_trusted=lambda rows, prompts: None)
    decoder.graph, decoder._stops, decoder.driven = Graph(), [None, None], Driven()
    decoder.token, decoder.position = torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long)
    decoder.out = torch.zeros(4, 2, dtype=torch.long)  # [steps][B]
    decoder._first = decoder.out[0, :1]  # the burst's first token, marked before a replay
    with pytest.raises(KeyboardInterrupt) as interrupted:
        decoder.serve([Request([1, 2], 30)] * 3)
    assert interrupted.traceback, "the traceback, and the server in it, live on"
    (served,) = decoder.serve([Request([1, 2], 4)])
    assert served.tokens == [3] * 4


def test_the_plain_loops_capture_leaves_no_row_running_on_from_its_warm_up(monkeypatch):
    """GraphedGreedy.capture() starts every row with its warm-up's prompt and runs it, so a
    request an engine had admitted by hand (admit() is public) lost its row: its stop was kept,
    and the next burst handed the warm-up's tokens out as the request's, silently. The rows it
    starts are vacant after it, as a server's or a batch's start leaves them (the host side
    alone: a stand-in stack and graph, whose every token is the warm-up's 9)."""
    import contextlib

    from memra_cuda.rounds.serving import Driven
    from memra_cuda.torch import GraphedGreedy, Request
    from memra_cuda.torch import greedy

    class Graph:
        def replay(self):
            decoder.out.fill_(9)

    monkeypatch.setattr(greedy, "torch_graph", lambda stream: contextlib.nullcontext(Graph()))
    decoder = object.__new__(GraphedGreedy)
    decoder.batch, decoder.steps, decoder.vocab, decoder.eager, decoder.stream = 2, 4, VOCAB, False, None
    decoder.stack = SimpleNamespace(kv=SimpleNamespace(capacity=64), logits=lambda token, position: None,
                                    _prefill_trusted=lambda rows, prompts: None)
    decoder.advance = lambda logits, token, position, out: out.fill_(9)
    decoder.graph, decoder._stops, decoder.driven, decoder._cut = None, [None, None], Driven(), False
    decoder.token, decoder.position = torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long)
    decoder.out = torch.zeros(4, 2, dtype=torch.long)  # [steps][B]
    decoder._first = decoder.out[0, :1]  # the burst's first token, marked before a replay
    decoder.admit(0, Request([5, 6], 8))
    decoder.capture()
    assert decoder.burst().tokens == [[], []], "a request admitted before the capture took the warm-up's tokens"


def test_a_prefill_refuses_its_rows_caps_and_seeds_before_a_row_is_written():
    """RoundDecoder.prefill checked a cap after both caches had taken the prompts, which left
    the rows live without a budget; a seed past 64 bits raised after the target's prefill. Each
    is refused now with neither cache touched (the decoder's host side: stand-in stacks)."""
    from memra_cuda.rounds.serving import Driven
    from memra_cuda.torch.decoder import RoundDecoder
    decoder = object.__new__(RoundDecoder)
    decoder.stream, decoder.shared, decoder.sampling, decoder.k, decoder.batch = None, False, None, 4, 2
    decoder.target, decoder.draft, decoder.vocab, decoder.driven = Prefilled(), Prefilled(), 100, Driven()
    # the last token, which becomes pending (looked up only by the draft's first step), checked with the rest:
    # it went to the buffers as int(token), 7.9 as 7, "42" as 42, 10**6 to fault the device
    for last, error in ((10**6, ValueError), (7.9, TypeError), ("42", TypeError), (True, TypeError)):
        with pytest.raises(error, match="row 1's prompt('s token 1000000 .at 1. is outside| must be a sequence of)"):
            decoder.prefill([0, 1], [[5, 6], [7, last]])
    for args, error, named in ((([0, 1], [[5, 6], [7, 8]], None, [0, 5]), ValueError, "a most draft length"),
                               (([0, 2], [[5, 6], [7, 8]]), ValueError, "a row must be an int from 0 to 1"),
                               (([True], [[5, 6]]), TypeError, "a row must be an integer"),
                               (([0], [[5, 6]], [2**64]), ValueError,
                                rf"its seed must be an int from 0 to 2\*\*64 - 1 \(a 64-bit key\), not {2**64}"),
                               # a negative seed was taken, the int64 bits of another key
                               (([0], [[5, 6]], [-1]), ValueError, r"its seed must be an int from 0 .*, not -1$"),
                               (([0], [[5, 6]], [1.5]), TypeError, "its seed must be an integer"),
                               # {row: value}: its keys were taken, each row sampled with its own number for a
                               # seed, or its cap its row's, without a word; a generator's seeds met len() inside
                               (([1], [[5, 6]], {1: 7}), TypeError, "a prefill's seeds must be a list"),
                               (([1], [[5, 6]], (s for s in [7])), TypeError, "a prefill's seeds must be a list"),
                               (([1], [[5, 6]], None, {1: 0}), TypeError, "a prefill's caps must be a list"),
                               # a bytearray (or a memoryview) of seeds or caps was read as its ints, where bytes
                               # were refused
                               (([1], [[5, 6]], bytearray(b"\x07")), TypeError, "a prefill's seeds must be a list"),
                               (([1], [[5, 6]], memoryview(b"\x07")), TypeError, "a prefill's seeds must be a list"),
                               (([1], [[5, 6]], None, bytearray(b"\x02")), TypeError,
                                "a prefill's caps must be a list")):
        with pytest.raises(error, match=named):
            decoder.prefill(*args)
    assert decoder.target.calls == decoder.draft.calls == []


def test_a_seed_past_2_63_is_written_as_the_int64_of_its_bits(monkeypatch):
    """A seed is a 64-bit key, 0 to 2**64 - 1 (docs/sampling.md): one of 2**63 or more was refused
    as past the int64 tensor that holds the rows' seeds, and a negative one was taken, the bits of
    another key. The decoder now writes a seed's bits (seed_bits: 2**64 - 1 as -1), which the
    kernels read as its key; a negative seed is refused where it enters (as_seed). The decoder
    here is its host side alone: stand-in stacks, its seeds a tensor on the CPU."""
    from memra_cuda.torch import decoder as decoders
    decoder = object.__new__(decoders.RoundDecoder)
    decoder.stream, decoder.shared, decoder.sampling, decoder.vocab = None, False, SamplingParams(), 100
    decoder.target, decoder.draft = Prefilled(), Prefilled()
    decoder.seed_d = torch.full((3,), 7, dtype=torch.int64)
    decoder._prefilled = lambda index, prompts: None
    monkeypatch.setattr(decoders, "uploaded", lambda values, dtype, device: torch.tensor(values, dtype=dtype))
    seeds = [2**64 - 1, 2**63, 5]
    checked = decoder._checked_prompts([2, 0, 1], [[5], [6], [7]], seeds)
    assert checked[1] == seeds, "the seeds checked are the request's own"
    decoder._fill_trusted([2, 0, 1], *checked)
    assert decoder.seed_d.tolist() == [-(2**63), 5, -1]
    assert decoder.seed_d.numpy().view(np.uint64).tolist() == [2**63, 5, 2**64 - 1], "the bits are the keys"


def test_a_tensor_of_values_a_row_is_one_a_row():
    """A 1-D tensor of a budget or an EOS a row (per_row: StreamBufs.set_stop, a RoundStream's
    max_new_tokens and eos; DraftLengths.set_caps) was one value for every row, refused as no
    integer; it is one a row now, as a list is, its length checked, and a 0-d tensor is one value
    for every row. buffers reads it by its tolist(), without importing torch."""
    from memra_cuda.buffers.stream_bufs import per_row, row_values
    assert per_row(torch.tensor([3, 4, 5]), 3, "budget") == [3, 4, 5]
    assert row_values(torch.tensor([3, 4, 5]), 3, "caps") == ([3, 4, 5], True)
    assert per_row(torch.tensor(6), 3, "budget") == [6, 6, 6]
    with pytest.raises(ValueError, match=r"^eos needs one value per row \(3\), not 2$"):
        per_row(torch.tensor([1, 2]), 3, "eos")
    with pytest.raises(TypeError, match=r"^budget must be an integer, not True \(row 0\)$"):
        per_row(torch.tensor([True, False]), 2, "budget")
    with pytest.raises(TypeError, match=r"^position must be an integer, not 1.5 \(row 0\)$"):
        per_row(torch.tensor([1.5, 2.0]), 2, "position", optional=False)


def test_an_admission_refuses_a_bad_draft_length_before_the_row_is_touched():
    """RoundDecoder.admit checks the request as Server.submit does, and its row, first: a bad
    most draft length, a token outside the vocabulary (an embedding lookup that would fault the
    device), a bool or a missing row raise naming what, and neither cache took the prompt (the
    row keeps what it had). admit is public: an engine may call it without a Server."""
    from memra_cuda.rounds.serving import Driven
    from memra_cuda.torch import Request
    from memra_cuda.torch.decoder import RoundDecoder
    decoder = object.__new__(RoundDecoder)
    decoder.stream, decoder.shared, decoder.sampling, decoder.k = None, False, None, 4
    decoder.vocab, decoder.batch, decoder.driven = 10, 2, Driven()
    decoder.target, decoder.draft = Prefilled(), Prefilled()
    for row, request, error, named in ((0, Request([5, 6], 4, max_draft=-1), ValueError, "max_draft"),
                                       (0, Request([5, 6], 4, max_draft=2.5), ValueError, "max_draft"),
                                       (0, Request([5, 10], 4), ValueError, "token 10 \\(at 1\\) is outside the vocab"),
                                       (0, Request([-1], 4), ValueError, "token -1 \\(at 0\\) is outside the vocab"),
                                       (True, Request([5], 4), TypeError, "a row must be an integer, not True"),
                                       (2, Request([5], 4), ValueError, "row 2 is not one of the decoder's 2")):
        with pytest.raises(error, match=named):
            decoder.admit(row, request)
    assert decoder.target.calls == decoder.draft.calls == []


def prompt_checks(monkeypatch) -> list[str]:
    """Every check of a prompt's tokens from now on (memra_cuda.driver.values.token_ids: as_prompt's,
    and a stack's public prefill's), each recorded by what it names ("its prompt's", "row 0's
    prompt")."""
    from memra_cuda.driver import values
    from memra_cuda.torch import prefill
    checks, check = [], values.token_ids

    def counted(tokens, vocab, what):
        checks.append(what)
        return check(tokens, vocab, what)

    for module in (values, prefill):
        monkeypatch.setattr(module, "token_ids", counted)
    return checks


class Recorded:
    """A stand-in whose every method records its call (name, then its arguments) and does nothing:
    a decoder's buffers and draft lengths as a row's start and park call them."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, *args, *kwargs.values()))


def served_copy(request):
    """The copy of `request` a Server keeps from its submit (checked against VOCAB)."""
    from memra_cuda.rounds.serving import admitted
    return admitted(request, VOCAB, 0, 1)[1]


def test_a_servers_admission_checks_a_prompt_once_and_a_public_prefill_still_refuses_a_bad_one(monkeypatch):
    """A request's prompt was checked five times on its way into a speculative decoder's row (the
    Server's submit, the decoder's admit and its prefill, then each stack's prefill), ~40 us each
    for 300 tokens. Now once, where it enters (a Server's submit, or the decoder's own admit or
    prefill), and handed down as checked, into both stacks' caches all the same. What a public
    prefill refused it still refuses, naming it, before any row is written (the decoder's host
    side over two real stacks on the CPU, a draft of its own: stand-in buffers and rounds)."""
    from types import SimpleNamespace

    from memra_cuda import Geometry
    from memra_cuda.rounds.serving import Driven
    from memra_cuda.rounds.stream import Mode
    from memra_cuda.torch import Request
    from memra_cuda.torch import decoder as decoders
    decoder = object.__new__(decoders.RoundDecoder)
    decoder.stream, decoder.sampling, decoder.vocab, decoder.k, decoder.batch = None, None, VOCAB, 4, 2
    decoder.target, decoder.draft = Stack(tiny(), CAPACITY, batch=2), Stack(tiny(1, seed=1), CAPACITY, batch=2)
    decoder.shared, decoder.driven, decoder.bufs, decoder.lengths = False, Driven(), Recorded(), Recorded()
    burst = SimpleNamespace(tokens=[np.array([3]), np.array([], int)], done=np.array([True, True]),
                            accepted=np.array([0, 0]))  # row 0's one token, and it is done
    decoder.rounds = SimpleNamespace(round=SimpleNamespace(capacity=SimpleNamespace(geometry=Geometry(4, 1, 2))),
                                     rounds_per_step=lambda mode: 1, step=lambda mode: burst, sealed=True)
    monkeypatch.setattr(decoders, "uploaded", lambda values, dtype, device: torch.tensor(values, dtype=dtype))
    checks = prompt_checks(monkeypatch)
    prompt = list(range(1, 21))
    (served,) = decoder.serve([Request(prompt, 4, max_draft=9)])
    assert served.tokens == [3] and checks == ["its prompt's"], "the server's admission checked its prompt again"
    for stack in (decoder.target, decoder.draft):
        assert stack.kv.lengths[:, 0].tolist() == [19] * len(stack.layers), "a stack did not take the prompt"
    assert ("start_row", 0, 20, 19, 4, None) in decoder.bufs.calls and decoder.lengths.calls == [("set_cap_row", 0, 4)]
    del checks[:]
    decoder.admit(1, Request(prompt[:7], 4))  # public: checked as a Server checks it, once
    assert checks == ["its prompt's"] and decoder.draft.kv.lengths[:, 1].tolist() == [6]
    del checks[:]
    assert decoder.prefill([1, 0], [prompt[:3], prompt[:5]]) == [2, 4]
    assert checks == ["row 1's prompt's", "row 0's prompt's"] and decoder.draft.kv.lengths[0].tolist() == [4, 2]
    before = [stack.kv.lengths.clone() for stack in (decoder.target, decoder.draft)]
    distinct = "a prefill's rows must be distinct rows of 0..1, not \\[1, 1\\]"
    for rows, prompts, error, by_decoder, by_stack in (
            ([1, 1], [[5, 6], [7, 8]], ValueError, distinct, distinct),
            ([0], [[5, VOCAB]], ValueError, f"row 0's prompt's token {VOCAB} \\(at 1\\) is outside the vocabulary",
             f"row 0's prompt token {VOCAB} \\(at 1\\) is outside the vocabulary"),
            ([0], [[5, 1.5]], TypeError, "row 0's prompt must be a sequence of at least one token id",
             "row 0's prompt must be token ids")):
        with pytest.raises(error, match=by_decoder):
            decoder.prefill(rows, prompts)
        with pytest.raises(error, match=by_stack):
            decoder.target.prefill(rows, prompts)  # a stack's own public prefill checks as it did
    assert all(torch.equal(stack.kv.lengths, lengths) for stack, lengths in
               zip((decoder.target, decoder.draft), before)), "a refused prefill wrote a row"
    # admit takes the copy a Server kept at once, the same request changed, or a caller's own, is
    # checked in full (a bad token refused before the row is touched), and the Server's own adapter
    # (server.decoder) admits through it
    slots = decoders._Slots(decoder, Mode.GRAPH)
    for request in (Request([5, VOCAB], 2), served_copy(Request([5, 6], 2))._replace(prompt=(5, VOCAB))):
        for admit in (decoder.admit, slots.admit):
            with pytest.raises(ValueError, match=f"its prompt's token {VOCAB} \\(at 1\\) is outside the vocabulary"):
                admit(0, request)
    assert all(torch.equal(stack.kv.lengths, lengths) for stack, lengths in
               zip((decoder.target, decoder.draft), before)), "a refused admission wrote a row"
    kept = served_copy(Request(prompt[:6], 2))
    checks.clear()
    slots.admit(1, kept)
    assert checks == [] and decoder.draft.kv.lengths[:, 1].tolist() == [5]
    with pytest.raises(ValueError, match="row 2 is not one of the decoder's 2"):
        decoder.admit(2, kept)


def test_the_plain_loops_server_checks_a_prompt_once_and_runs_it_as_its_own_greedy_decoding(monkeypatch):
    """GraphedGreedy's server admitted a request through the loop's public admit, which checked
    the prompt (and its room) again, and its stack's prefill a third time. Its own server now
    admits the copy the Server checked, and the request's tokens are the model's own greedy
    decoding of it; the public admit checks once (the host side over a real stack on the CPU,
    its bursts eager)."""
    from memra_cuda.rounds.serving import Driven
    from memra_cuda.torch import GraphedGreedy, Request
    from memra_cuda.torch.greedy import advance
    model = tiny()
    decoder = object.__new__(GraphedGreedy)
    decoder.batch, decoder.steps, decoder.vocab, decoder.eager, decoder.stream = 2, 3, VOCAB, True, None
    decoder.stack = Stack(model, CAPACITY, batch=2)
    monkeypatch.setattr(decoder.stack, "capture_prefills", lambda: None)  # no CUDA graphs on the CPU
    decoder.advance, decoder.graph, decoder._cut = advance, None, False  # eager: advance op by op, as Stack runs it
    decoder._stops, decoder.driven = [None, None], Driven()
    decoder.token, decoder.position = torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long)
    decoder.out = torch.zeros(3, 2, dtype=torch.long)  # [steps][B]
    decoder._first = decoder.out[0, :1]  # the burst's first token, marked before a replay
    checks = prompt_checks(monkeypatch)
    prompt = [5, 17, 3, 40, 8]
    (served,) = decoder.serve([Request(prompt, 3)])
    assert checks == ["its prompt's"], "the loop's server checked its prompt again"
    greedy = list(prompt)
    for _ in range(3):
        greedy.append(int(hf_logits(model, greedy).argmax()))
    assert served.tokens == greedy[len(prompt):]
    del checks[:]
    decoder.admit(1, Request(prompt, 2))  # public: checked as a Server checks it, once
    assert checks == ["its prompt's"] and decoder.stack.kv.lengths[:, 1].tolist() == [4] * 3
    with pytest.raises(ValueError, match=f"its prompt's token {VOCAB} \\(at 0\\) is outside the vocabulary"):
        decoder.admit(0, Request([VOCAB, 1], 2))
    # the copy a Server kept is admitted at once, but its room is still measured
    with pytest.raises(ValueError, match=f"need a cache of {CAPACITY + 1}"):
        decoder.admit(0, served_copy(Request([1, 2], CAPACITY)))
    kept = served_copy(Request(prompt[:4], 2))
    del checks[:]
    decoder.admit(0, kept)
    assert checks == [] and decoder.stack.kv.lengths[:, 0].tolist() == [3] * 3


def plain_loop(monkeypatch, batch: int = 2):
    """GraphedGreedy's host side over a real stack on the CPU (CAPACITY slots a row), its bursts
    eager (three steps each): its rows, its server and its admissions as a device's run them."""
    from memra_cuda.rounds.serving import Driven
    from memra_cuda.torch import GraphedGreedy
    from memra_cuda.torch.greedy import advance
    decoder = object.__new__(GraphedGreedy)
    decoder.batch, decoder.steps, decoder.vocab, decoder.eager, decoder.stream = batch, 3, VOCAB, True, None
    decoder.stack = Stack(tiny(), CAPACITY, batch=batch)
    monkeypatch.setattr(decoder.stack, "capture_prefills", lambda: None)  # no CUDA graphs on the CPU
    decoder.advance, decoder.graph, decoder._cut = advance, None, False
    decoder._stops, decoder.driven = [None] * batch, Driven()
    decoder.token = torch.zeros(batch, 1, dtype=torch.long)
    decoder.position = torch.zeros(batch, 1, dtype=torch.long)
    decoder.out = torch.zeros(3, batch + batch % 2, dtype=torch.long)  # [steps][B]
    decoder._first = decoder.out[0, :1]  # the burst's first token, marked before a replay
    return decoder


def test_a_decoders_prompt_longer_than_its_caches_is_refused_by_its_length_before_it_is_read(monkeypatch):
    """A lazy or huge prompt (range(3 * 10**7)) was made a numpy array and a tuple of its ints
    (seconds, hundreds of MB) before a decoder's room refused it. A decoder's longest_prompt
    (its cache's slots and the pending token) refuses a longer one by its len(), unread: at a
    Server's submit over it, in its generate_batch, its admit and (a speculative decoder's) its
    prefill, each naming it (the host sides: the plain loop over a real stack, a speculative
    decoder over stand-in stacks)."""
    from stand_in import Unread

    from memra_cuda.rounds import Server
    from memra_cuda.rounds.serving import Driven
    from memra_cuda.rounds.stream import Mode
    from memra_cuda.torch import Request
    from memra_cuda.torch import decoder as decoders
    longer = Unread(CAPACITY + 2)
    named = f"its prompt of {CAPACITY + 2} tokens does not fit a row \\(at most {CAPACITY + 1}\\)"
    plain = plain_loop(monkeypatch, batch=1)
    speculative = object.__new__(decoders.RoundDecoder)
    speculative.vocab, speculative.batch, speculative.k, speculative.driven = VOCAB, 1, 4, Driven()
    speculative.target, speculative.draft, speculative.bufs = Prefilled(), Prefilled(), Recorded()
    for decoder, server in ((plain, plain.server()), (speculative, Server(decoders._Slots(speculative, Mode.GRAPH)))):
        assert decoder.longest_prompt == CAPACITY + 1
        for ident, prompt in enumerate((longer, torch.zeros(CAPACITY + 2, dtype=torch.long))):  # a tensor's too
            with pytest.raises(RequestRefused, match=f"request {ident} refused: {named}"):
                server.submit(Request(prompt, 2))
        with pytest.raises(RequestRefused, match=f"request 0 refused: {named}"):
            decoder.generate_batch([Request(longer, 2)])
        with pytest.raises(ValueError, match=f"a request not admitted: {named}"):
            decoder.admit(0, Request(longer, 2))
    with pytest.raises(ValueError, match=f"row 0's prompt of {CAPACITY + 2} tokens does not fit a row"):
        speculative.prefill([0], [longer])
    assert speculative.target.calls == speculative.draft.calls == []
    assert plain.stack.kv.lengths.eq(0).all(), "a refused prompt reached the plain loop's cache"


def stand_in_speculative(monkeypatch, steps: list):
    """A speculative decoder of two rows over two real stacks and stand-in buffers and rounds (the
    host side of its admissions, prefills and server): each step of its rounds, its mode appended
    to `steps`, reads back one token (3) for row 0 and row 1 done; nothing to recover."""
    from memra_cuda import Geometry
    from memra_cuda.rounds.serving import Driven
    from memra_cuda.torch import decoder as decoders
    speculative = object.__new__(decoders.RoundDecoder)
    speculative.stream, speculative.sampling, speculative.vocab, speculative.k = None, None, VOCAB, 4
    speculative.batch, speculative.shared, speculative.driven = 2, False, Driven()
    speculative.target = Stack(tiny(), CAPACITY, batch=2)
    speculative.draft = Stack(tiny(1, seed=1), CAPACITY, batch=2)
    speculative.bufs, speculative.lengths = Recorded(), Recorded()
    burst = SimpleNamespace(tokens=[np.array([3]), np.array([], int)], done=np.array([True, True]),
                            accepted=np.array([0, 0]))
    speculative.rounds = SimpleNamespace(round=SimpleNamespace(capacity=SimpleNamespace(geometry=Geometry(4, 1, 2))),
                                         rounds_per_step=lambda mode: 1, sealed=True, recover=lambda: None,
                                         step=lambda mode: steps.append(mode) or burst)
    monkeypatch.setattr(decoders, "uploaded", lambda values, dtype, device: torch.tensor(values, dtype=dtype))
    return speculative


def test_an_engines_admit_or_park_is_refused_while_a_server_holds_the_rows(monkeypatch):
    """decoder.admit(row, request) by the engine's own hand, while a Server over the same decoder
    had requests in flight, overwrote a row the server held for one of them without a word, and
    GraphedGreedy.park stopped one: that request ended with tokens of another's prompt, or cut
    short, as finished. Driven guarded a new server, serve() and generate_batch, not these. Each
    is a RuntimeError naming it now (Driven.take_row), where the server's own step admits and
    parks as before; a speculative decoder's public prefill is refused too (Driven.take). Once
    the server is idle, the engine takes the rows again (the host sides: the plain loop over a
    real stack, a speculative decoder over real stacks, stand-in buffers and rounds)."""
    from memra_cuda.torch import Request
    decoder = plain_loop(monkeypatch)
    prompt, other = [5, 17, 3, 40, 8], [9, 9, 2]
    server = decoder.server()
    ident = server.submit(Request(prompt, 8))
    ended = dict(server.step().finished)  # admitted into row 0, three of its tokens read back
    for call, what in ((lambda: decoder.admit(0, Request(other, 2)), "admit\\(\\)"),
                       (lambda: decoder.park([0]), "park\\(\\)")):
        with pytest.raises(RuntimeError, match=f"{what} would take the rows of this decoder's server"):
            call()
    while not server.idle:
        ended.update(server.step().finished)
    alone = decoder.generate_batch([Request(prompt, 8), Request([1], 0)])[0]
    assert ended[ident].tokens == alone and not ended[ident].cancelled, "the server's request lost its row"
    decoder.admit(1, Request(other, 2))  # the server idle: the rows are the engine's again
    decoder.park([1])

    speculative = stand_in_speculative(monkeypatch, [])
    server = speculative.server()  # which parks every row
    ident = server.submit(Request(prompt, 4))  # queued: in flight, its row not yet taken
    parked = list(speculative.bufs.calls)
    for call, what in ((lambda: speculative.admit(0, Request(other, 2)), "admit\\(\\)"),
                       (lambda: speculative.prefill([0], [other]), "prefill\\(\\)")):
        with pytest.raises(RuntimeError, match=f"{what} would take the rows of this decoder's server"):
            call()
    assert speculative.target.kv.lengths.eq(0).all() and speculative.bufs.calls == parked
    assert server.step().finished[ident].tokens == [3]  # its own step admits it
    assert ("start_row", 0, 8, 4, 4, None) in speculative.bufs.calls
    speculative.admit(1, Request(other, 2))  # idle: the engine's again
    assert speculative.prefill([0], [other]) == [2]


def test_an_engines_burst_is_refused_while_a_server_holds_the_rows(monkeypatch):
    """GraphedGreedy.burst() by the engine's own hand, while a Server over the loop had a request
    in flight, ran that request's row and read its tokens there, counting its budget down: the
    server never saw them, and the request ended as finished with a burst's tokens missing from
    the middle of its output, silently (recover() took an interrupted burst of the server's so
    too). A speculative decoder's server.decoder.burst() (its _Slots) ran the rows the same way,
    and its park() stopped a row the server held. Each is a RuntimeError naming it now
    (Driven.take_row), where the server's own step runs, recovers and parks as before, and once
    the server is idle the engine's burst runs (the host sides: the plain loop over a real stack,
    a speculative decoder over stand-in buffers and rounds)."""
    from memra_cuda.rounds.stream import Mode
    from memra_cuda.torch import Request
    decoder = plain_loop(monkeypatch)
    prompt = [5, 17, 3, 40, 8]
    server = decoder.server()
    ident = server.submit(Request(prompt, 8))
    ended = dict(server.step().finished)  # admitted into row 0, three of its tokens read back
    positions, left = decoder.position.clone(), decoder._stops[0].left
    for call, what in ((decoder.burst, "burst\\(\\)"), (decoder.recover, "recover\\(\\)")):
        with pytest.raises(RuntimeError, match=f"{what} would take the rows of this decoder's server"):
            call()
    assert torch.equal(decoder.position, positions) and decoder._stops[0].left == left, "a refused burst ran"
    while not server.idle:
        ended.update(server.step().finished)
    alone = decoder.generate_batch([Request(prompt, 8), Request([1], 0)])[0]
    assert ended[ident].tokens == alone and len(alone) == 8, "the server's request lost a burst's tokens"
    assert decoder.burst().tokens == [[], []] and decoder.recover() is None  # idle: the engine's rows again

    steps = []
    speculative = stand_in_speculative(monkeypatch, steps)
    server = speculative.server()  # which parks every row
    ident = server.submit(Request(prompt, 4))  # queued: in flight, its row not yet taken
    parked = list(speculative.bufs.calls)
    for call, what in ((server.decoder.burst, "burst\\(\\)"), (server.decoder.recover, "recover\\(\\)"),
                       (lambda: server.decoder.park([0]), "park\\(\\)")):
        with pytest.raises(RuntimeError, match=f"{what} would take the rows of this decoder's server"):
            call()
    assert steps == [] and speculative.bufs.calls == parked
    assert server.step().finished[ident].tokens == [3] and steps == [Mode.GRAPH]  # its own step's burst
    assert server.decoder.burst().tokens == [[3], []] and server.decoder.recover() is None  # idle
    server.decoder.park([0])


def test_the_plain_loops_capture_is_refused_while_a_server_holds_the_rows(monkeypatch):
    """GraphedGreedy.capture() starts every row (a prompt of two tokens each) and runs a warm-up
    burst before it captures: called while a Server made directly over the loop (its bursts run
    eagerly until a graph is captured) had a request running, it started that request's row
    again, and the request went on from the warm-up's tokens, silently. It is a RuntimeError
    naming it now, before any row is touched (Driven.take), as a new server and generate_batch
    are; the server's request ends as its own (the host side over a real stack on the CPU)."""
    from memra_cuda.rounds import Server
    from memra_cuda.torch import Request
    decoder = plain_loop(monkeypatch)
    decoder.eager = False  # a graph to capture, none captured yet: the bursts run eagerly meanwhile
    server = Server(decoder)
    ident = server.submit(Request([5, 17, 3, 40, 8], 8))
    ended = dict(server.step().finished)
    lengths, positions = decoder.stack.kv.lengths.clone(), decoder.position.clone()
    with pytest.raises(RuntimeError, match="capture\\(\\) would take the rows of this decoder's server"):
        decoder.capture()
    assert torch.equal(decoder.stack.kv.lengths, lengths) and torch.equal(decoder.position, positions)
    while not server.idle:
        ended.update(server.step().finished)
    decoder.eager = True  # the reference: the same decoding, in a batch of its own
    assert ended[ident].tokens == decoder.generate_batch([Request([5, 17, 3, 40, 8], 8), Request([1], 0)])[0]


def test_a_speculative_decoders_capture_is_refused_while_a_server_holds_the_rows(monkeypatch):
    """RoundDecoder.capture() had no Driven.take where GraphedGreedy's had: called by the engine
    while the decoder's server had a request in flight, it went on to capture (a prefill graph's
    warm-up writes into the last prefilled row, a capture synchronises the device mid-serving).
    It is a RuntimeError naming it now, before anything is captured (the host side alone)."""
    from memra_cuda.torch import Request
    steps, captured = [], []
    speculative = stand_in_speculative(monkeypatch, steps)
    server = speculative.server()
    speculative.target.capture_prefills = lambda: captured.append("target")
    ident = server.submit(Request([5, 17, 3], 4))
    with pytest.raises(RuntimeError, match="capture\\(\\) would take the rows of this decoder's server"):
        speculative.capture(("graph",))
    assert captured == [] and steps == []
    assert server.step().finished[ident].tokens == [3]


def test_a_batch_refuses_a_request_past_the_caches_room_before_anything_runs():
    """RoundDecoder.generate_batch refused a malformed request up front but not one past the
    caches' room: a burst's capacity check raised CapacityError mid-generation, every row's tokens
    lost. Now each request is measured as a server measures it (room: kv_capacity of the rounds'
    geometry, a burst of the mode's rounds, one more in flight for "overlap"), the first too large
    refused naming its row, at the limit taken (the host side alone: stand-in rounds and caches,
    Driven.take recording that nothing started)."""
    from types import SimpleNamespace

    from memra_cuda import Geometry, kv_capacity
    from memra_cuda.rounds.serving import RequestRefused
    from memra_cuda.rounds.stream import Mode
    from memra_cuda.torch import Request
    from memra_cuda.torch.decoder import RoundDecoder
    geometry = Geometry(k=4, m_rounds=8, batch=2)
    fits = kv_capacity(5, 40, geometry)  # a prompt of 5 and 40 new tokens, a burst of M rounds
    decoder = object.__new__(RoundDecoder)
    decoder.vocab, decoder.batch, decoder.k = VOCAB, 2, 4
    decoder.rounds = SimpleNamespace(round=SimpleNamespace(capacity=SimpleNamespace(geometry=geometry)),
                                     rounds_per_step=lambda mode: 1 if mode.value == "readback" else 8)
    decoder.target = SimpleNamespace(kv=SimpleNamespace(capacity=fits))
    started = []
    decoder.driven = SimpleNamespace(take=started.append)
    prompt = [1, 2, 3, 4, 5]
    for requests, mode, named in (([Request(prompt, 40), Request(prompt, 41)], "graph", "request 1 refused: 5 "
                                   f"prompt tokens and 41 new need a KV cache of {kv_capacity(5, 41, geometry)} "
                                   f"entries in graph mode; these hold {fits}"),
                                  ([Request(prompt, 40), Request([1], 0)], "overlap", "request 0 refused: .* in "
                                   "overlap mode")):
        with pytest.raises(RequestRefused, match=named):
            decoder.generate_batch(requests, mode)
        assert started == []
    assert decoder.room(Request(prompt, 40), Mode.GRAPH) is None  # at the limit
    one_round = max(new for new in range(40, 200) if kv_capacity(5, new, geometry.with_rounds(1)) <= fits)
    assert one_round > 40 and decoder.room(Request(prompt, one_round), Mode.READBACK) is None  # a burst reaches less
    assert decoder.room(Request(prompt, one_round + 1), Mode.READBACK) is not None


def test_a_one_row_prefill_replays_the_graph_of_its_power_of_two_two_the_least():
    """A prompt of one token shares the bucket of two (a width of one would compile a step of its
    own: torch.compile specialises a size of one); the capacity is the last bucket."""
    from memra_cuda.torch.prefill import bucket
    assert [bucket(length, 640) for length in (1, 2, 3, 4, 5, 129, 512, 513, 640)] == \
        [2, 2, 4, 4, 8, 256, 512, 640, 640]
    assert bucket(1, 1) == 1, "a cache of one slot: its one bucket"


def test_a_buffer_read_as_bfloat16_says_how():
    """torch makes no tensor of bfloat16 from a __cuda_array_interface__, so tensor(buf,
    torch.bfloat16) is refused before any device work; the refusal names the way (a 2-byte int
    tensor, then .view(torch.bfloat16)), where it said the 2-byte buffer's 'elements of 2 bytes'
    could not be read as a 2-byte type. A size that differs is refused by its size, as before."""
    from memra_cuda import DeviceBuffer
    from memra_cuda.torch import tensor
    halves = DeviceBuffer.wrap(0x1000, np.int16, 4)
    with pytest.raises(ValueError, match=r"torch\.int16.*\.view\(torch\.bfloat16\)"):
        tensor(halves, torch.bfloat16)
    with pytest.raises(ValueError, match="cannot be read as torch.float32: elements of 2 bytes"):
        tensor(halves, torch.float32)


def test_a_tensor_is_made_of_a_device_buffer_read_as_a_torch_dtype():
    """tensor(buf, "int16") met a bare AttributeError, np.int16 a ValueError of its size, and a
    numpy array torch's device() TypeError: each is refused by name, before any device work."""
    from memra_cuda import DeviceBuffer
    from memra_cuda.torch import tensor
    halves = DeviceBuffer.wrap(0x1000, np.int16, 4)
    for dtype in ("int16", np.int16, np.dtype(np.int16)):
        with pytest.raises(TypeError, match=re.escape(f"tensor's dtype is a torch.dtype (torch.int32, say) or None, "
                                                      f"not {dtype!r}")):
            tensor(halves, dtype)  # type: ignore[arg-type]
    for buf, named in ((np.zeros(3), re.escape("array([0., 0., 0.])")), (torch.zeros(3), "tensor"), (None, "None")):
        with pytest.raises(TypeError, match=f"tensor's buf is a memra_cuda DeviceBuffer, not {named}"):
            tensor(buf)  # type: ignore[arg-type]


def test_round_and_tree_views_are_made_of_their_buffers_alone():
    """RoundViews(None) met an AttributeError ('NoneType' object has no attribute 'batch'), and a
    TreeBufs given for the StreamBufs (or the other way round) another, naming no argument: each
    is a TypeError naming it, before any tensor is made."""
    from memra_cuda import DeviceBuffer
    from memra_cuda.torch import RoundViews, TreeViews
    for given, named in ((None, "None"), ("bufs", "'bufs'"), (DeviceBuffer.wrap(0x1000, np.uint32, 4), "DeviceBuffer")):
        with pytest.raises(TypeError, match=f"^RoundViews' bufs must be a StreamBufs, not {named}"):
            RoundViews(given)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=f"^TreeViews' tree_bufs must be a TreeBufs, not {named}"):
            TreeViews(given)  # type: ignore[arg-type]


def test_a_torch_bool_is_no_budget_token_id_or_top_k():
    """torch.tensor(True)'s __index__ gives 1: it was a budget, a seed, an EOS or a prompt's token of
    1, request 1 to cancel, and a top_k of 1, where True itself is refused (TypeError) as each."""
    from memra_cuda.rounds import Request, Server
    from stand_in import Counting
    true = torch.tensor(True)
    server = Server(Counting(1))
    for request in (Request([1], true), Request([1], 3, seed=true), Request([1], 3, eos=true),
                    Request([true, 5], 3), Request([1], 3, max_draft=true)):
        with pytest.raises(RequestRefused, match="tensor\\(True\\)"):
            server.submit(request)
    server.submit(Request([1], 3))
    second = server.submit(Request([2], 3))
    with pytest.raises(TypeError, match="a request's id must be an integer, not tensor\\(True\\)"):
        server.cancel(true)
    with pytest.raises(TypeError, match="top_k"):
        SamplingParams(top_k=true)
    assert server.cancel(torch.tensor(second)) and list(server.step().finished) == [second], \
        "a torch integer is an id"


def _family(name: str):
    """A tiny random model of transformers' family `name` (its Config and ForCausalLM classes), two
    layers, grouped KV heads."""
    import transformers
    config = getattr(transformers, f"{name}Config")(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)  # Phi-3's defaults name token 32000, past this vocabulary
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, f"{name}ForCausalLM")(config).eval().requires_grad_(False)


@pytest.mark.parametrize("name", ["Mistral", "Qwen2", "Qwen3", "Olmo2", "Phi3", "Mixtral"])
def test_a_family_whose_forward_is_its_parts_gives_hugging_faces_logits(name):
    """Llama's kin that Stack runs (Llama's: above), each against Hugging Face's own forward."""
    model = _family(name)
    rows_give_hugging_faces_logits(model, Stack(model, CAPACITY, batch=3))


@pytest.mark.parametrize("name, extra", [("Granite", dict(embedding_multiplier=12.0, logits_scaling=8.0)),
                                         ("Cohere", dict(logit_scale=0.0625)), ("Gemma", {}),
                                         ("Llama", dict(final_logit_softcapping=30.0))])
def test_a_model_that_scales_outside_its_layers_is_refused_by_every_stack(name, extra):
    """Granite, Cohere and Gemma have every part Stack calls, and their forward scales or caps
    around them (an embedding multiplier or normaliser, a logit scale): Stack ran them without,
    their logits wrong, silently, and a decoder (stack_for falls back to Stack where the compiled
    step refuses a model type) decoded them so. A config of another family with such a field too."""
    model = _family(name)
    for key, value in extra.items():
        setattr(model.config, key, value)
    kind = model.config.model_type
    with pytest.raises(TypeError, match=f"a {kind!r} model scales or caps outside its layers"):
        Stack(model, CAPACITY)
    with pytest.raises(TypeError, match="scales or caps outside its layers"):
        stack_for(model, CAPACITY)


@pytest.mark.parametrize("rope", [dict(rope_type="dynamic", factor=2.0),
                                  dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[4.0] * 8)],
                         ids=["dynamic", "longrope"])
def test_a_rotary_embedding_that_follows_the_length_is_refused_past_its_trained_length(rope):
    """A dynamic or LongRoPE rotary embedding is its trained one up to its original length and
    another past it (transformers recomputes it from the sequence's length); computed once over
    a longer cache, a short sequence got a long one's (most logits differ), silently. Up to that
    length, at the limit, it is the model's own."""
    import transformers
    name = "Phi3" if rope["rope_type"] == "longrope" else "Llama"
    config = getattr(transformers, f"{name}Config")(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64 if name == "Llama" else 256, rope_scaling=rope,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **({} if name == "Llama" else dict(
            original_max_position_embeddings=64)))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval().requires_grad_(False)
    with pytest.raises(ValueError, match="changes with the sequence's length past 64 positions.* at most 64"):
        Stack(model, 80)
    rows_give_hugging_faces_logits(model, Stack(model, 64, batch=3))


@pytest.mark.parametrize("kind", ["modules", "compiled step"])
def test_a_garbage_token_is_clamped_into_the_vocabulary(kind):
    """A token past the vocabulary or below 0 reached the embedding lookup: an IndexError on a CPU,
    a device-side assert on a GPU (the context lost). Clamped in the step, as a garbage position is
    (a decoder's tokens are its own; a prompt is refused at its admission)."""
    from memra_cuda.torch.compiled import CompiledStack
    model = tiny()
    stacks = [(Stack if kind == "modules" else functools.partial(CompiledStack, compile=False))(model, 16)
              for _ in range(2)]
    got = stacks[0].logits(torch.tensor([[VOCAB + 5, -3]]), torch.tensor([[0, 1]]))
    torch.testing.assert_close(got, stacks[1].logits(torch.tensor([[VOCAB - 1, 0]]), torch.tensor([[0, 1]])))


def test_append_refuses_rows_it_was_not_given_before_writing_any():
    """Stack.append's tokens are the batch's rows, or as many as `rows` names, and its mask, lengths
    and parents are those rows': one row given for two was written into every row's K and V before
    a shape error, float tokens were truncated."""
    stack = Stack(tiny(), 16, batch=2)
    with pytest.raises(ValueError, match="append takes \\[R\\]\\[T\\] tokens, positions and slots, T >= 1, "
                                         "R the batch's 2"):
        stack.append(torch.tensor([[3]]), torch.tensor([[0]]))
    with pytest.raises(ValueError, match="not tokens \\[2, 0\\]"):
        stack.append(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="rows \\[3\\]"):
        stack.append(torch.tensor([[3]] * 3), torch.tensor([[0]] * 3), torch.tensor([0, 1, 1]))
    with pytest.raises(TypeError, match="append's tokens are an integer tensor, not torch.float32"):
        stack.append(torch.tensor([[3.0], [4.0]]), torch.tensor([[0], [0]]))
    with pytest.raises(ValueError, match="append's rows are on meta, not the stack's device, cpu"):
        stack.append(torch.tensor([[3]]), torch.tensor([[0]]), torch.tensor([1], device="meta"))
    one, zero, row = torch.tensor([[3]]), torch.tensor([[0]]), torch.tensor([1])
    seen = torch.ones(1, 1, 1, 16, dtype=torch.bool)  # [R][1][T][capacity], R = 1: the row named
    # a mask, lengths or parents of the batch's rows where `rows` names one (or of the wrong dtype)
    with pytest.raises(ValueError, match=re.escape("a forward's mask is [R][1][T][capacity], [1, 1, 1, 16]: "
                                                   "not [2, 1, 1, 16]")):
        stack.append(one, zero, row, mask=seen.expand(2, 1, 1, 16))
    with pytest.raises(ValueError, match=re.escape("rows [1], lengths [2]")):
        stack.append(one, zero, row, torch.tensor([1, 1]))
    with pytest.raises(TypeError, match="append's lengths are an integer tensor, not torch.float32"):
        stack.append(one, zero, row, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="append's parents are on meta, not the stack's device, cpu"):
        stack.append(one, zero, row, parents=torch.tensor([[0]], device="meta"))
    with pytest.raises(TypeError, match="append's parents are an integer tensor, not torch.float32"):
        stack.append(one, zero, row, parents=torch.tensor([[0.0]]))
    with pytest.raises(ValueError, match=re.escape("not tokens [2, 1], positions [2, 1], parents [1, 1]")):
        stack.logits(torch.tensor([[3], [4]]), torch.tensor([[0], [0]]), parents=one)  # a forward's parents too
    assert stack.kv.lengths.tolist() == [[0, 0]] * len(stack.kv.lengths) and not stack.kv.k[0].any()
    stack.append(one, zero, row, torch.tensor([1]), mask=seen, parents=torch.tensor([[0]]))  # one row, named


class _NoStream(Exception):
    """What a test's torch.cuda.Stream raises: the decoder got as far as making its stream."""


def stop_at_the_stream(monkeypatch) -> None:
    """torch.cuda.Stream raises _NoStream, on what is said to be a GPU's machine: a decoder whose
    checks all pass gets as far as its stream (decoder_stream), the first device work."""

    def no_stream(*args, **kwargs):
        raise _NoStream

    monkeypatch.setattr(torch.cuda, "Stream", no_stream)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_the_decoders_check_every_option_before_their_stream(monkeypatch):
    """An option a decoder cannot serve is refused before its stream, engine or stacks are made:
    a flag not a bool, an on_engine not a function, widths not a collection (or endless), a page
    (past the cache too), a sampled tree's draws, a plain loop's capacity, batch (past MAX_BATCH)
    and attention (each was found after the stream, some after both models' stacks); and a cache
    that cannot take one round, at the limit (found at the warm-up, after both models compiled, as
    a "next burst"). Where all is well, the decoder gets as far as its stream."""
    from memra_cuda.errors import CapacityError
    from memra_cuda.torch import GraphedGreedy

    stop_at_the_stream(monkeypatch)
    model = tiny()
    draft = self_draft(model)
    cases = [
        (lambda: SpeculativeLlama(model, draft, compiled="yes"), TypeError, "compiled must be None or True or False"),
        (lambda: SpeculativeLlama(model, draft, on_engine=5), TypeError, "on_engine is a function"),
        # a dict's keys were taken as widths, an int's refusal named no argument
        (lambda: SpeculativeLlama(model, draft, widths={2: 1.3}), TypeError, "widths must be a collection of ints"),
        (lambda: SpeculativeLlama(model, draft, widths=2), TypeError, "widths must be a collection of ints"),
        (lambda: TreeLlama(model, draft, TREE, paged=0), ValueError, "paged must be an int from 1 to 1024, not 0"),
        # past the caches' slots a row (a capacity of 1000 is 1024, whole blocks): allocated whole, after the stream
        (lambda: TreeLlama(model, draft, TREE, capacity=1000, paged=1025), ValueError,
         "paged must be an int from 1 to 1024, not 1025"),
        (lambda: TreeLlama(model, draft, TreeShape.from_choices([[0], [2]]), sampling=SamplingParams()), ValueError,
         "a sampled tree's children are their parent's first draws"),
        (lambda: GraphedGreedy(model, 0), ValueError, "capacity must be a Room or an int from 1 to 2147483520"),
        (lambda: GraphedGreedy(model, 64, compiled="no"), TypeError, "compiled must be None or True or False"),
        # a batch past MAX_BATCH and an attention of no name were refused by its cache and its compiled step
        (lambda: GraphedGreedy(model, 64, batch=65536), ValueError, "batch must be an int from 1 to 65535, not 65536"),
        (lambda: GraphedGreedy(model, 64, attention="flash"), ValueError, "attention is one of \\('flex', 'sdpa'\\)"),
        (lambda: GraphedGreedy(model, 64, attention=np.array("flex")), ValueError, "attention is one of"),
        # read for ever, Ctrl-C unheard
        (lambda: SpeculativeLlama(model, draft, widths=itertools.repeat(1)), ValueError,
         "widths name at most k \\+ 2 = 6 widths"),
        (lambda: SpeculativeLlama(model, draft, k=254, capacity=255 - 128), CapacityError,
         "a cache of 128 slots a row \\(whole blocks\\) cannot take one round of 255 tokens a row at k = 254, "
         "B = 1: it needs 256"),
        (lambda: SpeculativeLlama(model, draft, k=255, capacity=256), CapacityError, "at k = 255, B = 1: it needs 257"),
        (lambda: SpeculativeLlama(model, draft, k=127, batch=2, capacity=256), CapacityError,
         "at k = 127, B = 2: it needs 257"),  # a row of a batch may move k + 1 more before it sits a round out
    ]
    for make, error, message in cases:
        with pytest.raises(error, match=message):
            make()
    for make in (lambda: SpeculativeLlama(model, draft, k=254, capacity=256),
                 lambda: SpeculativeLlama(model, draft, k=126, batch=2, capacity=256), lambda: GraphedGreedy(model, 64),
                 lambda: GraphedGreedy(model, 64, batch=65535, attention="sdpa"),
                 lambda: TreeLlama(model, draft, TREE, paged=16),
                 lambda: TreeLlama(model, draft, TREE, capacity=1000, paged=1024)):
        with pytest.raises(_NoStream):
            make()


def test_a_layout_that_makes_no_cache_or_state_is_refused_where_it_is_given(monkeypatch):
    """Stack(cache="paged") or a StaticKV made already met "'str' object is not callable" (a
    RoundDecoder's after its stream and engine were made), and Stack(state="copy") over a model
    without recurrent layers was taken, silently (it met the same TypeError only on a hybrid one):
    each a TypeError naming the argument now, a decoder's before its stream."""
    from memra_cuda.torch import RoundDecoder
    from memra_cuda import Geometry
    model = tiny()
    for given in ("paged", StaticKV(model.config, 3, 1, 16, torch.float32, "cpu")):
        with pytest.raises(TypeError, match=re.escape(f"cache is a cache layout (StaticKV, PagedKV, or a function "
                                                      f"making one as they are called), not {given!r}")):
            Stack(model, 16, cache=given)
    with pytest.raises(TypeError, match=re.escape("state is a state layout (LiveState, CopyState, FlipState, or a "
                                                  "function making one as they are called), not 'copy'")):
        Stack(model, 16, state="copy")
    stop_at_the_stream(monkeypatch)
    with pytest.raises(TypeError, match="cache is a cache layout"):
        RoundDecoder(model, self_draft(model), Geometry(4, 8), capacity=64, sampling=None, draft_sampling=None,
                     state_rollback="copy", cache="paged")
    assert Stack(model, 16, cache=PagedKV, state=CopyState).kv.capacity == 16  # the layouts themselves: taken


def test_a_cache_of_a_dtype_no_model_runs_in_is_refused_as_it_is_made():
    """StaticKV(..., torch.int32) (PagedKV's too) made a cache of ints, into which a forward wrote
    its K and V truncated, silently; a name met torch's zeros() error. A TypeError naming dtype now,
    as TreeMask's; the model's float dtypes taken."""
    model = tiny()
    for layout in (StaticKV, PagedKV):
        for dtype in (torch.int32, torch.bool, "float16"):
            with pytest.raises(TypeError, match=re.escape(f"{layout.__name__}'s dtype is a floating-point torch.dtype "
                                                          f"of 2 bytes or more (the model's), not {dtype!r}")):
                layout(model.config, 1, 1, 16, dtype, "cpu")
        assert layout(model.config, 1, 1, 16, torch.bfloat16, "cpu").k[0].dtype == torch.bfloat16


def test_a_causal_lm_of_another_shape_is_refused_by_name():
    """OPT (its layers under .model.decoder) passed the decoders' first check and met an
    AttributeError after their stream; GPT-2's config (no num_key_value_heads) met a bare
    AttributeError in the compiled step before its model type was looked at."""
    import transformers
    from memra_cuda.torch.compiled import CompiledStack
    from memra_cuda.torch.decoder import refuse
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=1, num_attention_heads=4,
        word_embed_proj_dim=64, pad_token_id=1, bos_token_id=2, eos_token_id=2))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=VOCAB,
                                                                bos_token_id=0, eos_token_id=0))
    with pytest.raises(TypeError, match="the model is a transformers causal LM .* not OPTForCausalLM$"):
        refuse(opt, opt, "copy")
    with pytest.raises(NotFused, match="the compiled step runs llama, mistral, qwen2 models, not 'gpt2'"):
        CompiledStack(gpt2, 48, compile=False)
    for model in (opt, gpt2):
        with pytest.raises(TypeError, match=f"{type(model).__name__} has no model.embed_tokens"):
            stack_for(model, 48)


def test_a_capacity_is_checked_before_a_sliding_window_is_compared_with_it():
    """Stack(windowed, "64") met "'>' not supported" comparing it with the window."""
    config = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=32)
    windowed = MistralForCausalLM(config).eval()
    for capacity, error in (("64", TypeError), (None, TypeError), (0, ValueError)):
        with pytest.raises(error, match="capacity must be an int"):
            Stack(windowed, capacity)  # type: ignore[arg-type]
    Stack(windowed, 32)  # at the window


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a CUDA GPU here: nothing to refuse")
def test_without_a_gpu_torchs_layer_raises_cuda_unavailable_naming_the_call():
    """On a machine where torch sees no GPU, memra_cuda.torch's engine() and build_model() met torch's
    AssertionError ("Torch not compiled with CUDA enabled") and a decoder torch's RuntimeError
    from inside its stream: the CudaUnavailable the rest of the package raises for a missing
    GPU, which docs/errors.md promises, is raised instead, before anything is built."""
    from memra_cuda.errors import CudaUnavailable
    from memra_cuda.torch import GraphedGreedy, engine
    with pytest.raises(CudaUnavailable, match=r"memra_cuda.torch.engine\(\) needs a CUDA GPU") as raised:
        engine()
    assert raised.value.call == "torch.cuda.is_available" and raised.value.name == "CUDA_UNAVAILABLE"
    with pytest.raises(CudaUnavailable, match="a decoder needs a CUDA GPU"):
        GraphedGreedy(tiny(), 64)
    with pytest.raises(CudaUnavailable, match="a decoder needs a CUDA GPU"):
        SpeculativeLlama(tiny(), tiny(1, seed=1), k=2, m_rounds=4, capacity=64)
    # build_model's default device is the GPU: torch's AssertionError came from inside the model's construction
    from memra_cuda.torch.testing import build_model
    with pytest.raises(CudaUnavailable, match=r"^build_model\(device='cuda'\) needs a CUDA GPU.*: device='cpu' builds"):
        build_model()


def test_capture_takes_one_mode_or_a_list_of_at_least_one_and_refuses_the_rest_before_any_capture():
    """capture(None) met "'NoneType' object is not iterable", capture(b"graph") a mode 103, and
    capture(()) captured graph mode's graphs and sealed the rounds, every other mode refused from
    then on: each is refused now, naming capture()'s modes, before anything is captured (the
    decoder's host side: stand-ins that count the captures). A set of modes is taken as before."""
    from memra_cuda.rounds.serving import Driven
    from memra_cuda.torch.decoder import RoundDecoder
    captured = []
    decoder = object.__new__(RoundDecoder)
    decoder.stream, decoder.shared, decoder.driven, decoder.setup_seconds = None, True, Driven(), 0.0
    decoder.target = SimpleNamespace(capture_prefills=lambda: captured.append("prefills"))
    decoder.rounds = SimpleNamespace(capture_graphs=lambda slots, seal: captured.append(slots))
    for modes, error, said in ((None, TypeError, "capture()'s modes must be a list, a tuple or a 1-D array of mode"),
                               (b"graph", TypeError, "capture()'s modes must be a list"),
                               ((m for m in ["graph"]), TypeError, "capture()'s modes must be a list"),
                               (set(), ValueError, "capture() takes at least one mode"),
                               ((), ValueError, "capture() takes at least one mode of readback, eager, graph, "
                                                "overlap, device, not none"),
                               (["graph", "graf"], ValueError, "mode must be one of")):
        with pytest.raises(error, match=re.escape(said)):
            decoder.capture(modes)
    assert not captured, "a refused capture() captured"
    decoder.capture("overlap")
    decoder.capture(["graph"])
    decoder.capture({"overlap", "graph"})  # a set: its order is no matter
    assert captured == ["prefills", (0, 1), "prefills", (0,), "prefills", (0, 1)]
