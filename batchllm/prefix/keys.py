"""Request keys for prefix planning: validate token ids, encode, sort, LCP of neighbours. A key is
the prompt minus its last token, encoded so that bytes order is token order (docs/design.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

# Prompts validated / encoded per chunk, so the temporary flat array stays small (1M x 300).
_CHUNK_NUM_PROMPTS = 65536
_LCP_CHUNK_NUM_TOKENS = 1 << 22
# keys at least this long on average find neighbour LCPs by binary search (_neighbour_lcp)
_SEARCH_MIN_MEAN_TOKENS = 48


class PromptError(ValueError):
    """A prompt is not a non-empty sequence of non-negative integer token ids."""


@dataclass(frozen=True)
class SortedKeys:
    """Keys sorted lexicographically, with the LCP of neighbours (all in tokens)."""

    order: np.ndarray  # [num_requests] int64: request index of the i-th smallest key
    key_num_tokens: np.ndarray  # [num_requests] int64, in sorted order
    lcp_num_tokens: np.ndarray  # [num_requests] int64: LCP(key[i-1], key[i]); [0] = 0
    prompt_num_tokens: np.ndarray  # [num_requests] int64, in input order
    max_token_id: int


def as_token_arrays(prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Each prompt as a 1-D integer numpy array (no copy for numpy input)."""
    arrays = []
    for index, prompt in enumerate(prompts):
        array = prompt if isinstance(prompt, np.ndarray) else np.asarray(prompt)
        if array.ndim != 1:
            raise PromptError(f"prompt {index}: token ids must be a flat sequence, got shape {array.shape}")
        if array.size == 0:
            raise PromptError(f"prompt {index} is empty: a prompt needs >= 1 token")
        if array.dtype.kind not in "iu":
            raise PromptError(f"prompt {index}: token ids must be integers, got dtype {array.dtype}")
        arrays.append(array)
    return arrays


def _max_token_id(arrays: list[np.ndarray]) -> int:
    """Largest token id; checks every id is >= 0."""
    max_token_id = 0
    for start in range(0, len(arrays), _CHUNK_NUM_PROMPTS):
        flat = np.concatenate(arrays[start : start + _CHUNK_NUM_PROMPTS])
        low, high = int(flat.min()), int(flat.max())
        if low < 0:
            bad = start + next(i for i, a in enumerate(arrays[start:]) if int(a.min()) < 0)
            raise PromptError(f"prompt {bad}: token ids must be >= 0, got {low}")
        max_token_id = max(max_token_id, high)
    return max_token_id


def _token_byte_dtype(max_token_id: int) -> np.dtype:
    """Narrowest big-endian unsigned dtype holding every token id: byte order == token order."""
    return np.dtype(">u2" if max_token_id < 1 << 16 else ">u4" if max_token_id < 1 << 32 else ">u8")


def encode_keys(arrays: list[np.ndarray], dtype: np.dtype) -> list[bytes]:
    """bytes of prompt[:-1] per request, in input order."""
    keys: list[bytes] = []
    width = dtype.itemsize
    for start in range(0, len(arrays), _CHUNK_NUM_PROMPTS):
        chunk = arrays[start : start + _CHUNK_NUM_PROMPTS]
        ends = np.cumsum([a.size for a in chunk]) * width
        buffer = np.concatenate(chunk).astype(dtype).tobytes()
        begin = 0
        for end in ends.tolist():
            keys.append(buffer[begin : end - width])  # drop the last token
            begin = end
    return keys


def _pair_lcp(left: bytes, right: bytes, width: int) -> int:
    """LCP in tokens of two keys: a binary search over equal-length prefixes, each compared by
    bytes equality (memcmp), about 12 comparisons for keys of thousands of tokens."""
    num_tokens = min(len(left), len(right)) // width
    if left[:num_tokens * width] == right[:num_tokens * width]:
        return num_tokens
    equal, differs = 0, num_tokens  # left[:equal] == right[:equal]; the first `differs` tokens do not match
    while differs - equal > 1:
        middle = (equal + differs) // 2
        if left[:middle * width] == right[:middle * width]:
            equal = middle
        else:
            differs = middle
    return equal


def _neighbour_lcp(sorted_keys: list[bytes], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(lcp, key_num_tokens): lcp[i] = LCP in tokens of keys i-1 and i, lcp[0] = 0. Keys of
    _SEARCH_MIN_MEAN_TOKENS tokens or more on average: a binary search per pair; shorter: numpy
    over every token position (on a 2-core CPU, 1,024 keys of 2,000 tokens in 7-10 ms against
    25-130 ms, 50,000 of 128 in 0.15 s against 0.42; 50,000 of 40 in 0.12 s against 0.08)."""
    num_keys = len(sorted_keys)
    width = dtype.itemsize
    key_num_tokens = np.fromiter((len(k) for k in sorted_keys), dtype=np.int64, count=num_keys) // width
    lcp = np.zeros(num_keys, dtype=np.int64)
    if num_keys < 2:
        return lcp, key_num_tokens
    if key_num_tokens.mean() >= _SEARCH_MIN_MEAN_TOKENS:
        lcp[1:] = np.fromiter((_pair_lcp(sorted_keys[i - 1], sorted_keys[i], width) for i in range(1, num_keys)),
                              dtype=np.int64, count=num_keys - 1)
        return lcp, key_num_tokens
    first = 0  # the chunk covers keys first..last-1 and the pairs (first, first+1) ...
    while first < num_keys - 1:
        budget = np.cumsum(key_num_tokens[first:])
        last = first + max(2, int(np.searchsorted(budget, _LCP_CHUNK_NUM_TOKENS)))
        last = min(last, num_keys)
        tokens = np.frombuffer(b"".join(sorted_keys[first:last]), dtype=dtype)
        lengths = key_num_tokens[first:last]
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        compare_num_tokens = np.minimum(lengths[:-1], lengths[1:])  # per pair
        pair_lcp = np.zeros(len(compare_num_tokens), dtype=np.int64)
        nonempty = np.flatnonzero(compare_num_tokens)
        if nonempty.size:
            counts = compare_num_tokens[nonempty]
            seg_starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
            position = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(seg_starts, counts)
            left = np.repeat(offsets[nonempty], counts) + position
            right = np.repeat(offsets[nonempty + 1], counts) + position
            mismatch = np.where(tokens[left] != tokens[right], position, np.iinfo(np.int64).max)
            first_mismatch = np.minimum.reduceat(mismatch, seg_starts)
            pair_lcp[nonempty] = np.minimum(first_mismatch, counts)
        lcp[first + 1 : last] = pair_lcp
        first = last - 1
    return lcp, key_num_tokens


def sort_keys(prompts: Sequence[Sequence[int]]) -> tuple[SortedKeys, list[np.ndarray]]:
    """Validate prompts, sort their keys, compute neighbour LCPs. Returns (keys, token arrays)."""
    arrays = as_token_arrays(prompts)
    prompt_num_tokens = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    if not arrays:
        empty = np.zeros(0, dtype=np.int64)
        return SortedKeys(empty, empty, empty, empty, 0), arrays
    max_token_id = _max_token_id(arrays)
    dtype = _token_byte_dtype(max_token_id)
    keys = encode_keys(arrays, dtype)
    order = sorted(range(len(keys)), key=keys.__getitem__)
    sorted_keys = [keys[i] for i in order]
    del keys
    lcp, key_num_tokens = _neighbour_lcp(sorted_keys, dtype)
    order_array = np.asarray(order, dtype=np.int64)
    return SortedKeys(order_array, key_num_tokens, lcp, prompt_num_tokens, max_token_id), arrays
