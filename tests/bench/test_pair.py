"""benchmarks/pair.py's corpus and held-out scoring, without a GPU: a file's bytes counted once (a
vendored copy held out would be no held-out text), the corpus's make-up and the held-out loss by
package, and windows spread over the whole held-out stream rather than its first, alphabetical,
tokens. pair.py imports torch, transformers and tokenizers as it loads: skipped without them."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

for _name in ("torch", "transformers", "tokenizers"):
    pytest.importorskip(_name, reason="benchmarks/pair.py trains with torch, transformers and tokenizers")
import torch  # noqa: E402

from benchmarks.pair import Doc, by_package, heldout_losses, make_up, package, read_docs  # noqa: E402


def doc(rel: str, text: str) -> Doc:
    return Doc(rel, text, hashlib.sha256(text.encode()).hexdigest(), len(text))


def test_a_file_is_counted_under_its_top_level_package_and_the_stdlib_whole():
    assert package("purelib/torch/nn/modules/linear.py") == "torch"
    assert package("purelib/six.py") == "six"
    assert package("stdlib/json/decoder.py") == package("stdlib/os.py") == "stdlib"


def test_the_make_up_ranks_packages_by_size_and_sums_the_rest():
    docs = [doc("purelib/a/x.py", "a" * 3_000_000), doc("purelib/b/y.py", "b" * 2_000_000),
            doc("stdlib/os.py", "c" * 1_000_000), doc("purelib/d.py", "d" * 500_000)]
    assert make_up(docs, top=2) == {"a": 3.0, "b": 2.0, "other": 1.5}
    assert make_up(docs) == {"a": 3.0, "b": 2.0, "stdlib": 1.0, "d": 0.5}


def test_a_files_bytes_are_read_once_the_first_path_kept(tmp_path):
    for rel, text in [("a/x.py", "same\n"), ("b/x.py", "same\n"), ("c/y.py", "other\n"), ("d/z.py", "  \n")]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    files = [(f"purelib/{rel}", tmp_path / rel) for rel in ("a/x.py", "b/x.py", "c/y.py", "d/z.py")]
    assert [d.rel for d in read_docs(files, max_files=0)] == ["purelib/a/x.py", "purelib/c/y.py"]


class Echo(torch.nn.Module):
    """A 'model' whose logits put all mass on the token it reads: its loss at a position is 0 where
    the stream repeats its previous token and large elsewhere, so a test can tell which tokens a
    window scored."""

    def forward(self, input_ids):
        return type("Out", (), {"logits": torch.nn.functional.one_hot(input_ids, 4).float() * 50})()


def test_the_held_out_windows_cover_the_whole_stream_and_the_loss_falls_to_each_files_package():
    docs = [doc("purelib/easy/a.py", "a"), doc("purelib/hard/b.py", "b")]
    easy, hard = [1] * 200, [1, 2, 3] * 66 + [1, 2]  # Echo is right on every token of easy, on none of hard
    data, doc_starts = torch.tensor(easy + hard), np.array([0, 200])
    losses, starts = heldout_losses(Echo(), data, seq_len=16, tokens=160)
    assert losses.shape == (10, 16) and starts[0] == 0 and starts[-1] == len(data) - 1 - 16  # first to last
    assert np.all(np.diff(starts) > 16)  # spread over the stream, not its first 160 tokens
    groups = by_package(losses, starts, doc_starts, docs)
    assert set(groups) == {"easy", "hard"} and sum(n for n, _ in groups.values()) == losses.size
    assert groups["easy"][1] < 0.01 < 10 < groups["hard"][1]
    assert by_package(losses, starts, doc_starts, docs, top=1).keys() == {max(groups, key=lambda g: groups[g][0]),
                                                                          "other"}
