"""Batch-invariant linear layers and attention for the torch backend's deterministic setting.

A row's logits must not depend on the forward it shares: how many rows, whose, in which order, or
where its keys sit among masked ones. Under `batch_invariant()` (a torch function mode, so the
model's own code runs unchanged) two functions are replaced for the duration of a forward:

  F.linear      every matmul runs on tiles of exactly `LINEAR_TILE` rows, the last one padded
                with zero rows: the GEMM's kernel and blocking are chosen by the shape, which is
                now always the same, and a GEMM does not mix the rows of a tile. (On this CPU
                oneDNN's bf16 kernels already agree up to 32 rows and change from 33; a fixed
                shape does not rely on where a library draws that line.)
  F.scaled_dot_product_attention
                fp32 on tiles of ROW_TILE query rows x KEY_TILE keys, the same two matmul shapes
                for any forward; the tiles' sums are added in key order. A masked key weighs an
                exact 0, so a row sees the same sums alone or beside other sessions (longer key
                ranges, more rows). A tree node sees its ancestors among masked siblings, at other
                places than the same token decoded alone: its keys are gathered first, in
                position order. The tiles' element count is a multiple of 64, so `exp` never
                takes its scalar tail loop, whose last bit can differ from the vector loop's.

The rest of a decoder layer is already row-wise on the CPU (RMSNorm's reduction, SiLU, rotary
embeddings, residual adds), as the self-test (`specmesh bench invariance`) shows. The CPU only
(ModelRunner refuses CUDA): there cumsum is a parallel scan, and no GPU here to prove it on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "KEY_TILE",
    "LINEAR_TILE",
    "ROW_TILE",
    "batch_invariant",
    "invariant_attention",
    "invariant_linear",
]

LINEAR_TILE = 16  # rows of every linear layer's matmul; one row pays ~1.06x its matmul time on this CPU
ROW_TILE, KEY_TILE = 32, 64  # attention's tiles: query rows x keys
_ATTENTION_BUDGET = 1 << 23  # scores of one chunk of row tiles (32 MiB of fp32)
_CHUNK_TILES = 8  # row tiles per chunk at most, so that a causal prefill skips its masked half


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear on tiles of LINEAR_TILE rows. x [..., in] -> [..., out]."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n % LINEAR_TILE:
        rows = torch.cat([rows, rows.new_zeros(LINEAR_TILE - n % LINEAR_TILE, rows.shape[1])])
    out = torch.cat([F.linear(tile, weight, bias) for tile in rows.split(LINEAR_TILE)])
    return out[:n].reshape(*x.shape[:-1], out.shape[-1])


def invariant_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """F.scaled_dot_product_attention's contract, with sums in a fixed order (module docstring).

    query [B, H, Q, D]; key, value [B, Hkv, L, D] with H a multiple of Hkv (grouped heads share
    a key head, as with enable_gqa); attn_mask broadcastable to [B, H, Q, L], bool (True: may
    attend) or added to the scores, one mask for the heads of a key group. Returns [B, H, Q, D]
    in the query's dtype. A query row that may attend to nothing gets zeros (sdpa gives NaN), so
    pad rows stay finite."""
    if dropout_p:
        raise ValueError("dropout: the batch-invariant attention is for inference only")
    b, h, q_len, d = query.shape
    key, value = _distinct_heads(key, value)
    h_kv, length = key.shape[-3], key.shape[-2]
    groups = h // h_kv
    if is_causal:  # sdpa's convention: query j sees keys 0..j
        attn_mask = torch.ones(q_len, length, dtype=torch.bool, device=query.device).tril()
    if attn_mask is None:
        bias = torch.zeros(1, 1, 1, length, device=query.device)
    elif attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, device=query.device).masked_fill_(~attn_mask, float("-inf"))
    else:
        bias = attn_mask.float()
    # rows query-major within a key group: [B * Hkv, Q, g, ...]
    bias = bias.expand(b, h, q_len, length).reshape(b, h_kv, groups, q_len, length).transpose(2, 3)
    bias = bias.reshape(b * h_kv, q_len, groups, length)
    rows = query.float().reshape(b, h_kv, groups, q_len, d).transpose(2, 3)
    rows = rows.reshape(b * h_kv, q_len, groups, d)
    keys, values = key.float().reshape(b * h_kv, length, d), value.float().reshape(b * h_kv, length, d)
    scale = d**-0.5 if scale is None else scale
    out = _tiled(rows.flatten(1, 2), keys, values, bias.flatten(1, 2), scale).view(b * h_kv, q_len, groups, d)
    # A row that sees keys after a masked one (a tree node: its ancestors among other nodes) is
    # computed again with its keys gathered first, in position order: the tiles then hold what
    # they hold when the same token is decoded alone.
    allowed = bias[:, :, 0] > float("-inf")  # [B * Hkv, Q, L]
    holey = (allowed[..., 1:] & ~allowed[..., :-1]).any(-1)
    if holey.any():
        n_idx, q_idx = holey.nonzero(as_tuple=True)
        if not (bias[n_idx, q_idx] > float("-inf")).eq(allowed[n_idx, q_idx][:, None]).all():
            raise ValueError("attn_mask: the heads that share a key head need one mask")
        order = torch.argsort((~allowed[n_idx, q_idx]).to(torch.int8), dim=-1, stable=True)  # [n, L]
        take = order[:, :, None].expand(-1, -1, d)
        gathered = _tiled(
            rows[n_idx, q_idx],
            keys[n_idx].gather(1, take),
            values[n_idx].gather(1, take),
            bias[n_idx, q_idx].gather(-1, order[:, None, :].expand(-1, groups, -1)),
            scale,
        )
        out[n_idx, q_idx] = gathered
    out = out.view(b, h_kv, q_len, groups, d).transpose(2, 3).reshape(b, h, q_len, d)
    return out.to(query.dtype)


def _distinct_heads(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """key, value [B, H, L, D] -> the same with runs of equal neighbouring heads kept once. For
    several query rows transformers repeats each key head for its query group (`repeat_kv`);
    attended as one group, a key head's rows share tiles instead of padding one tile each."""
    h = key.shape[1]
    if h == 1:
        return key, value
    equal = (key[:, 1:] == key[:, :-1]) & (value[:, 1:] == value[:, :-1])  # [B, H - 1, L, D]
    repeats = equal.flatten(2).all(-1).all(0).tolist()  # [H - 1]: head i + 1 repeats head i
    starts = [0, *(i + 1 for i, repeated in enumerate(repeats) if not repeated)]
    run = h // len(starts)
    if run == 1 or starts != list(range(0, h, run)):
        return key, value
    return key[:, ::run], value[:, ::run]


def _tiled(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float):
    """Attention on fixed tiles: rows [N, R, D] fp32, keys and values [N, L, D], bias [N, R, L]
    (-inf: masked) -> [N, R, D]. Every matmul is [ROW_TILE, D] x [D, KEY_TILE] or [ROW_TILE,
    KEY_TILE] x [KEY_TILE, D + 1] (the extra column of ones gives the softmax's denominator), so
    each tile is summed by one kernel whatever R and L are; the tiles' sums are added in key order
    (a running sum), and an all-masked tile adds an exact 0."""
    n, r, d = rows.shape
    length = keys.shape[1]
    pad_r, pad_l = -r % ROW_TILE, -length % KEY_TILE
    n_keys = (length + pad_l) // KEY_TILE
    q = F.pad(rows, (0, 0, 0, pad_r)).view(n, -1, 1, ROW_TILE, d)  # [N, nr, 1, 32, D]
    k = F.pad(keys, (0, 0, 0, pad_l)).view(n, 1, n_keys, KEY_TILE, d).transpose(-1, -2)  # [N, 1, nk, D, 64]
    ones = torch.ones(n, length + pad_l, 1, device=keys.device)
    v = torch.cat([F.pad(values, (0, 0, 0, pad_l)), ones], -1).view(n, 1, n_keys, KEY_TILE, d + 1)
    b = F.pad(bias, (0, pad_l, 0, pad_r), value=float("-inf"))
    b = b.view(n, -1, ROW_TILE, n_keys, KEY_TILE).transpose(2, 3)  # [N, nr, nk, 32, 64]
    out = torch.empty(n, b.shape[1], ROW_TILE, d, device=rows.device)
    # per row tile, the last key any of its rows sees (0 if none)
    positions = torch.arange(length, device=bias.device)
    seen = torch.where(bias > float("-inf"), positions, 0).amax(-1).amax(0)  # [R]
    reach = F.pad(seen, (0, pad_r)).view(-1, ROW_TILE).amax(-1).tolist()
    step = max(1, min(_CHUNK_TILES, _ATTENTION_BUDGET // (n * n_keys * ROW_TILE * KEY_TILE)))
    for i in range(0, b.shape[1], step):
        tiles = slice(i, i + step)
        # key tiles after the chunk's last visible key add exact zeros: skipped (a causal prefill's half)
        span = slice(0, max(reach[tiles]) // KEY_TILE + 1)
        scores = torch.matmul(q[:, tiles], k[:, :, span]) * scale + b[:, tiles, span]  # [N, nr', nk', 32, 64]
        top = scores.amax(dim=(2, 4), keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a row that sees no key
        # [N, nr', 32, D + 1]: each key tile's weighted values and weights, summed in key order
        summed = torch.matmul(torch.exp(scores - top), v[:, :, span]).cumsum(2)[:, :, -1]
        total = summed[..., d:]
        out[:, tiles] = summed[..., :d] / torch.where(total > 0, total, torch.ones_like(total))
    return out.view(n, -1, d)[:, :r]


_REPLACED = {F.linear: invariant_linear, F.scaled_dot_product_attention: invariant_attention}


class _BatchInvariant(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        return _REPLACED.get(func, func)(*args, **(kwargs or {}))


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    """Within: F.linear and sdpa are the batch-invariant versions above (the mode is off inside
    them, so they call the real functions)."""
    with _BatchInvariant():
        yield
