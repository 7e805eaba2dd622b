"""Ask ``torch._scaled_mm`` itself which block-scaled GEMMs it takes on this GPU: the
layouts `block_scaling.hardware_operands` builds (which the routing sends there) and
the configurations the routing refuses (NOTE [Block-scaled GEMM routing] in
block_scaling.py), each called directly, with the error text or the error against the
float64 product in units of Hopper's accumulation bound (at most 1 is expected).

One command, on a Hopper machine, from the repository root::

    python3 benchmarks/probe_block_scaled_mm.py

It prints one row per configuration and writes the JSON (card, versions, rows) to
``--out``. A refused configuration that shows "ok" with a ratio <= 1 is one the
routing could send to the hardware in a later change (after a test of it).
"""

from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks"), os.path.join(_ROOT, "tests", "pytorch")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from block_references import hopper_gemm_bound, varied  # noqa: E402
from common import environment, table, write_json  # noqa: E402
from transformer_engine.pytorch.block_scaling import (BLOCK, hardware_operands,  # noqa: E402
                                                      quantize_blocks)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


def _operands(m, k, n, b_rows, dtypes):
    qa = quantize_blocks(varied(m, k, 1).cuda(), dtypes[0], 1)
    qb = quantize_blocks(varied(n, k, 2).cuda(), dtypes[1], b_rows)
    return qa, qb


def _unpadded_operands(qa, qb, multiple: int):
    """The routed layouts but K padded only to ``multiple`` (kb may be 1, or not a
    multiple of 4): what the routing avoids."""
    k = -(-qa.data.shape[1] // multiple) * multiple
    blocks = k // BLOCK

    def pad(t, cols, value):
        return t if t.shape[1] == cols else F.pad(t, (0, cols - t.shape[1]), value=value)

    a = pad(qa.data.view(torch.uint8), k, 0).view(qa.data.dtype).contiguous()
    b = pad(qb.data.view(torch.uint8), k, 0).view(qb.data.dtype).contiguous()
    sa = pad(qa.scale_inv, blocks, 1.0).t().contiguous().t()
    sb = pad(qb.scale_inv, blocks, 1.0).contiguous()
    sb = sb.t() if qb.block_rows == BLOCK else sb.t().contiguous()
    return a, b.t(), sa, sb


CASES = [
    # (label, M, K, N, b rows, (a dtype, b dtype), out dtype, layout)
    ("routed", 128, 512, 256, BLOCK, (E4M3, E4M3), BF16, "routed"),
    ("routed", 136, 300, 144, 1, (E5M2, E4M3), FP32, "routed"),
    ("routed K<=128", 8, 16, 16, 1, (E4M3, E4M3), FP32, "routed"),
    ("routed K<=128", 8, 16, 16, BLOCK, (E4M3, E5M2), BF16, "routed"),
    ("refused: float16 out", 128, 512, 256, BLOCK, (E4M3, E4M3), FP16, "routed"),
    ("refused: float16 out", 136, 300, 144, 1, (E4M3, E4M3), FP16, "routed"),
    ("refused: M=0", 0, 512, 256, BLOCK, (E4M3, E4M3), BF16, "routed"),
    ("refused: M=0", 0, 64, 256, 1, (E4M3, E4M3), BF16, "routed"),
    ("refused: M=1", 1, 512, 256, BLOCK, (E4M3, E4M3), BF16, "routed"),
    ("refused: M=4", 4, 512, 256, 1, (E4M3, E4M3), BF16, "routed"),
    ("refused: M=12", 12, 512, 256, BLOCK, (E4M3, E4M3), FP32, "routed"),
    ("refused: E5M2 x E5M2", 64, 512, 256, 1, (E5M2, E5M2), BF16, "routed"),
    ("avoided: kb=1 (row-wise)", 64, 64, 256, 1, (E4M3, E4M3), BF16, "k128"),
    ("avoided: kb=1 (row-wise)", 64, 64, 256, 1, (E4M3, E4M3), FP32, "k128"),
    ("avoided: kb=1 (row-wise)", 64, 64, 256, 1, (E5M2, E4M3), BF16, "k128"),
    ("avoided: 128x128 kb=3", 64, 384, 256, BLOCK, (E4M3, E4M3), BF16, "k128"),
    ("avoided: 128x128 kb=1", 64, 64, 256, BLOCK, (E4M3, E4M3), BF16, "k128"),
]


def probe(case):
    label, m, k, n, b_rows, dtypes, out, layout = case
    qa, qb = _operands(m, k, n, b_rows, dtypes)
    tensors = hardware_operands(qa, qb) if layout == "routed" else _unpadded_operands(qa, qb, 128)
    try:
        got = torch._scaled_mm(*tensors, out_dtype=out)
        torch.cuda.synchronize()
    except (RuntimeError, ValueError) as err:   # torch raises either for a refused configuration
        return "error", str(err).splitlines()[0][:90]
    a64, b64 = qa.dequantize(torch.float64).cpu(), qb.dequantize(torch.float64).cpu()
    ref = a64 @ b64.t()
    if ref.numel() == 0:
        return "ok", "empty result"
    bound = hopper_gemm_bound(a64, b64) + torch.finfo(out).eps * ref.abs()
    ratio = ((got.cpu().double() - ref).abs() / bound).max().item()
    return "ok", f"error / bound = {ratio:.3g}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_block_scaled_mm: needs a CUDA GPU")
    rows = []
    for case in CASES:
        label, m, k, n, b_rows, dtypes, out, _ = case
        status, detail = probe(case)
        rows.append([label, f"{m}x{k}x{n}", "128x128" if b_rows == BLOCK else "1x128",
                     f"{str(dtypes[0])[11:]}x{str(dtypes[1])[11:]}", str(out)[6:], status, detail])
    header = ["case", "MxKxN", "b blocks", "dtypes", "out", "status", "detail"]
    print(table(rows, header))
    path = write_json({"env": environment(), "header": header, "rows": rows},
                      "probe_block_scaled_mm", args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
