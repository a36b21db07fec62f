"""Where the int32 arrays of an attention plan live in its ONE device buffer: a step's plan
(`ops.plan_device.plan_to_device`) and the decode CUDA graphs' static buffers are cut into views
the same way (docs/design.md, "Prefix-shared attention").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# The arrays every plan carries, in buffer order (PrefixSharedPlan / PrefixSharedPlanOnDevice fields).
PLAN_ARRAYS = ("work", "block_tables", "prefix_limit", "merge_tokens", "merge_offsets", "merge_slots")


def aligned_offsets(sizes) -> list[int]:
    """Starts of parts of `sizes` int32 each laid out in turn in one int32 buffer, every start
    16-byte aligned (Triton specialises pointer arguments on 16-byte alignment, so views at
    size-dependent offsets would compile new kernel variants mid-run); the last entry is the
    buffer's length."""
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-int(size) // 4) * 4)
    return starts


@dataclass(frozen=True)
class PlanBufferLayout:
    """(array name, shape) of each array of one int32 buffer, in buffer order."""

    arrays: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def starts(self) -> list[int]:
        """Offset (int32 entries) of each array, then the buffer's length."""
        return aligned_offsets(math.prod(shape) for _, shape in self.arrays)

    @property
    def num_int32(self) -> int:
        return self.starts[-1]

    def views(self, flat) -> dict:
        """name -> view of `flat` (a 1-D numpy array or tensor of num_int32 entries), shaped."""
        return {name: flat[start:start + math.prod(shape)].reshape(shape)
                for (name, shape), start in zip(self.arrays, self.starts)}

    def pack(self, arrays: dict) -> np.ndarray:
        """One int32 buffer holding `arrays` (name -> numpy array of its layout shape)."""
        flat = np.zeros(self.num_int32, np.int32)
        for name, view in self.views(flat).items():
            view[...] = arrays[name]
        return flat


def step_layout(arrays: dict) -> PlanBufferLayout:
    """The layout of a step's own arrays (name -> numpy array), at their sizes."""
    return PlanBufferLayout(tuple((name, tuple(array.shape)) for name, array in arrays.items()))


def graph_layout(num_rows: int, num_blocks: int, items_capacity: int, slots_capacity: int,
                 work_fields: int) -> PlanBufferLayout:
    """The static plan buffer of a decode CUDA graph: PLAN_ARRAYS at fixed capacities, the item
    counts of its persistent launches ([3]: PrefixSharedPlan.item_counts), and a second
    work list for the SMALL items of class-split launches (`work` then holds the BIG ones), and each
    row's KV positions (read by XQA decode graphs only: ops/xqa_decode.py)."""
    return PlanBufferLayout((
        ("work", (items_capacity, work_fields)),
        ("block_tables", (num_rows, num_blocks)),
        ("prefix_limit", (num_rows,)),
        ("merge_tokens", (num_rows,)),
        ("merge_offsets", (num_rows + 1,)),
        ("merge_slots", (slots_capacity,)),
        ("num_items", (3,)),
        ("work_small", (items_capacity, work_fields)),
        ("seq_lens", (num_rows,)),
    ))
