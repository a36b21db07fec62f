"""How many programs of a compiled Triton kernel one SM holds at once: a persistent grid larger
than that runs its extra programs as a second wave, after whole programs of the first have
finished (docs/design.md, "CUDA graphs"). Written here because Triton reports a kernel's
registers and shared memory but not its occupancy; the rules are CUDA's (registers allocated per
warp in units of 256, 1 KiB of shared memory reserved per block on sm_80 and later)."""

from __future__ import annotations

import torch

WARP_SIZE = 32
REGISTER_UNIT = 256  # registers are allocated per warp in units of this many
RESERVED_SHARED_BYTES = 1024  # per block, by the CUDA runtime
MAX_BLOCKS_PER_SM = 32
REGS_PER_SM = 65536  # every CUDA GPU since compute capability 5.0 (older torch does not report it)


def resident_programs(num_regs: int, shared_bytes: int, num_warps: int, regs_per_sm: int, shared_per_sm: int,
                      threads_per_sm: int) -> int:
    """Programs (blocks) of num_warps warps, num_regs registers a thread and shared_bytes of shared
    memory that one SM holds at once (at least 1)."""
    regs_per_warp = -(-num_regs * WARP_SIZE // REGISTER_UNIT) * REGISTER_UNIT
    by_regs = regs_per_sm // max(regs_per_warp * num_warps, 1)
    by_shared = shared_per_sm // (shared_bytes + RESERVED_SHARED_BYTES)
    by_threads = threads_per_sm // (num_warps * WARP_SIZE)
    return max(1, min(by_regs, by_shared, by_threads, MAX_BLOCKS_PER_SM))


def kernel_programs_per_sm(kernel, device: torch.device) -> int:
    """resident_programs of a compiled Triton kernel (what `jit_fn.warmup(...)` returns) on a CUDA
    device; MAX_BLOCKS_PER_SM (no cap) where Triton reports no register count."""
    kernel.run  # noqa: B018 (loads the binary: Triton reads its register count then)
    if getattr(kernel, "n_regs", None) is None:
        return MAX_BLOCKS_PER_SM
    props = torch.cuda.get_device_properties(device)
    return resident_programs(kernel.n_regs, kernel.metadata.shared, kernel.metadata.num_warps,
                             getattr(props, "regs_per_multiprocessor", REGS_PER_SM),
                             props.shared_memory_per_multiprocessor,
                             props.max_threads_per_multi_processor)
