"""The attention kernels' machine code for sm_90 (H100, H200), built on a
machine without a GPU (compile_only.py): for each cache dtype and head
size, the decode kernel (a batch of one-token decodes at a long context:
the split flash-decoding program, read-ahead and widened V tiles as the
dtype's defaults set them) and the prefill kernel (256-token chunks: its
large tiles), with their instruction
count in ``cuobjdump -sass``, the most frequent opcodes, and the registers
and spills of each thread. Static figures, not timings: they say where two
builds differ (an int8 tile's widening against fp8's, say) before a GPU
measures what that costs.

    python -m pagedkv.bench.kernels.sass --output FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)

import torch
import triton

from pagedkv.bench.kernels.compile_only import BUILT, install

CACHE_DTYPES = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
HEAD_SIZES = (64, 128)
KERNELS = {"decode": "_decode_split_kernel", "prefill": "_paged_attention_kernel"}
_COPY_WAIT = re.compile(r"DEPBAR\.LE SB0, (0x[0-9a-f]+)")
_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def machine_code(cubin: bytes) -> dict[str, Any]:
    """Instruction count, the ten most frequent opcodes, registers and
    spill bytes of a cubin's one kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        sass = subprocess.run(
            [_tool("cuobjdump"), "-sass", file.name], capture_output=True, text=True, check=True
        ).stdout
        usage = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", file.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    opcodes = Counter(_OPCODE.findall(sass))
    registers = re.search(r"REG:(\d+)", usage)
    spills = re.search(r"STACK:(\d+)", usage)
    return {
        "instructions": sum(opcodes.values()),
        "top_opcodes": dict(opcodes.most_common(10)),
        "registers": int(registers.group(1)) if registers else None,
        "stack_bytes": int(spills.group(1)) if spills else None,
        # Local-memory loads and stores (a spill's traffic), and the copy
        # groups each wait on asynchronous copies lets stay in flight (0: it
        # waits for every copy; more: the pipeline overlaps its copies).
        "local_accesses": sum(n for op, n in opcodes.items() if op.startswith(("LDL", "STL"))),
        "copy_waits": sorted({int(n, 16) for n in _COPY_WAIT.findall(sass)}),
        # Warpgroup products (sm_90's HGMMA) and waits on them: ptxas, when
        # it serializes the products, waits after every one.
        "products": opcodes["HGMMA"],
        "product_waits": sass.count("WARPGROUP.DEPBAR"),
    }


def _build(dtype: torch.dtype, head_size: int) -> dict[str, dict[str, Any]]:
    """The decode and the prefill kernel over a cache of ``dtype``."""
    from pagedkv.kernels import int8_kv, paged_attention

    heads, kv_heads, block_size, batch = 32, 8, 16, 32
    shape = (2 * batch + 1, block_size, kv_heads, head_size)
    scales: dict[str, torch.Tensor] = {}
    if dtype == torch.int8:
        (_, key_cache, k_scale), (_, value_cache, v_scale) = (
            int8_kv.block_storage(*shape) for _ in range(2)
        )
        scales = {"k_scale": k_scale, "v_scale": v_scale}
    else:
        key_cache, value_cache = (torch.zeros(shape, dtype=dtype) for _ in range(2))
        if dtype.itemsize == 1:
            scales = {name: torch.ones(kv_heads) for name in ("k_scale", "v_scale")}
    table = torch.arange(1, 2 * batch + 1, dtype=torch.int32).view(batch, 2)
    seq_lens = torch.full((batch,), 20, dtype=torch.int32)
    query = torch.zeros(batch * 256, heads, head_size, dtype=torch.bfloat16)
    built = {}
    for kind, new_tokens in (("decode", 1), ("prefill", 256)):
        BUILT.clear()
        starts = torch.arange(0, (batch + 1) * new_tokens, new_tokens, dtype=torch.int32)
        paged_attention.paged_attention(
            query[: batch * new_tokens], key_cache, value_cache, table, seq_lens, starts, 0.1,
            max_query_len=new_tokens, max_seq_len=8192, k_scale=scales.get("k_scale"),
            v_scale=scales.get("v_scale"),
        )  # fmt: skip
        kernel = next(k for k in BUILT if k.name == KERNELS[kind])
        built[kind] = machine_code(kernel.asm["cubin"])
    return built


def _settings(pairs: list[str]) -> dict[str, bool]:
    """``paged_attention.NAME=on|off`` and ``decode_attention.NAME=on|off``
    pairs set on those modules (a boolean launch constant off or on)."""
    from pagedkv.kernels import decode_attention, paged_attention

    modules = {"paged_attention": paged_attention, "decode_attention": decode_attention}
    settings = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        module, _, constant = name.partition(".")
        if module not in modules or not isinstance(getattr(modules[module], constant, None), bool):
            raise SystemExit(f"--set: {name} is no boolean constant of {sorted(modules)}")
        if value not in ("on", "off"):
            raise SystemExit(f"--set: {name}={value}: on or off")
        setattr(modules[module], constant, value == "on")
        settings[name] = value == "on"
    return settings


def run(settings: list[str] | None = None) -> dict[str, Any]:
    install()
    changed = _settings(settings or [])
    rows = []
    for name, dtype in CACHE_DTYPES.items():
        for head_size in HEAD_SIZES:
            for kind, code in _build(dtype, head_size).items():
                rows.append(
                    {"kv_cache_dtype": name, "head_size": head_size, "kernel": kind, **code}
                )
    return {
        "target": "sm_90",
        "settings": changed,
        "rows": rows,
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": triton.__version__,
        },
    }


def summary(results: dict[str, Any]) -> str:
    lines = [
        "# Attention kernels' machine code for sm_90 (`python -m pagedkv.bench.kernels.sass`)",
        "",
        f"Built without a GPU by Triton {results['machine']['triton']}; counts from "
        "`cuobjdump -sass` and `-res-usage`. Launch constants changed from the "
        f"defaults: {results['settings'] or 'none'}.",
        "",
        "| kernel | cache | head size | instructions | registers | stack bytes | local "
        "loads and stores | copy groups a wait leaves in flight |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['kernel']} | {row['kv_cache_dtype']} | {row['head_size']} | "
            f"{row['instructions']:,} | {row['registers']} | {row['stack_bytes']} | "
            f"{row['local_accesses']} | {', '.join(map(str, row['copy_waits']))} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.bench.kernels.sass")
    parser.add_argument("--output", required=True, type=Path, help="JSON (and .md beside it)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODULE.NAME=on|off",
        help="a boolean launch constant, e.g. paged_attention.PREFILL_INT8_SCALE_TILES=off",
    )
    args = parser.parse_args(argv)
    results = run(args.set)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    text = summary(results)
    args.output.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
