"""Triton kernels of the paged attention family (BatchLLM section 5).

One program = one work item (see attention_plan/work_list.py) x one KV head. The tile packs
rows x the GQA query heads of that KV head into the M dimension (m -> row m // GROUP, head
m % GROUP, so a group of 3 wastes at most one padded slot), streams the item's KV range from the paged cache
in BLOCK_N steps and runs online softmax with tl.dot (base-2 exponentials; the stored
partial LSE is base 2, converted only where it leaves the package).

KV_FP8: the cache is float8_e4m3fn. Each K / V tile is converted in registers right after its
load (exact: every e4m3 value is a float16 / bfloat16 one); the host folds the K scale into
qk_scale_log2, and the V scale multiplies the output at its normalisation. Without KV_FP8 none of
that is compiled. FP8_AS_F16 (with KV_FP8): the tiles become float16 and the MMAs run in float16,
the query tile scaled once into float16's range by a power of two (exact for every value down to
2^-31 of the tile's largest) and the probabilities rounded to float16 (finer than bfloat16); sm_90
converts two e4m3 values to float16 in one instruction, to bfloat16 in three. Otherwise the tiles
become the query dtype. FP8_PTX (with FP8_AS_F16): the V tile is converted by that instruction as
inline PTX right after its load. Triton moves its own conversion past the layout change into the
MMA operand layout, where V, whose MMA operand runs along positions rather than along the
contiguous head dimension, is read from shared memory a byte at a time; the opaque PTX step keeps
the conversion where it is, and V's operand is read as float16 with ldmatrix. K (its operand runs
along the contiguous head dimension) keeps Triton's conversion, which leaves its load to Triton's
pipelining through shared memory: on the H200, 600 decode rows over about 1,200 FP8 positions read
the cache at 2.77 TB/s with this split, against 2.21 with both tiles converted by PTX and 2.45
with neither.

WINDOWED: the model has a sliding window; each row also reads its position, and a tile runs a
third, masked KV loop below its rows' window starts. Without WINDOWED none of that is compiled.
As a runtime branch on `window` (compiled into every launch) it made dense causal attention
16-22% slower on the H200 (benchmarks/attention.py --scenarios dense: 268-332 TFLOP/s compiled
out, 224-270 with the branch, in one run) and the 16000-token micro set 6% slower end to end.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _from_e4m3(x, dtype: tl.constexpr, PTX: tl.constexpr):
    """An e4m3 tile in `dtype` (exact); PTX: float16 by cvt.rn.f16x2.e4m3x2, four values a step,
    not pure so that Triton does not move it (the module's docstring)."""
    if PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)
    else:
        return x.to(dtype)


@triton.jit
def _kv_offsets(blocks_ptr, rel, n_valid, head_off, stride_cb, stride_cs, PAGE: tl.constexpr, MASKED: tl.constexpr):
    """Cache offsets of one KV step's positions, `rel` counted from the table entry at blocks_ptr;
    MASKED: positions off n_valid read table entry 0."""
    if MASKED:
        block = tl.load(blocks_ptr + rel // PAGE, mask=n_valid, other=0).to(tl.int64)
    else:
        block = tl.load(blocks_ptr + rel // PAGE).to(tl.int64)
    return block * stride_cb + (rel % PAGE) * stride_cs + head_off


@triton.jit
def _qk_scores(q, k_cache_ptr, kv_off, n_valid, qk_scale_log2, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
               KV_FP8: tl.constexpr, MASKED: tl.constexpr):
    """Base-2 scores [BLOCK_M, BLOCK_N] of the query tile against the K tile at kv_off (MASKED:
    positions off n_valid are not read)."""
    offs_d = tl.arange(0, HEAD_DIM)
    if MASKED:
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_valid[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :])
    if KV_FP8:  # dequantize: the K scale is in qk_scale_log2
        k = _from_e4m3(k, q.dtype, False)
    return tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2


@triton.jit
def _softmax_update(
    s, m_i, l_i, acc, v_cache_ptr, kv_off, n_valid, dtype: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, FP8_PTX: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The online-softmax step of scores s (masked ones -inf) over the V tile at kv_off. MASKED:
    positions off n_valid are not read, and a row that has seen no position keeps zero weight."""
    offs_d = tl.arange(0, HEAD_DIM)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_valid[:, None], other=0.0)
    else:
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :])
    if KV_FP8:  # dequantize: the V scale multiplies the output (_normalised)
        v = _from_e4m3(v, dtype, FP8_PTX)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _kv_steps(
    q, m_i, l_i, acc, limit, first, k_cache_ptr, v_cache_ptr, table_row, head_off, base_block, base_pos,
    n_begin, n_end, kv_end, qk_scale_log2, stride_cb, stride_cs,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_PTX: tl.constexpr, MASKED: tl.constexpr, WINDOWED: tl.constexpr,
):
    """Online softmax over KV positions [n_begin, n_end) in BLOCK_N steps; a packed row sees
    positions in [first, limit) (WINDOWED; else [0, limit), and `first` is never read).
    MASKED=False: every packed row sees every position of the range (no bounds or limit checks,
    no -inf guard)."""
    for n0 in range(n_begin, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_end  # read only when MASKED
        kv_off = _kv_offsets(table_row + base_block, offs_n - base_pos, n_valid, head_off, stride_cb, stride_cs,
                             PAGE, MASKED)
        s = _qk_scores(q, k_cache_ptr, kv_off, n_valid, qk_scale_log2, HEAD_DIM, DOT_PRECISION, KV_FP8, MASKED)
        if MASKED:
            visible = offs_n[None, :] < limit[:, None]
            if WINDOWED:
                visible = visible & (offs_n[None, :] >= first[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _softmax_update(s, m_i, l_i, acc, v_cache_ptr, kv_off, n_valid, q.dtype, HEAD_DIM,
                                        DOT_PRECISION, KV_FP8, FP8_PTX, MASKED)
    return m_i, l_i, acc


@triton.jit
def _normalised(acc, l_i, v_scale, KV_FP8: tl.constexpr):
    """The rows' outputs, the V scale applied (zero for a row that saw no position)."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    if KV_FP8:
        return (acc * v_scale) / l_safe[:, None]
    else:
        return acc / l_safe[:, None]


@triton.jit
def _lse2(m_i, l_i):
    """The rows' base-2 log-sum-exp (-inf for a row that saw no position)."""
    return tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))


@triton.jit
def _query_as_f16(q, qk_scale_log2):
    """The query tile times 2^e in float16, its largest |value| in [2^14, 2^15) (a power of two:
    exact for every value down to 2^-31 of the largest; no overflow), and the softmax scale over
    2^e. A tile whose largest |value| is below 2^-113 (all zero: padding) keeps e = 0."""
    q_max = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
    exponent = q_max.to(tl.int32, bitcast=True) >> 23  # biased float32 exponent of q_max (>= 0)
    scale = tl.where(exponent >= 14, ((268 - exponent) << 23).to(tl.float32, bitcast=True), 1.0)
    return (q.to(tl.float32) * scale).to(tl.float16), qk_scale_log2 / scale


@triton.jit
def _attend_tile(
    q_ptr, out_ptr, part_out_ptr, part_lse_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, limit_ptr, pos_ptr,
    q_start, q_count, seq, kv_start, kv_end, base_block, base_pos, mask_mode, q_pos0, partial_base,
    kv_head, qk_scale_log2, v_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_table,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    FP8_AS_F16: tl.constexpr, FP8_PTX: tl.constexpr, WINDOWED: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    m_valid = row < q_count
    token = (q_start + row).to(tl.int64)
    # q: [BLOCK_M, HEAD_DIM] (rows x packed GQA heads)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_valid[:, None], other=0.0)
    if KV_FP8 and FP8_AS_F16:
        q, qk_scale_log2 = _query_as_f16(q, qk_scale_log2)
    # KV positions each packed row may see: < limit. [lo, hi): the least and the most any valid
    # row of the tile sees.
    if mask_mode == 1:
        limit = q_pos0 + row + 1
        lo = q_pos0 + 1
        hi = q_pos0 + q_count
    elif mask_mode == 2:
        limit = tl.load(limit_ptr + token, mask=m_valid, other=0)
        lo = tl.min(tl.where(m_valid, limit, kv_end), 0)
        hi = tl.max(tl.where(m_valid, limit, 0), 0)
    else:
        limit = tl.zeros([BLOCK_M], dtype=tl.int32) + kv_end
        lo = kv_end
        hi = kv_end
    limit = tl.minimum(limit, kv_end)
    hi = tl.minimum(hi, kv_end)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table_row = tables_ptr + seq.to(tl.int64) * stride_table
    head_off = kv_head * stride_ch
    # whole BLOCK_N steps below every row's limit run unmasked; the rest up to hi masked
    full_end = kv_start + (tl.maximum(tl.minimum(lo, kv_end) - kv_start, 0) // BLOCK_N) * BLOCK_N
    if WINDOWED:
        # Sliding window: a row at position p sees positions >= p - window + 1 as well. Steps
        # below every row's first position are skipped; steps that start below some row's are
        # masked; whole steps inside every row's [first, limit) run unmasked.
        first = tl.load(pos_ptr + token, mask=m_valid, other=0).to(tl.int32) - window + 1
        first_lo = tl.min(tl.where(m_valid, first, kv_end), 0)
        first_hi = tl.max(tl.where(m_valid, first, kv_start), 0)
        n_start = kv_start + (tl.maximum(first_lo - kv_start, 0) // BLOCK_N) * BLOCK_N
        full_begin = kv_start + tl.cdiv(tl.maximum(first_hi - kv_start, 0), BLOCK_N) * BLOCK_N
        full_begin = tl.minimum(full_begin, full_end)
        m_i, l_i, acc = _kv_steps(q, m_i, l_i, acc, limit, first, k_cache_ptr, v_cache_ptr, table_row, head_off,
                                  base_block, base_pos, n_start, full_begin, kv_end, qk_scale_log2, stride_cb,
                                  stride_cs, HEAD_DIM, PAGE, BLOCK_N, DOT_PRECISION, KV_FP8, FP8_PTX, True, True)
        full_begin = tl.maximum(full_begin, n_start)
        full_end = tl.maximum(full_end, n_start)
    else:
        # without a window no row has a first position: the masked steps are only those at the end
        first = limit
        full_begin = kv_start
    m_i, l_i, acc = _kv_steps(q, m_i, l_i, acc, limit, first, k_cache_ptr, v_cache_ptr, table_row, head_off,
                              base_block, base_pos, full_begin, full_end, kv_end, qk_scale_log2, stride_cb,
                              stride_cs, HEAD_DIM, PAGE, BLOCK_N, DOT_PRECISION, KV_FP8, FP8_PTX, False, WINDOWED)
    m_i, l_i, acc = _kv_steps(q, m_i, l_i, acc, limit, first, k_cache_ptr, v_cache_ptr, table_row, head_off,
                              base_block, base_pos, full_end, hi, kv_end, qk_scale_log2, stride_cb, stride_cs,
                              HEAD_DIM, PAGE, BLOCK_N, DOT_PRECISION, KV_FP8, FP8_PTX, True, WINDOWED)

    o = _normalised(acc, l_i, v_scale, KV_FP8)
    if partial_base < 0:
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_valid[:, None])
    else:
        slot = (partial_base + row).to(tl.int64) * NUM_HEADS + head  # [BLOCK_M]
        tl.store(part_out_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], o, mask=m_valid[:, None])
        tl.store(part_lse_ptr + slot, _lse2(m_i, l_i), mask=m_valid)


@triton.jit
def _attend_packed(
    pack_id, num_items, work_ptr, q_ptr, out_ptr, part_out_ptr, part_lse_ptr, k_cache_ptr, v_cache_ptr, tables_ptr,
    kv_head, qk_scale_log2, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_table,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    WORK_FIELDS: tl.constexpr, PACK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, FP8_AS_F16: tl.constexpr, FP8_PTX: tl.constexpr,
):
    """PACK one-row, unmasked work items (items pack_id * PACK ...) x one KV head in one tile:
    M holds BLOCK_M // PACK slots per item for its GQA heads (m -> item m // SLOT, head m % SLOT,
    slots past GROUP padding), and each KV step reads BLOCK_N // PACK positions of every item
    (n -> item n // SUB_N); a block-diagonal mask keeps each item's rows on its own positions.
    The items' latency chains (work fields, table, first tiles) overlap in one pipelined loop
    instead of running one after another."""
    SUB_N: tl.constexpr = BLOCK_N // PACK
    SLOT: tl.constexpr = BLOCK_M // PACK
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    item_m = pack_id * PACK + offs_m // SLOT
    valid_m = (item_m < num_items) & (offs_m % SLOT < GROUP)
    w_m = work_ptr + item_m.to(tl.int64) * WORK_FIELDS
    token = tl.load(w_m + 0, mask=valid_m, other=0).to(tl.int64)
    len_m = tl.load(w_m + 4, mask=valid_m, other=0) - tl.load(w_m + 3, mask=valid_m, other=0)
    partial_base = tl.load(w_m + 9, mask=valid_m, other=-1)
    head = kv_head * GROUP + tl.where(valid_m, offs_m % SLOT, 0)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=valid_m[:, None], other=0.0)
    if KV_FP8 and FP8_AS_F16:
        q, qk_scale_log2 = _query_as_f16(q, qk_scale_log2)
    # each KV column's item and its place among that item's positions of a step
    item_n = pack_id * PACK + offs_n // SUB_N
    valid_n = item_n < num_items
    w_n = work_ptr + item_n.to(tl.int64) * WORK_FIELDS
    table_n = (tables_ptr + tl.load(w_n + 2, mask=valid_n, other=0).to(tl.int64) * stride_table
               + tl.load(w_n + 5, mask=valid_n, other=0))
    start_n = tl.load(w_n + 3, mask=valid_n, other=0) + offs_n % SUB_N
    end_n = tl.load(w_n + 4, mask=valid_n, other=0)
    base_pos_n = tl.load(w_n + 6, mask=valid_n, other=0)
    own = (offs_m // SLOT)[:, None] == (offs_n // SUB_N)[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    head_off = kv_head * stride_ch
    for step in range(0, tl.cdiv(tl.max(len_m, 0), SUB_N)):
        pos = start_n + step * SUB_N
        n_valid = pos < end_n
        kv_off = _kv_offsets(table_n, pos - base_pos_n, n_valid, head_off, stride_cb, stride_cs, PAGE, True)
        s = _qk_scores(q, k_cache_ptr, kv_off, n_valid, qk_scale_log2, HEAD_DIM, DOT_PRECISION, KV_FP8, True)
        s = tl.where(own & n_valid[None, :], s, float("-inf"))
        m_i, l_i, acc = _softmax_update(s, m_i, l_i, acc, v_cache_ptr, kv_off, n_valid, q.dtype, HEAD_DIM,
                                        DOT_PRECISION, KV_FP8, FP8_PTX, True)
    o = _normalised(acc, l_i, v_scale, KV_FP8)
    direct = valid_m & (partial_base < 0)
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=direct[:, None])
    parted = valid_m & (partial_base >= 0)
    slot = tl.where(parted, partial_base.to(tl.int64) * NUM_HEADS + head, 0)
    tl.store(part_out_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], o, mask=parted[:, None])
    tl.store(part_lse_ptr + slot, _lse2(m_i, l_i), mask=parted)


@triton.jit
def _lse_combine(m, l, acc, lse, part):
    """Fold one partial (normalised output `part`, base-2 LSE `lse`) into a running
    log-sum-exp merge (max m, weight sum l, weighted sum acc); -inf parts weigh nothing."""
    m_new = tl.maximum(m, lse)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    weight = tl.exp2(lse - m_safe)
    return m_new, l * alpha + weight, acc * alpha[:, None] + part * weight[:, None]


@triton.jit
def _work_item(
    pid, work_ptr, q_ptr, out_ptr, part_out_ptr, part_lse_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, limit_ptr,
    pos_ptr, qk_scale_log2, v_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_table,
    NUM_KV_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    WORK_FIELDS: tl.constexpr,
    SMALL_M: tl.constexpr, SMALL_N: tl.constexpr, BIG_M: tl.constexpr, BIG_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, CLASSES: tl.constexpr, KV_FP8: tl.constexpr, FP8_AS_F16: tl.constexpr,
    FP8_PTX: tl.constexpr, WINDOWED: tl.constexpr,
):
    """One (work item, KV head): pid = item * NUM_KV_HEADS + kv_head."""
    item = pid // NUM_KV_HEADS  # KV head fastest: the order of the work list is kept
    kv_head = pid % NUM_KV_HEADS
    w = work_ptr + item.to(tl.int64) * WORK_FIELDS
    q_start = tl.load(w + 0)
    q_count = tl.load(w + 1)
    seq = tl.load(w + 2)
    kv_start = tl.load(w + 3)
    kv_end = tl.load(w + 4)
    base_block = tl.load(w + 5)
    base_pos = tl.load(w + 6)
    mask_mode = tl.load(w + 7)
    q_pos0 = tl.load(w + 8)
    partial_base = tl.load(w + 9)
    size_class = tl.load(w + 10)
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    # CLASSES 1 / 2: a launch of SMALL / BIG items only (the other branch is not compiled, so
    # registers and shared memory, hence occupancy, are those of the one tile class)
    if CLASSES == 1 or (CLASSES == 0 and size_class == 0):
        _attend_tile(q_ptr, out_ptr, part_out_ptr, part_lse_ptr, k_cache_ptr, v_cache_ptr, tables_ptr,
                     limit_ptr, pos_ptr, q_start, q_count, seq, kv_start, kv_end, base_block, base_pos, mask_mode,
                     q_pos0, partial_base, kv_head, qk_scale_log2, v_scale, window,
                     stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
                     stride_table, NUM_HEADS, GROUP, HEAD_DIM, PAGE, SMALL_M, SMALL_N, DOT_PRECISION, KV_FP8,
                     FP8_AS_F16, FP8_PTX, WINDOWED)
    else:
        _attend_tile(q_ptr, out_ptr, part_out_ptr, part_lse_ptr, k_cache_ptr, v_cache_ptr, tables_ptr,
                     limit_ptr, pos_ptr, q_start, q_count, seq, kv_start, kv_end, base_block, base_pos, mask_mode,
                     q_pos0, partial_base, kv_head, qk_scale_log2, v_scale, window,
                     stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
                     stride_table, NUM_HEADS, GROUP, HEAD_DIM, PAGE, BIG_M, BIG_N, DOT_PRECISION, KV_FP8,
                     FP8_AS_F16, FP8_PTX, WINDOWED)


# the block-table width and the item count change from step to step: no recompiles on their
# divisibility by 16
@triton.jit(do_not_specialize=["stride_table", "num_work_items"])
def work_list_attention_kernel(
    work_ptr,  # [num_items, WORK_FIELDS] int32
    num_items_ptr,  # [1] int32: items of work_ptr to run (PERSISTENT; else never read); [2] with
    # SMALL_PACK: then how many of the first ones run one to a program
    num_work_items,  # int: items of work_ptr (read only by a packed SMALL launch that is not PERSISTENT)
    q_ptr,  # [num_tokens, num_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,  # [num_partial_slots, num_heads, head_dim] float32
    part_lse_ptr,  # [num_partial_slots, num_heads] float32, base 2
    k_cache_ptr, v_cache_ptr,  # [num_blocks, PAGE, num_kv_heads, head_dim]
    tables_ptr,  # [num_seqs, max_blocks] int32
    limit_ptr,  # [num_tokens] int32: prefix KV positions visible to each row
    pos_ptr,  # [num_tokens] int64: position of each row (read only with a sliding window)
    qk_scale_log2,  # softmax scale * log2(e), times the K scale with KV_FP8
    v_scale,  # float: the V scale (read only with KV_FP8)
    window,  # sliding window in positions; 0: none
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_table,
    NUM_KV_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    WORK_FIELDS: tl.constexpr,
    SMALL_M: tl.constexpr, SMALL_N: tl.constexpr, BIG_M: tl.constexpr, BIG_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CLASSES: tl.constexpr,  # 0: both tile classes (size_class per item); 1: SMALL only; 2: BIG only
    SMALL_PACK: tl.constexpr,  # with CLASSES 1: one-row items this many to a program (_attend_packed)
    PERSISTENT: tl.constexpr,
    KV_FP8: tl.constexpr,  # the caches are float8_e4m3fn (dequantized in registers)
    FP8_AS_F16: tl.constexpr,  # with KV_FP8: float16 tiles and MMAs (else: the query dtype)
    FP8_PTX: tl.constexpr,  # with FP8_AS_F16: V converted by inline PTX where loaded (GPU only)
    WINDOWED: tl.constexpr,  # window > 0 (compiled only for models with a sliding window)
):
    """Heterogeneous work in ONE launch: prefix tiles and distinct tiles from the work list.

    PERSISTENT=False: one program per (item, KV head). PERSISTENT=True: a fixed grid whose
    programs stride over the first *num_items_ptr items (CUDA graphs: the grid is frozen at
    capture, the item count is not, and a grid sized for the largest step would spend most of a
    small step launching no-op programs)."""
    PACKED: tl.constexpr = CLASSES == 1 and SMALL_PACK > 1
    if PERSISTENT or PACKED:
        # a packed launch runs its first num_unpacked items one to a program (_work_item), the rest
        # SMALL_PACK to one; one that is not persistent packs them all
        num_items = tl.load(num_items_ptr) if PERSISTENT else num_work_items
        num_unpacked = num_items
        if PACKED:
            num_unpacked = tl.load(num_items_ptr + 1) if PERSISTENT else 0
        num_unpacked_programs = num_unpacked * NUM_KV_HEADS
        num_programs = num_unpacked_programs + tl.cdiv(num_items - num_unpacked, SMALL_PACK) * NUM_KV_HEADS
        step = tl.num_programs(0) if PERSISTENT else num_programs
        for pid in tl.range(tl.program_id(0), num_programs, step, num_stages=1):
            if pid < num_unpacked_programs:
                _work_item(pid, work_ptr, q_ptr, out_ptr, part_out_ptr, part_lse_ptr, k_cache_ptr, v_cache_ptr,
                           tables_ptr, limit_ptr, pos_ptr, qk_scale_log2, v_scale, window, stride_qt, stride_qh,
                           stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_table, NUM_KV_HEADS, NUM_HEADS,
                           HEAD_DIM, PAGE, WORK_FIELDS, SMALL_M, SMALL_N, BIG_M, BIG_N, DOT_PRECISION, CLASSES, KV_FP8,
                           FP8_AS_F16, FP8_PTX, WINDOWED)
            elif PACKED:
                packed = pid - num_unpacked_programs
                _attend_packed(packed // NUM_KV_HEADS, num_items - num_unpacked,
                               work_ptr + num_unpacked.to(tl.int64) * WORK_FIELDS, q_ptr, out_ptr, part_out_ptr,
                               part_lse_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, packed % NUM_KV_HEADS,
                               qk_scale_log2, v_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb,
                               stride_cs, stride_ch, stride_table, NUM_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM,
                               PAGE, WORK_FIELDS, SMALL_PACK, SMALL_M, SMALL_N, DOT_PRECISION, KV_FP8, FP8_AS_F16,
                               FP8_PTX)
    else:
        _work_item(tl.program_id(0), work_ptr, q_ptr, out_ptr, part_out_ptr, part_lse_ptr, k_cache_ptr,
                   v_cache_ptr, tables_ptr, limit_ptr, pos_ptr, qk_scale_log2, v_scale, window, stride_qt,
                   stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_table, NUM_KV_HEADS,
                   NUM_HEADS, HEAD_DIM, PAGE, WORK_FIELDS, SMALL_M, SMALL_N, BIG_M, BIG_N, DOT_PRECISION, CLASSES,
                   KV_FP8, FP8_AS_F16, FP8_PTX, WINDOWED)


@triton.jit
def merge_partials_kernel(
    part_out_ptr,  # [num_partial_slots, NUM_HEADS, HEAD_DIM] float32
    part_lse_ptr,  # [num_partial_slots, NUM_HEADS] float32, base 2
    tokens_ptr, offsets_ptr, slots_ptr,  # CSR: row -> its partial slots
    out_ptr,  # [num_tokens, NUM_HEADS, HEAD_DIM]
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Log-sum-exp merge of a row's partial attentions (all heads of one row per program)."""
    i = tl.program_id(0)
    token = tl.load(tokens_ptr + i).to(tl.int64)
    begin = tl.load(offsets_ptr + i)
    end = tl.load(offsets_ptr + i + 1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    h_valid = offs_h < NUM_HEADS
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for j in range(begin, end):
        slot = tl.load(slots_ptr + j).to(tl.int64)
        lse = tl.load(part_lse_ptr + slot * NUM_HEADS + offs_h, mask=h_valid, other=float("-inf"))
        o = tl.load(part_out_ptr + (slot * NUM_HEADS + offs_h)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=h_valid[:, None], other=0.0)
        m, l, acc = _lse_combine(m, l, acc, lse, o)
    o = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=h_valid[:, None])
