"""Attention kernel benchmark (BatchLLM section 6.3.3 settings), one process on one GPU, the
engine's default tile config.

Shared scenarios (--scenarios shared or all): pure decode of 256 requests, and chunked prefill
(7 prefill chunks + 256 decode requests), over prefix/distinct/group-size settings, with and
without jittered distinct lengths. Implementations, all validated against the float32 reference
first:
  fused      ours, ONE launch of prefix + distinct tiles, then the LSE merge kernel; work list
             in "cost" order (largest first: in practice all BIG tiles, then all SMALL ones)
  fused_interleave  the same kernel and items, work list in "interleave" order (BIG and SMALL
             tiles merged by cumulative cost, so tensor-core and KV-streaming tiles co-run)
  fused_auto the engine's default order ("auto": interleave when the step has prefill chunks)
  plain      ours without sharing knowledge (each request reads its whole KV)
  sdpa       PyTorch SDPA on KV gathered per request from the paged cache (gather included)
  sdpa_nogather  the same SDPA calls on pre-gathered dense KV (gather excluded)
  flashinfer FlashInfer MultiLevelCascadeAttentionWrapper (2 levels), decode scenarios only,
             where FlashInfer is installed

Dense scenarios (--scenarios dense or all): causal self-attention of B sequences of L tokens
with no sharing (8 x 2048, 2 x 8192, 1 x 16384), the last 2048 rows of a 16384-token context,
and the same rows with the first 14336 tokens as a shared prefix (prefix tiles). Rows carry
`impl` and `tflop_per_s` (4 x heads x head_dim x the causal query-key pairs):
  batchllm    our fused kernel on the paged cache (the engine's work order and config), and the
              same config without dense calls ("tiles_only")
  sdpa_cudnn  PyTorch SDPA with only the cuDNN backend on dense contiguous K/V, at its best of
              three settings: KV heads repeated beforehand (excluded from the timing), the KV
              heads as they are with enable_gqa, and (square shapes) cuDNN's op called directly;
              each with the tensors head-major and token-major (the token-major output is
              already in the packed layout that ours is returned in)
  sdpa_flash  the same with only the flash backend (the first two settings, both layouts)
Each output is checked first against a float32 reference computed in row chunks.

Usage: PYTHONPATH=. python3 benchmarks/attention.py --out results.json [--markdown table.md]
  [--scenarios shared|dense|all]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import replace

import numpy as np
import torch
import triton

from batchllm.ops.prefix_attention import prefix_shared_attention
from batchllm.ops.reference import paged_attention_reference
from batchllm.perf.runner import git_commit
from batchllm.attention_plan.tile_config import TileConfig, default_tile_config
from batchllm.attention_plan.work_list import DEFAULT_WORK_ORDER, build_prefix_shared_plan
from batchllm.ops.plan_device import device_num_sms, plan_to_device
from tests.synthetic_batch import SeqSpec, make_batch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3.1-8B
NUM_DECODE, NUM_CHUNKS, CHUNK_TOKENS = 256, 7, 512
SETTINGS = [(2048, 256, 16), (2048, 256, 4), (4096, 512, 64), (256, 2048, "all")]
DRY_SETTINGS = [(40, 20, "all"), (33, 16, 2)]  # --dry-run (CPU interpreter) with NUM_DECODE = 4
MODES = [("decode", False), ("decode_jitter", True), ("mixed", False), ("mixed_jitter", True)]


def scenario_seqs(prefix: int, distinct: int, group: str | int, mixed: bool, jitter: bool, seed=0) -> list[SeqSpec]:
    rng = np.random.default_rng(seed)
    group_size = NUM_DECODE if group == "all" else int(group)
    num_groups = NUM_DECODE // group_size
    seqs = []
    for g in range(num_groups):
        if mixed:  # prefill chunks: members' first distinct chunks, spread over the groups
            for c in range(NUM_CHUNKS):
                if c % num_groups == g:
                    q = min(CHUNK_TOKENS, distinct)
                    seqs.append(SeqSpec(q, prefix + q, prefix, g))
        for _ in range(group_size):
            d = int(round(distinct * rng.uniform(0.25, 1.75))) if jitter else distinct  # noqa: RUF046
            seqs.append(SeqSpec(1, prefix + max(d, 1), prefix, g))
    return seqs


def bench_us(fn, rep_ms=60) -> float:
    if not torch.cuda.is_available():  # --dry-run on CPU: one timed call
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=15, rep=rep_ms)) * 1e3


class Sdpa:
    """Dense SDPA per request: decode rows batched (padded, masked), prefill chunks one by one."""

    def __init__(self, b, seqs, scale):
        self.b, self.scale = b, scale
        lens, shared = b.seq_lens.tolist(), b.shared_kv_lens.tolist()
        starts = b.query_start_loc.tolist()
        dev = b.query.device
        flat = lambda s: torch.as_tensor(
            _slots(b.block_tables[s].cpu().numpy(), lens[s], shared[s]), device=dev)
        self.decode = [s for s, x in enumerate(seqs) if x.q_len == 1]
        self.chunks = [s for s, x in enumerate(seqs) if x.q_len > 1]
        max_len = max(lens[s] for s in self.decode)
        slots = torch.zeros(len(self.decode), max_len, dtype=torch.long, device=dev)
        self.mask = torch.zeros(len(self.decode), 1, 1, max_len, dtype=torch.bool, device=dev)
        for i, s in enumerate(self.decode):
            slots[i, :lens[s]] = flat(s)
            self.mask[i, ..., :lens[s]] = True
        self.decode_slots = slots
        self.decode_rows = torch.tensor([starts[s] for s in self.decode], device=dev)
        self.chunk_slots = [flat(s) for s in self.chunks]
        self.chunk_rows = [(starts[s], starts[s + 1]) for s in self.chunks]
        self.gathered = None

    def _gather(self, slots):
        return gather_kv(self.b, slots)

    def pregather(self):
        self.gathered = (self._gather(self.decode_slots), [self._gather(s) for s in self.chunk_slots])

    def __call__(self, use_pregathered=False):
        import torch.nn.functional as F
        q_all, out = self.b.query, torch.empty_like(self.b.query)
        dk, ck = self.gathered if use_pregathered else (self._gather(self.decode_slots), None)
        q = q_all[self.decode_rows][:, :, None, :]  # [R, H, 1, D]
        o = F.scaled_dot_product_attention(q, dk[0], dk[1], attn_mask=self.mask, scale=self.scale, enable_gqa=True)
        out[self.decode_rows] = o[:, :, 0]
        for i, (r0, r1) in enumerate(self.chunk_rows):
            k, v = ck[i] if use_pregathered else self._gather(self.chunk_slots[i])
            q = q_all[r0:r1].transpose(0, 1)[None]
            L, n = k.shape[-2], r1 - r0
            mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n)
            o = F.scaled_dot_product_attention(q, k[None], v[None], attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[r0:r1] = o[0].transpose(0, 1)
        return out


def gather_kv(b, slots):
    """K and V of the cache slots `slots` ([..., L] int64): [..., Hkv, L, D] each."""
    k = b.k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots]  # [..., L, Hkv, D]
    v = b.v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots]
    return k.transpose(-3, -2), v.transpose(-3, -2)


def _slots(table, seq_len, shared):
    p = np.arange(seq_len)
    own0 = -(-shared // BLOCK_SIZE)
    idx = np.where(p < shared, p // BLOCK_SIZE, own0 + (p - shared) // BLOCK_SIZE)
    off = np.where(p < shared, p % BLOCK_SIZE, (p - shared) % BLOCK_SIZE)
    return table[idx].astype(np.int64) * BLOCK_SIZE + off


def flashinfer_cascade(b, seqs, scale):
    """2-level FlashInfer cascade on our paged cache (NHD, page 16); None if unavailable."""
    import flashinfer
    dev = b.query.device
    lens, shared, groups = b.seq_lens.tolist(), b.shared_kv_lens.tolist(), b.group_ids.tolist()
    starts = b.query_start_loc.tolist()
    tables = b.block_tables.cpu().numpy()
    ceil = lambda a: -(-a // BLOCK_SIZE)
    last = lambda n: n - (ceil(n) - 1) * BLOCK_SIZE if n else 0
    # level 0: one entry per group (its rows x its prefix pages); level 1: one per request
    g_ids = sorted(set(groups))
    qo0, kv0, idx0, last0 = [0], [0], [], []
    for g in g_ids:
        members = [s for s in range(len(seqs)) if groups[s] == g]
        qo0.append(starts[members[-1] + 1])
        p = shared[members[0]]
        idx0 += tables[members[0], :ceil(p)].tolist()
        kv0.append(len(idx0))
        last0.append(last(p))
    qo1, kv1, idx1, last1 = [0], [0], [], []
    for s in range(len(seqs)):
        qo1.append(starts[s + 1])
        own = lens[s] - shared[s]
        idx1 += tables[s, ceil(shared[s]):ceil(shared[s]) + ceil(own)].tolist()
        kv1.append(len(idx1))
        last1.append(last(own))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)
    workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(2, workspace, "NHD")
    wrapper.plan([i32(qo0), i32(qo1)], [i32(kv0), i32(kv1)], [i32(idx0), i32(idx1)], [i32(last0), i32(last1)],
                 NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, causal=False, sm_scale=scale,
                 q_data_type=b.query.dtype, kv_data_type=b.k_cache.dtype)
    return lambda: wrapper.run(b.query, (b.k_cache, b.v_cache))


def kv_bytes_unique(seqs) -> float:
    prefix = {}
    own = 0
    for s in seqs:
        prefix[s.group_id] = s.shared_kv_len
        own += s.seq_len - s.shared_kv_len if s.q_len == 1 else 0
    return (sum(prefix.values()) + own) * NUM_KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16


def prefix_flops(seqs) -> float:
    return sum(4.0 * s.q_len * s.shared_kv_len * NUM_HEADS * HEAD_DIM for s in seqs)


VALID_MAX_ABS_ERR = 5e-2  # a row is valid when its output is this close to the float32 reference


def _time_impls(impls, ref, notes, where, variant_us: dict | None = None) -> dict:
    """{name: (us, max_abs_err, config tag)}: each implementation validated, then timed (best
    variant: the fastest valid one, or the fastest when none is valid); variant_us, when given,
    receives {name: {tag: us}} for every variant."""
    timings = {}
    for name, variants in impls.items():
        best = None
        for tag, fn in variants:
            try:
                err = (fn().float() - ref).abs().max().item()
                us = bench_us(fn)
            except Exception as exc:  # noqa: BLE001
                notes.append(f"{name}{tag} failed on {where}: {exc!r}"[:600])
                continue
            if variant_us is not None:
                variant_us.setdefault(name, {})[tag] = round(us, 2)
            if best is None or (err < VALID_MAX_ABS_ERR, -us) > (best[1] < VALID_MAX_ABS_ERR, -best[0]):
                best = (us, err, tag)
        if best:
            timings[name] = best
    return timings


def _main_timings(b, seqs, ref, scale, tile: TileConfig, with_flashinfer: bool, notes: list, where: str) -> dict:
    """Our kernels under the engine's tile config, SDPA, FlashInfer."""
    dev = b.query.device
    meta = b.metadata_numpy()
    kw = {"block_size": BLOCK_SIZE, "num_kv_heads": NUM_KV_HEADS, "num_heads": NUM_HEADS, "head_dim": HEAD_DIM,
          "tile": tile, "num_sms": device_num_sms(dev)}
    plans = {name: plan_to_device(build_prefix_shared_plan(**meta, order=order, **kw), dev)
             for name, order in (("fused", "cost"), ("fused_interleave", "interleave"), ("fused_auto", "auto"))}
    plans["plain"] = plan_to_device(build_prefix_shared_plan(meta["query_start_loc"], meta["seq_lens"],
                                                             meta["shared_kv_lens"], meta["block_tables"], **kw),
                                    dev)  # no groups: plain paged
    impls = {name: [("default", lambda p=p: prefix_shared_attention(b.query, b.k_cache, b.v_cache, p, scale))]
             for name, p in plans.items()}
    sdpa = Sdpa(b, seqs, scale)
    impls["sdpa"] = [("", lambda: sdpa(False))]
    if with_flashinfer:
        try:
            impls["flashinfer"] = [("", flashinfer_cascade(b, seqs, scale))]
        except Exception as exc:  # noqa: BLE001
            notes.append(f"flashinfer plan failed on {where}: {exc!r}")
    timings = _time_impls(impls, ref, notes, where)
    try:
        sdpa.pregather()
        err = (sdpa(True).float() - ref).abs().max().item()
        timings["sdpa_nogather"] = (bench_us(lambda: sdpa(True)), err, "")
    except Exception as exc:  # noqa: BLE001
        notes.append(f"sdpa_nogather failed: {exc!r}"[:300])
    return timings


# (batch, query rows per sequence, context tokens per sequence, shared prefix tokens)
DENSE_SHAPES = [(8, 2048, 2048, 0), (2, 8192, 8192, 0), (1, 16384, 16384, 0), (1, 2048, 16384, 0),
                (1, 2048, 16384, 14336)]
DRY_DENSE_SHAPES = [(2, 40, 40, 0), (1, 16, 48, 0), (1, 16, 48, 32)]


def dense_seqs(batch: int, q_len: int, context: int, shared: int) -> list[SeqSpec]:
    """B sequences whose q_len rows are the last of `context` tokens; with `shared`, the first
    `shared` tokens are one group's prefix (one member: the prefix tiles do the context)."""
    return [SeqSpec(q_len, context, shared, 0 if shared else -1) for _ in range(batch)]


def causal_pairs(q_len: int, context: int) -> int:
    """Query-key pairs a causal row block sees: row i of the last q_len sees context - q_len + i + 1."""
    return q_len * (context - q_len) + q_len * (q_len + 1) // 2


def dense_kv(b, seqs) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, H, L, D] K and V gathered from the paged cache, KV heads repeated to the query heads."""
    dev = b.query.device
    lens, shared = b.seq_lens.tolist(), b.shared_kv_lens.tolist()
    tables = b.block_tables.cpu().numpy()
    slots = torch.stack([torch.as_tensor(_slots(tables[s], lens[s], shared[s]), device=dev)
                         for s in range(len(seqs))])
    rep = NUM_HEADS // NUM_KV_HEADS
    k, v = gather_kv(b, slots)  # [B, Hkv, L, D]
    return k.repeat_interleave(rep, dim=1).contiguous(), v.repeat_interleave(rep, dim=1).contiguous()


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    rows_per_chunk: int = 1024) -> torch.Tensor:
    """float32 causal attention, bottom-right aligned, computed in row chunks. q [B, H, Lq, D],
    k / v [B, H, L, D]; returns [B * Lq, H, D] (the packed layout of our kernel)."""
    q_len, context = q.shape[2], k.shape[2]
    kf, vf = k.float(), v.float()
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for r0 in range(0, q_len, rows_per_chunk):
        r1 = min(q_len, r0 + rows_per_chunk)
        scores = q[:, :, r0:r1].float() @ kf.transpose(-1, -2) * scale  # [B, H, rows, L]
        visible = torch.arange(context, device=q.device)[None, :] <= (
            context - q_len + torch.arange(r0, r1, device=q.device)[:, None])
        scores.masked_fill_(~visible, float("-inf"))
        out[:, :, r0:r1] = torch.softmax(scores, dim=-1) @ vf
    return out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[3])


def _sdpa_backend_fn(backend_name: str, q, k, v, scale, enable_gqa: bool = False):
    """One SDPA call with only `backend_name` allowed, output in the packed layout; enable_gqa:
    k / v hold the KV heads only (grouped-query attention inside the kernel)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    q_len, context = q.shape[2], k.shape[2]
    if q_len == context:
        mask_kw = {"is_causal": True}
    else:
        from torch.nn.attention.bias import causal_lower_right
        mask_kw = {"attn_mask": causal_lower_right(q_len, context)}

    def fn():
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=enable_gqa, **mask_kw)
        return o.transpose(1, 2).reshape(-1, q.shape[1], q.shape[3])
    return fn


def _cudnn_op_fn(q, k, v, scale):
    """cuDNN's fused attention through PyTorch's op directly, with the KV heads as they are (square
    causal shapes only: its causal mask is unambiguous there), output in the packed layout."""
    def fn():
        o = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, True, False, scale=scale)[0]
        return o.transpose(1, 2).reshape(-1, q.shape[1], q.shape[3])
    return fn


def token_major(t: torch.Tensor) -> torch.Tensor:
    """The same [B, H, L, D] values stored token-major ([B, L, H, D] in memory, as the engine's
    query and output are), as a [B, H, L, D] view."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def sdpa_variants(backend_name: str, q, k, v, scale) -> list[tuple[str, object]]:
    """The peer's settings, swept (the fastest valid one is its row): SDPA with the KV heads
    repeated, SDPA with grouped-query attention inside the kernel and, for cuDNN on square
    shapes, its op called directly; each with the tensors head-major ([B, H, L, D] in memory)
    and token-major ("bshd_": [B, L, H, D] in memory, whose output is already in the packed
    layout, so it needs no copy). q: [B, query heads, L, D]; k / v: [B, query heads, L, D], KV
    heads repeated."""
    k_heads, v_heads = (t[:, ::NUM_HEADS // NUM_KV_HEADS].contiguous() for t in (k, v))
    variants = []
    for prefix, layout in (("", lambda t: t), ("bshd_", token_major)):
        lq, lk, lv, lkh, lvh = (layout(t) for t in (q, k, v, k_heads, v_heads))
        variants += [(prefix.rstrip("_"), _sdpa_backend_fn(backend_name, lq, lk, lv, scale)),
                     (prefix + "gqa", _sdpa_backend_fn(backend_name, lq, lkh, lvh, scale, enable_gqa=True))]
        if backend_name == "CUDNN_ATTENTION" and q.shape[2] == k.shape[2]:
            variants.append((prefix + "gqa_op", _cudnn_op_fn(lq, lkh, lvh, scale)))
    return variants


def run_dense(args, dev, dtype, scale, tile: TileConfig, rows: list, notes: list) -> dict:
    """The dense causal rows: our kernel (with and without dense calls) and SDPA's cuDNN and flash
    backends on the same data. Returns the tile configs of our rows ({tag: config})."""
    configs = {"default": tile, "tiles_only": replace(tile, dense_min_rows=0)}
    for batch, q_len, context, shared in (DRY_DENSE_SHAPES if args.dry_run else DENSE_SHAPES):
        where = f"dense {batch}x{q_len} of {context}" + (f", {shared} shared" if shared else "")
        seqs = dense_seqs(batch, q_len, context, shared)
        b = make_batch(seqs, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                       block_size=BLOCK_SIZE, dtype=dtype, device=dev)
        k, v = dense_kv(b, seqs)
        q = b.query.view(batch, q_len, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        ref = dense_reference(q, k, v, scale)
        meta = b.metadata_numpy()
        impls = {"batchllm": []}
        for tag, cfg in configs.items():
            plan = plan_to_device(build_prefix_shared_plan(
                **meta, order="auto", block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, num_heads=NUM_HEADS,
                head_dim=HEAD_DIM, tile=cfg, num_sms=device_num_sms(dev)), dev)
            impls["batchllm"].append((tag, lambda p=plan: prefix_shared_attention(b.query, b.k_cache, b.v_cache, p, scale)))
        if dev == "cuda":
            impls["sdpa_cudnn"] = sdpa_variants("CUDNN_ATTENTION", q, k, v, scale)
            impls["sdpa_flash"] = sdpa_variants("FLASH_ATTENTION", q, k, v, scale)
        flops = 4.0 * NUM_HEADS * HEAD_DIM * causal_pairs(q_len, context) * batch
        variant_us = {}
        for name, (us, err, tag) in _time_impls(impls, ref, notes, where, variant_us).items():
            row = {"scenario": "dense", "batch": batch, "q_len": q_len, "context": context, "shared": shared,
                   "impl": name, "us": round(us, 2), "tflop_per_s": round(flops / us / 1e6, 1),
                   "max_abs_err": err, "valid": err < VALID_MAX_ABS_ERR, "config": tag, "us_by_config": variant_us[name]}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del b, k, v, q, ref
        if dev == "cuda":
            torch.cuda.empty_cache()
    return configs


def dense_markdown_table(result) -> str:
    by_shape = {}
    for r in result["rows"]:
        if r.get("scenario") == "dense":
            by_shape.setdefault((r["batch"], r["q_len"], r["context"], r["shared"]), {})[r["impl"]] = r
    impls = ["batchllm", "sdpa_cudnn", "sdpa_flash"]
    lines = ["| shape | " + " | ".join(f"{i} TFLOP/s" for i in impls) + " | batchllm / cuDNN |",
             "|" + "---|" * (len(impls) + 2)]
    for (batch, q_len, context, shared), r in by_shape.items():
        shape = f"{batch} x {q_len}" if q_len == context else f"last {q_len} rows of {context}"
        shape += f", {shared} shared" if shared else ""
        cell = lambda i, r=r: (f"{r[i]['tflop_per_s']:.0f}" + ("" if r[i]["valid"] else " (INVALID)")) if i in r else "-"
        ratio = (f"{r['sdpa_cudnn']['us'] / r['batchllm']['us']:.2f}"  # equal FLOPs: the time ratio, exact on tiny shapes
                 if "batchllm" in r and "sdpa_cudnn" in r else "-")
        lines.append(f"| {shape} | " + " | ".join(cell(i) for i in impls) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def run(args):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    scale = HEAD_DIM ** -0.5
    rows, notes = [], []
    result = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)",
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "git_commit": git_commit() or "unknown", "dtype": "bfloat16",
              "heads": f"{NUM_HEADS}q/{NUM_KV_HEADS}kv d{HEAD_DIM} page {BLOCK_SIZE}", "rows": rows, "notes": notes,
              "engine_work_order": DEFAULT_WORK_ORDER,
              "versions": {"torch": torch.__version__, "triton": triton.__version__}}
    try:
        import flashinfer  # noqa: F401
        have_flashinfer = True
    except Exception as exc:  # noqa: BLE001
        have_flashinfer = False
        notes.append(f"flashinfer not importable: {exc!r}")
    tile = default_tile_config(HEAD_DIM, NUM_HEADS // NUM_KV_HEADS)
    result["tile_configs"] = {"default": vars(tile)}
    t_start = time.time()
    if args.scenarios in ("dense", "all"):
        result["tile_configs"] = {t: vars(c) for t, c in run_dense(args, dev, dtype, scale, tile, rows, notes).items()}
    scenarios = [(setting, mode, jitter) for setting in (DRY_SETTINGS if args.dry_run else SETTINGS)
                 for mode, jitter in MODES] if args.scenarios in ("shared", "all") else []
    for (prefix, distinct, group), mode, jitter in scenarios:
        seqs = scenario_seqs(prefix, distinct, group, mode.startswith("mixed"), jitter)
        b = make_batch(seqs, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                       block_size=BLOCK_SIZE, dtype=dtype, device=dev)
        ref = paged_attention_reference(b.query, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens,
                                        b.shared_kv_lens, b.block_tables, scale).float()
        with_flashinfer = have_flashinfer and not mode.startswith("mixed")
        timings = _main_timings(b, seqs, ref, scale, tile, with_flashinfer, notes, f"{prefix}/{distinct}/{group} {mode}")
        t_plain = timings.get("plain", (float("nan"),))[0]
        for name, (us, err, tag) in timings.items():
            row = {"scenario": mode, "prefix": prefix, "distinct": distinct, "group": group, "impl": name,
                   "us": round(us, 2), "speedup_vs_plain": round(t_plain / us, 3), "max_abs_err": err,
                   "valid": err < VALID_MAX_ABS_ERR, "config": tag, "kv_tb_per_s": round(kv_bytes_unique(seqs) / us / 1e6, 3),
                   "prefix_tflop_per_s": round(prefix_flops(seqs) / us / 1e6, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        result["wall_s"] = round(time.time() - t_start, 1)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        del b, ref
        if dev == "cuda":
            torch.cuda.empty_cache()
    result["wall_s"] = round(time.time() - t_start, 1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            tables = [markdown_table(result) if any(r["scenario"] != "dense" for r in result["rows"]) else "",
                      dense_markdown_table(result) if any(r["scenario"] == "dense" for r in result["rows"]) else ""]
            f.write("\n".join(t for t in tables if t))
    return result


def markdown_table(result) -> str:
    """The shared scenarios' table; the FlashInfer columns only where some row has FlashInfer."""
    by_key = {}
    for r in result["rows"]:
        if r["scenario"] != "dense":
            by_key.setdefault((r["prefix"], r["distinct"], r["group"], r["scenario"]), {})[r["impl"]] = r
    flashinfer = any("flashinfer" in r for r in by_key.values())
    impls = ["fused", "fused_interleave", "fused_auto", "plain", "sdpa", "sdpa_nogather"] + ["flashinfer"] * flashinfer
    ratios = ["fused vs plain", "interleave vs plain", "auto vs plain"] + ["fused vs flashinfer"] * flashinfer
    lines = ["| prefix/distinct/group | scenario | " + " | ".join([f"{i} us" for i in impls] + ratios)
             + " | fused KV TB/s | fused prefix TFLOP/s |", "|" + "---|" * (len(impls) + len(ratios) + 4)]
    for (p, d, g, sc), r in by_key.items():
        cell = lambda i, r=r: (f"{r[i]['us']:.1f}" + ("" if r[i]["valid"] else " (INVALID)")) if i in r else "-"
        vs_plain = [f"{r[i]['speedup_vs_plain']:.2f}x" if i in r else "-" for i in ("fused", "fused_interleave", "fused_auto")]
        f = r.get("fused")
        vs_fi = [f"{r['flashinfer']['us'] / f['us']:.2f}x" if f and "flashinfer" in r else "-"] * flashinfer
        rates = [f"{f['kv_tb_per_s']:.2f}", f"{f['prefix_tflop_per_s']:.1f}"] if f else ["-", "-"]
        lines.append(f"| {p}/{d}/{g} | {sc} | " + " | ".join([cell(i) for i in impls] + vs_plain + vs_fi + rates) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="attention.json")
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--scenarios", choices=("shared", "dense", "all"), default="all",
                        help="shared: the prefix-sharing decode and mixed scenarios; dense: causal attention "
                             "without sharing against SDPA's cuDNN and flash backends; all: both (default)")
    args = parser.parse_args(argv)
    if args.dry_run:
        global NUM_DECODE, NUM_CHUNKS, CHUNK_TOKENS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
        NUM_DECODE, NUM_CHUNKS, CHUNK_TOKENS = 4, 1, 8
        NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 32
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/attention.py needs a CUDA device")
    run(args)


if __name__ == "__main__":
    main()
