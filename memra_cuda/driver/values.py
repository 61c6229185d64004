"""Host values checked before they reach the driver: element types device memory can hold, and
integers and arrays converted exactly (a float, an out-of-range or a wrapped value is refused,
never truncated), so a wrong argument is an exception here rather than a kernel reading past
its buffer."""
from __future__ import annotations

import operator
import reprlib
import sys
from collections import UserString
from collections.abc import Mapping, Sequence, Set
from numbers import Real
from typing import Any

import numpy as np


I32_MOST = 2**31 - 1  # an i32's most: a row's word on the device (a token id, a budget, a position)
U64_MOST = 2**64 - 1  # a u64's most: a table's word (an address, a stride)

# text and bytes, whose items are characters or bytes, never token ids: refused as prompts alike (a
# bytearray or a memoryview was read as its bytes' ints where bytes was refused; a UserString, a
# Sequence numpy reads by its characters, an empty one a ValueError, where "" was a TypeError)
TEXT_LIKE = (str, UserString, bytes, bytearray, memoryview)


def device_dtype(dtype: Any) -> np.dtype:
    """`dtype` if device memory can hold it: bool, integers and floats of 1 to 8 bytes, in the
    machine's byte order (objects, strings and complex numbers have no meaning there)."""
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"{dtype!r} is not a dtype") from exc
    if dt.kind not in "biuf" or dt.itemsize not in (1, 2, 4, 8) or not dt.isnative:
        raise ValueError(f"{dt} cannot be the element type of device memory: use a bool, an integer or a "
                         "float of 1, 2, 4 or 8 bytes in native byte order")
    return dt


def short_name(dtype: np.dtype) -> str:
    """u32, i64, f16, bool: how docs/README.md ("Notation") writes element types."""
    return "bool" if dtype.kind == "b" else f"{dtype.kind}{8 * dtype.itemsize}"


def exact_int(value: Any, dtype: Any) -> int:
    """`value` as a Python int that `dtype` holds exactly: floats and out-of-range values are
    refused instead of being truncated or wrapped (whatever numpy's casting rules), and a bool
    is no integer here (TypeError: True would be stored as 1, as np.True_ never was)."""
    dtype = np.dtype(dtype)
    if isinstance(value, (float, np.floating)):
        raise ValueError(f"{value!r} is not an integer ({dtype.name} expected)")
    if is_bool(value):
        raise TypeError(f"{value!r} is a bool, not an integer ({dtype.name} expected)")
    number = as_index(value, f"a {dtype.name} value")
    info = np.iinfo(dtype)
    if not info.min <= number <= info.max:
        raise ValueError(f"{value!r} is outside the range of {dtype.name}")
    return number


def is_bool(value: Any) -> bool:
    """Whether `value` is a bool: Python's, numpy's, or an array library's scalar or array of a
    bool dtype (torch.tensor(True), whose __index__ gives 1, so that as an id, a budget or a
    token it was read as 1, as True was before it was refused). An int is answered by its type
    alone: torch.compile traces these checks where a size is symbolic (memra_cuda.torch.skinny's
    Tiles of a weight's shape), and cannot trace looking for a dtype on one. A dtype is a bool's
    where its name holds "bool": torch's "torch.bool", pandas' "boolean", TensorFlow's
    "<dtype: 'bool'>"."""
    if isinstance(value, (bool, np.bool_)):
        return True
    return not isinstance(value, (int, np.integer)) and "bool" in str(getattr(value, "dtype", ""))


# types no bool hides in (bool and numpy's bool_ are types of their own): Python's numbers and numpy's
# integer and float scalars, a list's members where it came from an array's iteration
_PLAIN_NUMBERS = frozenset((int, float, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                            np.uint64, np.float16, np.float32, np.float64))


def hides_bools(values: Any) -> bool:
    """Whether a list or a tuple holds a bool among its numbers, in a nested list or tuple or as
    a bool array in it too, which numpy then reads as an int (np.asarray([True, 5]), [[True, 5]]
    and [np.array([1]), np.array([True])] are int64): the one place a bool slips past a dtype's
    kind. A list of plain numbers alone (Python's or numpy's ints and floats), a prompt's, is
    answered by its members' types (a set of them: 128 tokens in ~3 us, where the walk below took
    ~60 us, and every prompt a decoder takes is checked so, once, where it enters: a Server's
    submit, a decoder's prefill, admit or batch)."""
    if not isinstance(values, (list, tuple)):
        return False
    if set(map(type, values)) <= _PLAIN_NUMBERS:  # numbers exactly: no bool, no container, no array
        return False
    for v in values:
        if isinstance(v, np.ndarray):
            if v.dtype.kind == "b":
                return True
        elif hides_bools(v) or is_bool(v):
            return True
    return False


def _inexact(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`arr` (numbers) as a float or bool `dtype`, refused (ValueError) where a value changes by
    more than a float's rounding: see exact_array."""
    with np.errstate(all="ignore"):  # an overflow is what is looked for, not a warning
        out = arr.astype(dtype)
        if dtype.kind == "b":
            changed = arr.dtype.kind != "b" and bool(((arr != 0) & (arr != 1)).any())
        elif arr.dtype.kind in "iu":
            changed = bool(not np.isfinite(out).all() or (out.astype(arr.dtype) != arr).any())
        else:
            changed = bool((np.isfinite(arr) & ~np.isfinite(out)).any())
    if changed:
        raise ValueError(f"{dtype.name} cannot hold {reprlib.repr(arr.tolist())} as given")
    return out


def host_array(values: Any, what: str = "values are numbers") -> np.ndarray:
    """`values` as numpy reads them (an ndarray as it is), a ragged list or tuple refused: a
    ValueError saying what they are (`what`) and naming them, where numpy's own ("setting an
    array element with a sequence ... inhomogeneous shape") named nothing. What exact_array
    converts, Engine.htod reads its dtype from where none is given, and Philox's words read."""
    if isinstance(values, np.ndarray):
        return values
    try:
        return np.asarray(values)
    except ValueError:  # numpy's "setting an array element with a sequence ... inhomogeneous shape"
        if not isinstance(values, (list, tuple)):
            raise
        raise ValueError(f"{what}, or lists of them of one shape (each row as long as the others): not a ragged "
                         f"list, {reprlib.repr(values)}") from None


def exact_array(values: Any, dtype: Any) -> np.ndarray:
    """`values` as a flat `dtype` array, refusing any value the conversion would change and
    anything that is not numbers (objects, strings, complex), and bools for an integer dtype
    (TypeError, as exact_int: True would be stored as 1, a token, a position or a row). For a
    float buffer, a float rounded to its precision is the one change taken: a finite value that
    would overflow to inf, or an int it cannot hold exactly (2**24 + 1 in float32), is refused;
    a bool buffer takes bools, 0 and 1 (0.5 and -1 were stored as True). A numpy masked array
    with any value masked is refused (ValueError): the copy reads the data under the mask; so is
    a ragged list (host_array)."""
    dtype = np.dtype(dtype)
    arr = host_array(values)
    if isinstance(arr, np.ma.MaskedArray) and (masked := int(np.ma.getmaskarray(arr).sum())):
        # the copy reads the data under the mask as it is stored: a masked token would be sent
        raise ValueError(f"a masked array with {masked} masked values: fill them (arr.filled(value)) or give the "
                         "unmasked ones (arr.compressed())")
    if dtype.kind in "iu" and (arr.dtype.kind == "b" or hides_bools(values)):
        raise TypeError(f"bools given for a {dtype.name} buffer: {reprlib.repr(values)}")
    if arr.dtype == dtype:
        return arr.reshape(-1)
    if arr.dtype.kind in "fO" and not isinstance(values, np.ndarray) and dtype.kind in "iu":
        # Python ints past int64 arrive as float64 or objects: convert them one by one, exactly.
        return np.array([exact_int(v, dtype) for v in np.array(values, dtype=object).reshape(-1)], dtype)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"{arr.dtype} values cannot be copied to device memory (numbers only)")
    if dtype.kind not in "iu":
        return _inexact(arr, dtype).reshape(-1)
    if arr.dtype.kind == "f":
        raise ValueError(f"{arr.dtype.name} values given for a {dtype.name} buffer")
    for extreme in (arr.min(), arr.max()) if arr.size else ():
        exact_int(int(extreme), dtype)
    return arr.astype(dtype).reshape(-1)


def as_index(value: Any, what: str) -> int:
    """`value` as an int (ints and numpy integers, never floats, nor a bool: True would be read
    as 1, a seed, an id or a parent of 1; nor an array library's bool, is_bool), TypeError naming
    `what`. Nor an array of one: torch's tensor([3]) gives 3 to operator.index, where numpy's
    array([3]) is refused; both are now (an int is answered by its type, as is_bool's)."""
    if is_bool(value):
        raise TypeError(f"{what} must be an integer, not {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, not {value!r}") from None
    if not isinstance(value, (int, np.integer)) and getattr(value, "ndim", 0) != 0:
        raise TypeError(f"{what} must be an integer, not an array of one: {value!r}")
    return number


def as_flag(value: Any, what: str, *, also: str = "") -> bool:
    """`value` as a bool (Python's or numpy's), else TypeError naming `what`: a switch given a
    string or a number was read by its truth, so "False" (a command line's word, a config's) turned
    a mode on. `also` names what else the caller takes ("None"), for the message."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be {f'{also} or ' if also else ''}True or False, not {value!r}")
    return bool(value)


def as_size(value: Any, what: str, least: int = 1, most: int | None = None, *, also: str = "") -> int:
    """`value` as an int from `least` to `most` (no bound: None): a size or a count the host is
    given (k, rounds, a batch, a capacity, a budget), checked where it is given, so a bad one is
    refused naming `what` rather than sizing memory or a rule wrongly. Numpy integers are sizes;
    a bool is not (True would be read as 1): TypeError, as for a float or a string; out of range,
    ValueError. `also` names the other values the caller takes ("None"), for the message."""
    number = as_index(value, what)
    if number < least or (most is not None and number > most):
        span = f"from {least} to {most}" if most is not None else f"of at least {least}"
        raise ValueError(f"{what} must be {f'{also} or ' if also else ''}an int {span}, not {value!r}")
    return number


SEED_MOST = U64_MOST  # a request's seed is the 64-bit Philox key of its draws (docs/sampling.md)


def as_seed(value: Any, what: str = "seed") -> int:
    """`value` as a request's seed, an int from 0 to SEED_MOST: the Philox key of its draws,
    `(seed & 0xffffffff, seed >> 32)`, 64 bits unsigned (docs/sampling.md), so a negative one
    names no key (-1 was taken, by a Server's submit and a decoder's prefill, as the int64 bits of
    2**64 - 1, and refused by the toy's prefill). The one check of a seed wherever one enters (a
    Server's submit, a decoder's admission and prefill, the toy's prefill): TypeError naming
    `what` unless it is an int (a bool is none: True was seed 1), ValueError outside the range."""
    seed = as_index(value, what)
    if not 0 <= seed <= SEED_MOST:
        raise ValueError(f"{what} must be an int from 0 to 2**64 - 1 (a 64-bit key), not {seed}")
    return seed


def seed_bits(seed: int) -> int:
    """A checked seed (as_seed) as the int64 of its 64 bits, for a framework without a u64
    (torch): 2**64 - 1 is -1. The kernels read an i64 seed_d as its bits (docs/kernels.md), so
    the row draws with the key of `seed` itself; seeds of 2**63 and more were refused, as past
    the int64 tensor that holds them."""
    return seed - 2**64 if seed > 2**63 - 1 else seed


def as_real(value: Any, what: str) -> float:
    """`value` as a float: TypeError naming `what` unless it is a real number (a bool is not),
    ValueError where no float holds it (an int of over 1024 bits: float() raises OverflowError;
    its repr, past 4300 digits, would raise too, so the message does not show it)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (Real, np.floating, np.integer)):
        raise TypeError(f"{what} must be a real number, not {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{what} must be a finite number, not one past a float's range") from None


# The longest wait a timeout may ask for: 2**31 - 1 ms (24.8 days), a socket's longest in one call (its
# milliseconds a C int: 4294967.396 s wrapped to a wait of 0.1 s). Past threading.TIMEOUT_MAX (an
# infinity too), a thread's join, a socket's settimeout and time.sleep raise OverflowError.
SECONDS_MOST = (2**31 - 1) / 1000


def as_seconds(value: Any, what: str) -> float:
    """`value` as a span of seconds above 0 and at most SECONDS_MOST (as_real's TypeError for what
    is no real number): ValueError naming `what` for 0, a negative or a NaN, which compares as no
    number does, so a deadline made of it was never reached and a wait with it lasted for ever,
    and for a span past SECONDS_MOST, an infinity too, which a socket's wait wrapped to a short
    one, or a thread's join met OverflowError for, once the work it bounds had begun."""
    if not 0 < as_real(value, what) <= SECONDS_MOST:
        raise ValueError(f"{what} must be a number of seconds above 0 and at most {SECONDS_MOST} (2**31 - 1 ms, "
                         f"a socket's longest wait), not {value!r}")
    return float(value)


def token_ids(values: Any, vocab: int, what: str) -> np.ndarray:
    """`values` as a copy (the caller's list or array, changed later, is not what was checked)
    of token ids below `vocab`, 1-D, maybe empty: TypeError naming `what` unless they are ints
    (floats, strings, a ragged or nested list, and bools, which a list of ints hides from numpy:
    True would be token 1), ValueError naming the first outside [0, vocab) (its embedding lookup
    would fault the device). `what` reads "{what} token 7 (at 2)": "its prompt's", "row 0's prompt".
    Text and bytes are no token ids, a UserString's, a bytearray's or a memoryview's too
    (TypeError: numpy read the last two as their bytes' ints); so is a numpy masked array, whose
    masked entries np.array read as tokens."""
    try:  # text and a masked array: refused below
        tokens = np.array(None) if isinstance(values, (*TEXT_LIKE, np.ma.MaskedArray)) else np.array(values)
    except (TypeError, ValueError):  # ragged, or not numbers at all
        tokens = np.array(None)
    if tokens.ndim == 1 and tokens.dtype.kind in "fO" and past_int64(values):
        tokens = np.array([v if 0 <= v < vocab else -1 for v in map(int, values)])  # -1: outside, as below
    if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu") or hides_bools(values):
        raise TypeError(f"{what} must be token ids (ints), not {reprlib.repr(values)}")
    outside = np.flatnonzero((tokens < 0) | (tokens >= vocab))
    if outside.size:
        at = int(outside[0])
        shown = values[at] if isinstance(values, (list, tuple)) else tokens[at]  # one past int64 is no -1
        raise ValueError(f"{what} token {shown} (at {at}) is outside the vocabulary of {vocab} tokens")
    return tokens


def past_int64(values: Any) -> bool:
    """Whether `values` is a list or tuple of integers (Python's or numpy's, no bool) that numpy
    read as objects or floats (one past int64, such as 2**64, or a uint64 beside an int): they are
    read one by one, and one outside the vocabulary is named as any other ("not token ids (ints)"
    was said of them)."""
    return isinstance(values, (list, tuple)) and all(
        isinstance(v, (int, np.integer)) and not is_bool(v) for v in values)


def longest_prompt_for(capacity: int) -> int:
    """The most tokens a prompt can have in a row whose caches hold `capacity` slots: all but its
    last fill them, and the last is pending (its entry is the next forward's). Named once, for
    as_prompt's `most` wherever a row is filled (a decoder's longest_prompt, the toy's prefills),
    so that they cannot drift apart."""
    return capacity + 1


def as_prompt(prompt: Any, vocab: int, what: str, most: int | None = None) -> np.ndarray:
    """`prompt` as token_ids' checked copy, of at least one token (its last is the pending one a
    decoding starts from): the one check of a prompt where it enters (a request's, rounds.serving;
    a decoder's prefill; the toy's prefill, its numpy loops and target_greedy). TypeError naming
    `what` ("its prompt", "row 0's prompt") for what is no sequence of ints (a generator or a bare
    numpy integer met len() deep inside: "object of type ... has no len()"; text or bytes, empty or
    not, a UserString's too, and a bytearray or a memoryview, which were read as their bytes'
    ints), ValueError for an empty sequence or a token outside [0, vocab) ("row 0's prompt's
    token 7 (at 2)"). A prompt of more than `most` tokens (None: no bound), the most a row takes
    (longest_prompt_for: its cache's slots and the pending token), is refused by its len() before
    it is read, as as_listed refuses: range(3 * 10**7) was read whole (8 s, and a tuple of its
    ints) before a decoder's room refused it."""
    if most is not None:
        _fits(prompt, what, most)
    try:
        tokens = token_ids(prompt, vocab, f"{what}'s")
    except TypeError:
        raise TypeError(_no_prompt(prompt, what)) from None
    if not tokens.size:
        raise ValueError(_no_prompt(prompt, what))
    return tokens


def _fits(prompt: Any, what: str, most: int) -> None:
    """ValueError naming `what` where `prompt`, a sequence or an array of one dimension (any
    library's: a tensor's tokens were read and made a tuple of ints as a list's), holds more than
    `most` tokens by its len(), its tokens unread; what is none is token_ids' to refuse. A len()
    past sys.maxsize (range(10**20)'s OverflowError) is past any row too. Text and bytes are not
    measured (a memoryview has a shape): token_ids refuses them, a TypeError whatever their length.
    A list or a tuple of prompts given for one (its first item itself a sequence or an array),
    too long, is refused as no prompt (as_prompt's TypeError), as a short one is, where it was
    refused as a prompt of that many tokens, each of them a prompt: a list's first item is there
    to look at, where a lazy sequence's or an array's is not read."""
    if isinstance(prompt, TEXT_LIKE):
        return
    shape = getattr(prompt, "shape", None)
    if not (isinstance(shape, tuple) and len(shape) == 1) and not isinstance(prompt, Sequence):
        return
    count = _count(prompt)
    if count is None or count > most:
        if isinstance(prompt, (list, tuple)) and _nested(prompt[0]):  # looked at only here: one that fits is not
            raise TypeError(_no_prompt(prompt, what))
        shown = f"more than {sys.maxsize} tokens" if count is None else f"{count} tokens"
        raise ValueError(f"{what} of {shown} does not fit a row (at most {most})")


def _count(values: Any) -> int | None:
    """len(values), or None past sys.maxsize (range(10**20)'s len() raises OverflowError): more
    than any bound a prompt or a list is measured against."""
    try:
        return len(values)
    except OverflowError:
        return None


def _nested(item: Any) -> bool:
    """Whether a prompt's `item` is itself a sequence or an array (of one dimension or more): a
    prompt, where a token is expected."""
    return isinstance(item, Sequence) or bool(getattr(item, "ndim", 0))


def _no_prompt(prompt: Any, what: str) -> str:
    """as_prompt's refusal of what is no prompt, made only where one is refused."""
    return f"{what} must be a sequence of at least one token id (an int), not {reprlib.repr(prompt)}"


def c_string(text: Any, what: str) -> str:
    """`text` if it is a str a C string holds whole: TypeError naming `what` for anything else (an
    int met "'int' object has no attribute 'encode'"), ValueError for a NUL, which would end the
    C string the driver or NVRTC reads early ("scale\\0x" would be "scale")."""
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str, not {reprlib.repr(text)}")
    if "\0" in text:
        raise ValueError(f"{what} holds a NUL character, which would end its C string early: {reprlib.repr(text)}")
    return text


def as_listed(values: Any, what: str, of: str, most: int | None = None) -> list[Any]:
    """`values` as a list, if it is a list, a tuple (a sequence but text or bytes) or a 1-D array:
    where the order is the meaning (a tree's nodes, a cost a width), a mapping's or a set's
    iteration gives keys or an order of its own, a string its characters and bytes their ints
    (a bytearray's, a memoryview's and a UserString's too, which were listed where str and bytes
    were refused: a bytearray of seeds or caps read as ints); anything else a TypeError naming
    `what` and what it holds (`of`). More than `most` values are refused by their count, before
    they are listed (range(10**8) took 9 s and 4 GB to be refused after), a len() past
    sys.maxsize too (range(10**20) met OverflowError, naming nothing)."""
    if not (isinstance(values, np.ndarray) and values.ndim == 1) and (
            not isinstance(values, Sequence) or isinstance(values, TEXT_LIKE)):
        raise TypeError(f"{what} must be a list, a tuple or a 1-D array of {of}, not {reprlib.repr(values)}")
    if most is not None:
        count = _count(values)
        if count is None or count > most:
            shown = f"more than {sys.maxsize}" if count is None else count
            raise ValueError(f"{what} holds at most {most} {of}, not {shown}")
    return list(values)


def distinct_rows(rows: Any, batch: int, what: str) -> list[int]:
    """`rows` as ints, each a row of a batch of `batch` rows and none twice, else TypeError
    (what is no sequence, a row that is no int: a bool was read as row 1, a float truncated) or
    ValueError (a row outside 0..batch - 1: a device index past the batch asserts and loses the
    context, -1 was the last row; a row twice was two writes racing for it) naming `what`. A
    tensor of rows is read a row at a time: what takes rows checks them on the host. Text and
    bytes are no rows (TypeError: bytes, a bytearray and a memoryview were read as their ints,
    b"\\x00\\x01" rows 0 and 1), nor is a set or a mapping: rows are paired with prompts by their
    order, and a set's is its hashes' (a prefill's rows {1, 0} were rows 0 and 1, each given the
    other's prompt). Each row is checked as it is read, and none past the batch's count and one
    (a row twice by then): itertools.count() or range(10**10) was listed whole first, for ever or
    tens of GB, to be refused by its third row."""
    try:
        if isinstance(rows, (*TEXT_LIKE, Set, Mapping)):
            raise TypeError
        given = iter(rows)
    except TypeError:
        raise TypeError(f"{what} are a sequence of row indices, not {reprlib.repr(rows)}") from None
    checked: list[int] = []
    for row in given:
        checked.append(as_size(row, "a row", 0, batch - 1))
        if len(checked) > batch:
            break
    if len(set(checked)) != len(checked):
        raise ValueError(f"{what} must be distinct rows of 0..{batch - 1}, not {checked}")
    return checked
