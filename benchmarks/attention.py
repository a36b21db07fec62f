"""Attention kernel benchmark (BatchLLM section 6.3.3 settings), one process on one GPU; every
output is validated against a float32 reference first. Rows, implementations and tables:
BENCHMARKS.md, "Attention kernels" and "Dense causal attention against cuDNN".

--scenarios shared: pure decode of 256 requests, and chunked prefill (7 prefill chunks + 256 decode
requests), over prefix/distinct/group-size settings: ours (fused in cost, interleave and the
engine's auto order; plain, without sharing knowledge), PyTorch SDPA on gathered KV (gather
included or not) and FlashInfer's 2-level cascade (decode, where installed).
--scenarios dense: causal self-attention without sharing and the last 2048 rows of a 16384-token
context (with and without a shared prefix): ours, with and without dense calls, against SDPA's
cuDNN and flash backends at their best settings. --scenarios all: both.

Usage: PYTHONPATH=. python3 benchmarks/attention.py --out results.json [--markdown table.md]
  [--scenarios shared|dense|all]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
import time
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
import triton
import triton.testing

from batchllm.attention_plan.tile_config import TileConfig, default_tile_config
from batchllm.ops.prefix_attention import prefix_shared_attention
from batchllm.ops.reference import kv_slots_of_seq, paged_attention_reference
from batchllm.perf.runner import git_commit
from batchllm.attention_plan.work_list import DEFAULT_WORK_ORDER, build_prefix_shared_plan
from batchllm.ops.plan_device import device_num_sms, plan_to_device
from tests.op_references import dense_reference
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
    seqs, q = [], min(CHUNK_TOKENS, distinct)
    for g in range(num_groups):
        # prefill chunks: members' first distinct chunks, spread over the groups
        seqs += [SeqSpec(q, prefix + q, prefix, g) for c in range(NUM_CHUNKS) if mixed and c % num_groups == g]
        for _ in range(group_size):
            d = int(round(distinct * rng.uniform(0.25, 1.75))) if jitter else distinct  # noqa: RUF046
            seqs.append(SeqSpec(1, prefix + max(d, 1), prefix, g))
    return seqs


def synthetic_step(seqs, dtype, dev):
    return make_batch(seqs, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                      dtype=dtype, device=dev)


def device_plan(meta: dict, tile: TileConfig, dev, **kw):
    """The step's work list on the device, as build_prefix_shared_plan makes it for the engine."""
    return plan_to_device(build_prefix_shared_plan(**meta, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                                                   num_heads=NUM_HEADS, head_dim=HEAD_DIM, tile=tile,
                                                   num_sms=device_num_sms(dev), **kw), dev)


def bench_us(fn, rep_ms=60) -> float:
    if not torch.cuda.is_available():  # --dry-run on CPU: one timed call
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return float(triton.testing.do_bench(fn, warmup=15, rep=rep_ms)) * 1e3


class Sdpa:
    """Dense SDPA per request: decode rows batched (padded, masked), prefill chunks one by one."""

    def __init__(self, b, seqs, scale):
        self.b, self.scale = b, scale
        lens, shared, starts = b.seq_lens.tolist(), b.shared_kv_lens.tolist(), b.query_start_loc.tolist()
        dev = b.query.device
        flat = lambda s: kv_slots_of_seq(b.block_tables[s], lens[s], shared[s], BLOCK_SIZE)  # noqa: E731
        self.decode = [s for s, x in enumerate(seqs) if x.q_len == 1]
        self.chunks = [s for s, x in enumerate(seqs) if x.q_len > 1]
        max_len = max(lens[s] for s in self.decode)
        self.decode_slots = torch.zeros(len(self.decode), max_len, dtype=torch.long, device=dev)
        self.mask = torch.zeros(len(self.decode), 1, 1, max_len, dtype=torch.bool, device=dev)
        for i, s in enumerate(self.decode):
            self.decode_slots[i, :lens[s]] = flat(s)
            self.mask[i, ..., :lens[s]] = True
        self.decode_rows = torch.tensor([starts[s] for s in self.decode], device=dev)
        self.chunk_slots = [flat(s) for s in self.chunks]
        self.chunk_rows = [(starts[s], starts[s + 1]) for s in self.chunks]
        self.gathered = None

    def __call__(self, use_pregathered=False):
        """use_pregathered: on K / V gathered once, at the first such call (the gather not timed)."""
        if use_pregathered and self.gathered is None:
            self.gathered = (gather_kv(self.b, self.decode_slots), [gather_kv(self.b, s) for s in self.chunk_slots])
        q_all, out = self.b.query, torch.empty_like(self.b.query)
        dk, ck = self.gathered if use_pregathered else (gather_kv(self.b, self.decode_slots), None)
        q = q_all[self.decode_rows][:, :, None, :]  # [R, H, 1, D]
        o = F.scaled_dot_product_attention(q, dk[0], dk[1], attn_mask=self.mask, scale=self.scale, enable_gqa=True)
        out[self.decode_rows] = o[:, :, 0]
        for i, (r0, r1) in enumerate(self.chunk_rows):
            k, v = ck[i] if use_pregathered else gather_kv(self.b, self.chunk_slots[i])
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


def kv_bytes_unique(seqs, bytes_per_value: int = 2) -> float:
    """K and V bytes the decode rows read, each group's prefix once."""
    prefix = {s.group_id: s.shared_kv_len for s in seqs}
    own = sum(s.seq_len - s.shared_kv_len for s in seqs if s.q_len == 1)
    return (sum(prefix.values()) + own) * NUM_KV_HEADS * HEAD_DIM * 2 * bytes_per_value


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
                err, us = (fn().float() - ref).abs().max().item(), bench_us(fn)
            except Exception as exc:  # noqa: BLE001
                notes.append(f"{name}{tag} failed on {where}: {exc!r}"[:600])
                continue
            if variant_us is not None:
                variant_us.setdefault(name, {})[tag] = round(us, 2)
            if best is None or (err < VALID_MAX_ABS_ERR, -us) > (best[1] < VALID_MAX_ABS_ERR, -best[0]):
                best = (us, err, tag)
        timings.update({name: best} if best else {})
    return timings


def _main_timings(b, seqs, ref, scale, tile: TileConfig, with_flashinfer: bool, notes: list, where: str) -> dict:
    """Our kernels under the engine's tile config, SDPA, FlashInfer."""
    meta, dev = b.metadata_numpy(), b.query.device
    plans = {name: device_plan(meta, tile, dev, order=order)
             for name, order in (("fused", "cost"), ("fused_interleave", "interleave"), ("fused_auto", "auto"))}
    plans["plain"] = device_plan({**meta, "group_ids": None, "is_prefix": None}, tile, dev)  # no groups: plain paged
    impls = {name: [("default", lambda p=p: prefix_shared_attention(b.query, b.k_cache, b.v_cache, p, scale))]
             for name, p in plans.items()}
    sdpa = Sdpa(b, seqs, scale)
    impls["sdpa"] = [("", lambda: sdpa(False))]
    if with_flashinfer:
        try:
            impls["flashinfer"] = [("", flashinfer_cascade(b, seqs, scale))]
        except Exception as exc:  # noqa: BLE001
            notes.append(f"flashinfer plan failed on {where}: {exc!r}")
    impls["sdpa_nogather"] = [("", lambda: sdpa(True))]
    return _time_impls(impls, ref, notes, where)


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
    lens, shared = b.seq_lens.tolist(), b.shared_kv_lens.tolist()
    slots = torch.stack([kv_slots_of_seq(b.block_tables[s], lens[s], shared[s], BLOCK_SIZE) for s in range(len(seqs))])
    rep = NUM_HEADS // NUM_KV_HEADS
    k, v = gather_kv(b, slots)  # [B, Hkv, L, D]
    return k.repeat_interleave(rep, dim=1).contiguous(), v.repeat_interleave(rep, dim=1).contiguous()


def _sdpa_backend_fn(backend_name: str, q, k, v, scale, enable_gqa: bool = False):
    """One SDPA call with only `backend_name` allowed, output in the packed layout; enable_gqa:
    k / v hold the KV heads only (grouped-query attention inside the kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    q_len, context = q.shape[2], k.shape[2]
    mask_kw = {"is_causal": True} if q_len == context else {"attn_mask": causal_lower_right(q_len, context)}

    def fn():
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=enable_gqa, **mask_kw)
        return o.transpose(1, 2).reshape(-1, q.shape[1], q.shape[3])
    return fn


def _cudnn_op_fn(q, k, v, scale):
    """cuDNN's attention op called directly, the KV heads as they are (square causal shapes only:
    its causal mask is unambiguous there), output in the packed layout."""
    def fn():
        o = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, True, False, scale=scale)[0]
        return o.transpose(1, 2).reshape(-1, q.shape[1], q.shape[3])
    return fn


def token_major(t: torch.Tensor) -> torch.Tensor:
    """[B, H, L, D] values stored token-major ([B, L, H, D] in memory, as the engine's rows are)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def sdpa_variants(backend_name: str, q, k, v, scale) -> list[tuple[str, object]]:
    """The peer's settings (its row: the fastest valid one): KV heads repeated, enable_gqa and, for
    cuDNN on squares, its op called directly; each head-major and token-major ("bshd_", whose
    output is already in the packed layout). q, k, v: [B, query heads, L, D], KV heads repeated."""
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
        b = synthetic_step(seqs, dtype, dev)
        k, v = dense_kv(b, seqs)
        q = b.query.view(batch, q_len, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        ref = dense_reference(q, k, v, scale)
        impls = {"batchllm": [(tag, lambda p=device_plan(b.metadata_numpy(), cfg, dev, order="auto"):
                               prefix_shared_attention(b.query, b.k_cache, b.v_cache, p, scale))
                              for tag, cfg in configs.items()]}
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


def save(result: dict, path: str, t_start: float) -> None:
    result["wall_s"] = round(time.time() - t_start, 1)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


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
    have_flashinfer = importlib.util.find_spec("flashinfer") is not None
    tile = default_tile_config(HEAD_DIM, NUM_HEADS // NUM_KV_HEADS)
    result["tile_configs"] = {"default": vars(tile)}
    t_start = time.time()
    if args.scenarios in ("dense", "all"):
        result["tile_configs"] = {t: vars(c) for t, c in run_dense(args, dev, dtype, scale, tile, rows, notes).items()}
    scenarios = [(setting, mode, jitter) for setting in (DRY_SETTINGS if args.dry_run else SETTINGS)
                 for mode, jitter in MODES] if args.scenarios in ("shared", "all") else []
    for (prefix, distinct, group), mode, jitter in scenarios:
        seqs = scenario_seqs(prefix, distinct, group, mode.startswith("mixed"), jitter)
        b = synthetic_step(seqs, dtype, dev)
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
        save(result, args.out, t_start)
        del b, ref
        if dev == "cuda":
            torch.cuda.empty_cache()
    save(result, args.out, t_start)
    kinds = {r["scenario"] if r["scenario"] == "dense" else "shared" for r in rows}
    tables = [table(result) for kind, table in (("shared", markdown_table), ("dense", dense_markdown_table))
              if kind in kinds]
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(tables))
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
