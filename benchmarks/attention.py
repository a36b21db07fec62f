"""Attention kernel benchmark (issue 4, BatchLLM section 6.3.3 settings), one process on one GPU.

Scenarios: pure decode of 256 requests, and chunked prefill (7 prefill chunks + 256 decode
requests), over prefix/distinct/group-size settings, with and without jittered distinct
lengths. Implementations, all validated against the float32 reference first:
  fused      ours, one launch of prefix + distinct tiles, then the LSE merge kernel
  separate   ours, cascade style: prefix launch, distinct launch, merge
  plain      ours without sharing knowledge (each request reads its whole KV)
  sdpa       PyTorch SDPA on KV gathered per request from the paged cache (gather included)
  sdpa_nogather  the same SDPA calls on pre-gathered dense KV (gather excluded)
  flashinfer FlashInfer MultiLevelCascadeAttentionWrapper (2 levels), decode scenarios only
The Triton implementations each get the best of a few tile configs (the autotune step).

Usage: PYTHONPATH=. python3 benchmarks/attention.py --out results.json [--markdown table.md] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time

import numpy as np
import torch

from batchllm.ops.paged_attention import build_paged_plan
from batchllm.ops.prefix_attention import prefix_shared_attention, prefix_shared_attention_separate
from batchllm.ops.reference import paged_attention_reference
from batchllm.ops.synthetic_batch import SeqSpec, make_batch
from batchllm.ops.tile_config import candidate_tile_configs
from batchllm.ops.work_list import build_prefix_shared_plan

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3.1-8B
NUM_DECODE, NUM_CHUNKS, CHUNK_TOKENS = 256, 7, 512
SETTINGS = [(2048, 256, 16), (2048, 256, 4), (4096, 512, 64), (256, 2048, "all")]
DRY_SETTINGS = [(40, 20, "all"), (33, 16, 2)]  # --dry-run (CPU interpreter) with NUM_DECODE = 4


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
            d = int(round(distinct * rng.uniform(0.25, 1.75))) if jitter else distinct
            seqs.append(SeqSpec(1, prefix + max(d, 1), prefix, g))
    return seqs


def bench_us(fn, rep_ms=60) -> float:
    if not torch.cuda.is_available():  # --dry-run on CPU: one timed call
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=15, rep=rep_ms)) * 1e3


class Sdpa:
    """Dense SDPA per request: decode rows batched (padded, masked), prefill chunks one by one."""

    def __init__(self, b, seqs, scale):
        self.b, self.scale = b, scale
        lens, shared = b.seq_lens.tolist(), b.shared_kv_lens.tolist()
        starts = b.query_start_loc.tolist()
        dev = b.query.device
        flat = lambda s: torch.as_tensor(  # noqa: E731
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
        k = self.b.k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots]  # [..., L, Hkv, D]
        v = self.b.v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots]
        return k.transpose(-3, -2), v.transpose(-3, -2)

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
    ceil = lambda a: -(-a // BLOCK_SIZE)  # noqa: E731
    last = lambda n: n - (ceil(n) - 1) * BLOCK_SIZE if n else 0  # noqa: E731
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
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
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


def run(args):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    scale = HEAD_DIM ** -0.5
    rows, notes = [], []
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "git_commit": args.git_commit or commit or "unknown", "dtype": "bfloat16",
              "heads": f"{NUM_HEADS}q/{NUM_KV_HEADS}kv d{HEAD_DIM} page {BLOCK_SIZE}", "rows": rows, "notes": notes}
    try:
        import flashinfer  # noqa: F401
        have_flashinfer = True
    except Exception as exc:  # noqa: BLE001
        have_flashinfer = False
        notes.append(f"flashinfer not importable: {exc!r}")
    configs = candidate_tile_configs(HEAD_DIM, NUM_HEADS // NUM_KV_HEADS)
    if args.quick:
        configs = configs[:1]
    modes = [("decode", False), ("decode_jitter", True), ("mixed", False), ("mixed_jitter", True)]
    t_start = time.time()
    for prefix, distinct, group in (DRY_SETTINGS if args.dry_run else SETTINGS):
        for mode, jitter in modes:
            if time.time() - t_start > args.budget_s:
                notes.append(f"time budget hit before {mode} {prefix}/{distinct}/{group}")
                break
            seqs = scenario_seqs(prefix, distinct, group, mode.startswith("mixed"), jitter)
            b = make_batch(seqs, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                           block_size=BLOCK_SIZE, dtype=dtype, device=dev)
            meta = b.metadata_numpy()
            ref = paged_attention_reference(b.query, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens,
                                            b.shared_kv_lens, b.block_tables, scale).float()
            impls = {}
            for cfg_i, cfg in enumerate(configs):
                shared_plan = build_prefix_shared_plan(**meta, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                                                       num_heads=NUM_HEADS, head_dim=HEAD_DIM, tile=cfg).to(dev)
                plain_plan = build_paged_plan(meta["query_start_loc"], meta["seq_lens"], meta["shared_kv_lens"],
                                              meta["block_tables"], block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                                              num_heads=NUM_HEADS, head_dim=HEAD_DIM, tile=cfg).to(dev)
                for name, fn in (
                    ("fused", lambda p=shared_plan: prefix_shared_attention(b.query, b.k_cache, b.v_cache, p, scale)),
                    ("separate", lambda p=shared_plan: prefix_shared_attention_separate(b.query, b.k_cache, b.v_cache, p, scale)),
                    ("plain", lambda p=plain_plan: prefix_shared_attention(b.query, b.k_cache, b.v_cache, p, scale)),
                ):
                    impls.setdefault(name, []).append((f"cfg{cfg_i}", fn))
            sdpa = Sdpa(b, seqs, scale)
            impls["sdpa"] = [("", lambda: sdpa(False))]
            if have_flashinfer and not mode.startswith("mixed"):
                try:
                    impls["flashinfer"] = [("", flashinfer_cascade(b, seqs, scale))]
                except Exception as exc:  # noqa: BLE001
                    notes.append(f"flashinfer plan failed on {prefix}/{distinct}/{group} {mode}: {exc!r}")
            timings = {}
            for name, variants in impls.items():
                best = None
                for tag, fn in variants:
                    try:
                        err = (fn().float() - ref).abs().max().item()
                        us = bench_us(fn)
                    except Exception as exc:  # noqa: BLE001
                        notes.append(f"{name}{tag} failed on {prefix}/{distinct}/{group} {mode}: {exc!r}"[:400])
                        continue
                    if best is None or us < best[0]:
                        best = (us, err, tag)
                if best:
                    timings[name] = best
            try:
                sdpa.pregather()
                err = (sdpa(True).float() - ref).abs().max().item()
                timings["sdpa_nogather"] = (bench_us(lambda: sdpa(True)), err, "")
            except Exception as exc:  # noqa: BLE001
                notes.append(f"sdpa_nogather failed: {exc!r}"[:300])
            del sdpa
            t_sep = timings.get("separate", (float("nan"),))[0]
            t_plain = timings.get("plain", (float("nan"),))[0]
            for name, (us, err, tag) in timings.items():
                row = {"scenario": mode, "prefix": prefix, "distinct": distinct, "group": group, "impl": name,
                       "us": round(us, 2), "speedup_vs_separate": round(t_sep / us, 3),
                       "speedup_vs_plain": round(t_plain / us, 3), "max_abs_err": err, "valid": err < 5e-2,
                       "config": tag, "kv_tb_per_s": round(kv_bytes_unique(seqs) / us / 1e6, 3),
                       "prefix_tflop_per_s": round(prefix_flops(seqs) / us / 1e6, 2)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            del b, ref, impls
            torch.cuda.empty_cache()
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_table(result))
    return result


def markdown_table(result) -> str:
    by_key = {}
    for r in result["rows"]:
        by_key.setdefault((r["prefix"], r["distinct"], r["group"], r["scenario"]), {})[r["impl"]] = r
    impls = ["fused", "separate", "plain", "sdpa", "sdpa_nogather", "flashinfer"]
    lines = ["| prefix/distinct/group | scenario | " + " | ".join(f"{i} us" for i in impls)
             + " | fused vs separate | fused vs plain | fused vs flashinfer | fused KV TB/s | fused prefix TFLOP/s |",
             "|" + "---|" * (len(impls) + 7)]
    for (p, d, g, sc), r in by_key.items():
        cell = lambda i: (f"{r[i]['us']:.1f}" + ("" if r[i]["valid"] else " (INVALID)")) if i in r else "-"  # noqa: E731
        f = r.get("fused")
        vs_fi = f"{r['flashinfer']['us'] / f['us']:.2f}x" if f and "flashinfer" in r else "-"
        lines.append(f"| {p}/{d}/{g} | {sc} | " + " | ".join(cell(i) for i in impls)
                     + (f" | {f['speedup_vs_separate']:.2f}x | {f['speedup_vs_plain']:.2f}x | {vs_fi} | "
                        f"{f['kv_tb_per_s']:.2f} | {f['prefix_tflop_per_s']:.1f} |" if f else " | - | - | - | - | - |"))
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/attention.json")
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--quick", action="store_true", help="one tile config only")
    parser.add_argument("--git-commit", default=None, help="commit id to record (when .git is absent)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop starting new scenarios after this")
    args = parser.parse_args(argv)
    if args.dry_run:
        global NUM_DECODE, NUM_CHUNKS, CHUNK_TOKENS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
        NUM_DECODE, NUM_CHUNKS, CHUNK_TOKENS = 4, 1, 8
        NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 32
        args.quick = True
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/attention.py needs a CUDA device")
    run(args)


if __name__ == "__main__":
    main()
