"""The torch reference backend: the definition of correct, and the CPU path for half-precision
caches (float32 on CPU goes to the fused kernel in cpu_paged.pyx, which must agree with this one).

Attention gathers pages into a dense buffer and runs scaled_dot_product_attention on it in
float32; SDPA reads the gathered [tokens, Hkv, D] layout as it is, without a transposing copy.
Decode tokens go in groups of sequences with similar context length, each group's K/V small
enough to stay in cache while SDPA reads it back (measured on CPU: faster than one big gather
or one sequence at a time). A sequence with several query tokens goes alone.

With a logit soft-cap (Gemma 2: scores s become softcap * tanh(s / softcap) before the mask and
softmax) SDPA has no place for the tanh, so the same steps are written out in torch ops.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pagegate.kernels.kv_format import as_bytes, dequantize_rows, format_of, quantize_rows
from pagegate.kernels.workspace import scratch

# Gathered K+V bytes per decode group (measured on CPU; see bench/bench_kernels.py).
DECODE_GROUP_BYTES = 8 << 20
# float32 score bytes per query chunk of a soft-capped prefill, whose scores are materialised
CAPPED_SCORE_BYTES = 32 << 20


def check_softcap(softcap: float | None) -> float | None:
    """The soft-cap to apply: None when off (None or 0); a negative or non-finite one is refused."""
    if softcap is None or softcap == 0:
        return None
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a positive number (or None/0 for none), got {softcap}")
    return float(softcap)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter key/value [T, Hkv, D] into their cache slots in the caches' page format; slot -1 marks
    padding and is skipped."""
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    kv_format = format_of(k_cache)
    for cache, new in ((k_cache, key), (v_cache, value)):
        rows = as_bytes(quantize_rows(new, kv_format))
        as_bytes(cache).view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)


def load_pages(cache: torch.Tensor, pages: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Pages [n, block_size, Hkv, D] of a cache in float32, whatever its format."""
    return dequantize_rows(as_bytes(cache).index_select(0, pages).view(cache.dtype), head_dim)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, sliding_window: int | None = None, *, softcap: float | None = None,
                    out: torch.Tensor | None = None, key_ends: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's last q_len tokens over its paged context; `softcap` caps
    the scaled scores to (-softcap, softcap) with a tanh before masking and softmax; `key_ends` [T]: the last
    position each token sees (api.AttentionOps.paged_attention)."""
    softcap = check_softcap(softcap)
    out = torch.empty_like(query) if out is None else out
    lens, starts = seq_lens.tolist(), query_start_loc.tolist()
    q_lens = [end - start for start, end in zip(starts, starts[1:], strict=False)]
    decode = [b for b, q_len in enumerate(q_lens) if q_len == 1]
    if decode:
        _decode(query, k_cache, v_cache, block_tables, decode, lens, starts, scale, sliding_window, softcap, out)
    for b, q_len in enumerate(q_lens):
        if q_len > 1:
            ends = None if key_ends is None else key_ends[starts[b]:starts[b] + q_len].to(query.device)
            _prefill(query, k_cache, v_cache, block_tables[b], lens[b], starts[b], q_len, scale, sliding_window,
                     softcap, out, ends)
    return out


def _first_visible(seq_len: int, q_len: int, sliding_window: int | None) -> int:
    """The first context position any of the sequence's queries can see."""
    return 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1)


def _prefill(query, k_cache, v_cache, block_table, seq_len, start, q_len, scale, sliding_window, softcap, out,
             key_ends=None):
    """Queries start:start+q_len, the last q_len of seq_len context tokens, over their own pages (each up to itself,
    or up to its key end)."""
    block_size = k_cache.shape[1]
    first_page = _first_visible(seq_len, q_len, sliding_window) // block_size
    pages = block_table[first_page:-(-seq_len // block_size)].to(k_cache.device, torch.long)
    length = seq_len - first_page * block_size  # slicing to it drops the last page's unwritten tail
    head_dim = query.shape[-1]
    keys, values = (load_pages(cache, pages, head_dim).flatten(0, 1)[:length] for cache in (k_cache, v_cache))
    queries = query[start:start + q_len].float()
    mask = None
    if first_page > 0 or q_len < seq_len or sliding_window is not None or key_ends is not None:
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        key_pos = torch.arange(first_page * block_size, seq_len, device=query.device)
        mask = key_pos <= (query_pos if key_ends is None else torch.maximum(query_pos, key_ends[:, None]))
        if sliding_window is not None:
            mask &= query_pos - key_pos < sliding_window
    if softcap is not None:
        _capped_prefill(queries, keys, values, mask, scale, softcap, out[start:start + q_len])
        return
    result = F.scaled_dot_product_attention(
        queries.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
        is_causal=mask is None, scale=scale, enable_gqa=query.shape[1] != k_cache.shape[2])
    out[start:start + q_len] = result.transpose(0, 1)


def _capped_prefill(queries, keys, values, mask, scale, softcap, out):
    """Soft-capped attention of queries [q_len, H, D] over keys/values [L, Hkv, D] (mask [q_len, L];
    None: causal with q_len == L) into out [q_len, H, D], a chunk of queries at a time so the
    materialised scores stay within CAPPED_SCORE_BYTES."""
    q_len, num_heads, head_dim = queries.shape
    length, num_kv_heads = keys.shape[:2]
    group = num_heads // num_kv_heads
    if mask is None:
        mask = torch.ones(q_len, length, dtype=torch.bool, device=queries.device).tril()
    keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [Hkv, L, D]
    chunk = max(1, CAPPED_SCORE_BYTES // (4 * num_heads * length))
    for lo in range(0, q_len, chunk):
        rows = queries[lo:lo + chunk].transpose(0, 1)
        # the rows of the query heads that share a KV head go together: GQA without repeating K/V
        grouped = rows.reshape(num_kv_heads, group * rows.shape[1], head_dim)
        result = _capped_attention(grouped, keys, values, mask[lo:lo + chunk].repeat(group, 1), scale, softcap)
        out[lo:lo + chunk] = result.view(num_heads, -1, head_dim).transpose(0, 1)


def _capped_attention(queries, keys, values, mask, scale, softcap):
    """softmax(mask(softcap * tanh(scale * q k^T / softcap))) v over broadcasting batch dims;
    mask (True: visible) broadcasts against the scores [..., rows, L], None masks nothing."""
    scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(scale / softcap).tanh_().mul_(softcap)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), values)


def _decode(query, k_cache, v_cache, block_tables, seqs, lens, starts, scale, sliding_window, softcap, out):
    """One query token per sequence: gather, attend and write back group by group."""
    block_size = k_cache.shape[1]
    first = [_first_visible(lens[b], 1, sliding_window) // block_size for b in seqs]
    num_pages = [-(-lens[b] // block_size) - f for b, f in zip(seqs, first, strict=True)]
    order = sorted(range(len(seqs)), key=num_pages.__getitem__)
    seqs, first, num_pages = ([x[i] for i in order] for x in (seqs, first, num_pages))
    pages, key_pos = _visible_pages(block_tables, seqs, first, num_pages, block_size, k_cache.device)
    seq_len = torch.tensor([lens[b] for b in seqs], device=k_cache.device)[:, None]
    visible = key_pos < seq_len
    if sliding_window is not None:
        visible &= key_pos >= seq_len - sliding_window
    rows = torch.tensor([starts[b] for b in seqs], device=query.device)
    queries = query.index_select(0, rows).float()
    token_bytes = 2 * k_cache.shape[2] * query.shape[-1] * 4  # K and V of a slot as gathered: float32
    results = []
    for lo, hi in _groups(num_pages, block_size * token_bytes):
        width = num_pages[hi - 1]
        # every slot visible to its query (Python ints, so no tensor ops): no mask, nothing to zero
        full = sliding_window is None and all(lens[b] == width * block_size for b in seqs[lo:hi])
        group_visible = None if full else visible[lo:hi, :width * block_size]
        keys, values = _gather_group(k_cache, v_cache, pages[lo:hi, :width], group_visible, query.shape[-1])
        mask = None if full else group_visible[:, None, None]
        results.append(_attend_decode(queries[lo:hi], keys, values, mask, scale, softcap))
    out.index_copy_(0, rows, torch.cat(results).to(out.dtype))


def _visible_pages(block_tables, seqs, first, num_pages, block_size, device):
    """Pages [n, P] holding each sequence's visible context (unused entries: page 0) and the
    context position of every slot of them [n, P * block_size]."""
    width = max(num_pages)
    first_page = torch.tensor(first, device=device)[:, None]
    columns = first_page + torch.arange(width, device=device)
    used = columns < (first_page + torch.tensor(num_pages, device=device)[:, None])
    table = block_tables.index_select(0, torch.tensor(seqs, device=block_tables.device)).to(device, torch.long)
    # entries past a sequence's last page may hold anything (often -1)
    pages = torch.where(used, table.gather(1, columns.clamp(max=table.shape[1] - 1)), 0)
    key_pos = (columns[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)
    return pages, key_pos


def _groups(num_pages: list[int], page_bytes: int) -> list[tuple[int, int]]:
    """Split sequences sorted by page count into [lo, hi) groups whose padded K+V fits the budget."""
    groups, lo = [], 0
    for hi in range(1, len(num_pages) + 1):
        if hi - lo > 1 and (hi - lo) * num_pages[hi - 1] * page_bytes > DECODE_GROUP_BYTES:
            groups.append((lo, hi - 1))
            lo = hi - 1
    return groups + [(lo, len(num_pages))]


def _gather_group(k_cache, v_cache, pages, visible, head_dim):
    """K and V [n, P * block_size, Hkv, D] in float32 from reused buffers; slots no query sees
    (visible False; None: all seen) are zeroed, because they may hold stale data or NaN and a
    masked score still multiplies its value."""
    n, width = pages.shape
    hidden = None if visible is None else (~visible).flatten().nonzero().flatten()
    gathered = []
    for name, cache in (("k", k_cache), ("v", v_cache)):
        stored = as_bytes(cache)
        shape = (n * width, *stored.shape[1:])
        buffer = torch.index_select(stored, 0, pages.flatten(), out=_buffer(name, shape, stored.dtype, cache.device))
        if cache.dtype != torch.float32:
            values = dequantize_rows(buffer.view(cache.dtype), head_dim)
            buffer = _buffer(name + "32", tuple(values.shape), torch.float32, cache.device).copy_(values)
        buffer = buffer.view(n, -1, *buffer.shape[2:])
        if hidden is not None and len(hidden):
            buffer.view(-1, buffer[0, 0].numel()).index_fill_(0, hidden, 0)
        gathered.append(buffer)
    return gathered


def _buffer(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused scratch buffer for a group within the budget; a fresh tensor for one long sequence
    that exceeds it, so a single huge context does not stay allocated after its step."""
    if math.prod(shape) * dtype.itemsize <= DECODE_GROUP_BYTES:
        return scratch(name, shape, dtype, device)
    return torch.empty(shape, dtype=dtype, device=device)


def _attend_decode(queries, keys, values, mask, scale, softcap):
    """SDPA for queries [n, H, D] over keys/values [n, L, Hkv, D]; returns [n, H, D]."""
    n, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[2]
    # the query heads that share a KV head become that head's query rows: GQA without repeating K/V
    grouped = queries.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if softcap is not None:
        result = _capped_attention(grouped, keys.transpose(1, 2), values.transpose(1, 2), mask, scale, softcap)
    else:
        result = F.scaled_dot_product_attention(grouped, keys.transpose(1, 2), values.transpose(1, 2),
                                                attn_mask=mask, scale=scale)
    return result.reshape(n, num_heads, head_dim)
