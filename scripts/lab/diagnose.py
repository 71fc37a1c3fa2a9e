"""Localise a wrong or hanging kernel on the GPU: each case in its own process with a timeout.

    python3 scripts/lab.py diagnose --arch sm90                 # the built-in ladder of cases
    python3 scripts/lab.py diagnose --case 'arch=sm90,head_dim=128,seqlen_q=128,seqlen_k=128'
    python3 scripts/lab.py diagnose --arch fp8                  # the e4m3 ladder (sm90)
    python3 scripts/lab.py diagnose --case 'dtype=fp8,head_dim=128,seqlen_q=1000,seqlen_k=1000,v_layout=transposed'

fp8 cases (dtype=fp8) quantise randn bf16 inputs to e4m3 per tensor (facodegen.ops.quantize) and compare
with the float64 reference of the same dequantised inputs (tolerance 3e-2); ``descale=head`` gives
k and v per-(batch, kv head) descales, ``v_layout=transposed`` passes V^T (padded to 16 keys).

A case is spec fields plus the shape (batch, seqlen_q, seqlen_k, heads_q, heads_kv); it prints one
line: relative Frobenius error of O and LSE, NaN count, and for a failure where the error sits
(per 16-row block of the first head, per 16-column slab of head_dim), which is usually enough to
tell a descriptor, swizzle, mask or pipeline bug apart. A hang is reported as TIMEOUT.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SHAPE_KEYS = ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv")

LADDER = {
    "sm90": [
        # one tile, every machinery switch off, then one switch at a time
        "head_dim=128,seqlen_q=128,seqlen_k=176,pingpong=0,intra_wg_overlap=0,persistent=0",
        "head_dim=128,seqlen_q=128,seqlen_k=704,pingpong=0,intra_wg_overlap=0,persistent=0",
        "head_dim=128,seqlen_q=128,seqlen_k=704,pingpong=0,intra_wg_overlap=1,persistent=0",
        "head_dim=128,seqlen_q=256,seqlen_k=704,pingpong=1,intra_wg_overlap=1,persistent=0",
        "head_dim=128,seqlen_q=1024,seqlen_k=1024,batch=2,heads_q=4,heads_kv=4",
        "head_dim=128,seqlen_q=1000,seqlen_k=1000,batch=2,heads_q=4,heads_kv=2",
        "head_dim=128,seqlen_q=17,seqlen_k=17",
        "head_dim=128,seqlen_q=1,seqlen_k=1",
        "head_dim=128,seqlen_q=1000,seqlen_k=1000,causal=1,heads_q=4,heads_kv=4",
        "head_dim=128,seqlen_q=300,seqlen_k=1000,causal=1,heads_q=2,heads_kv=1",
        "head_dim=128,seqlen_q=1000,seqlen_k=300,causal=1,heads_q=2,heads_kv=2",
        "head_dim=64,seqlen_q=1000,seqlen_k=1000,heads_q=4,heads_kv=4",
        "head_dim=64,seqlen_q=1000,seqlen_k=1000,causal=1,heads_q=4,heads_kv=4",
        "head_dim=256,seqlen_q=1000,seqlen_k=1000,heads_q=4,heads_kv=4",
        "head_dim=256,seqlen_q=1000,seqlen_k=1000,causal=1,heads_q=4,heads_kv=4",
        "head_dim=96,seqlen_q=1000,seqlen_k=1000,heads_q=4,heads_kv=4",
        "head_dim=192,seqlen_q=1000,seqlen_k=1000,heads_q=4,heads_kv=4",
        "head_dim=128,seqlen_q=4096,seqlen_k=4096,batch=2,heads_q=16,heads_kv=16,dtype=fp16",
    ],
    "sm80": [
        "head_dim=128,seqlen_q=128,seqlen_k=128",
        "head_dim=128,seqlen_q=1024,seqlen_k=1024,batch=2,heads_q=4,heads_kv=4",
        "head_dim=128,seqlen_q=1000,seqlen_k=1000,batch=2,heads_q=4,heads_kv=2",
        "head_dim=128,seqlen_q=17,seqlen_k=1",
        "head_dim=128,seqlen_q=1000,seqlen_k=1000,causal=1,heads_q=4,heads_kv=4",
        "head_dim=128,seqlen_q=1000,seqlen_k=300,causal=1,heads_q=2,heads_kv=2",
        "head_dim=64,seqlen_q=1000,seqlen_k=1000,heads_q=4,heads_kv=4",
        "head_dim=256,seqlen_q=1000,seqlen_k=1000,heads_q=4,heads_kv=4,causal=1",
        "head_dim=96,seqlen_q=1000,seqlen_k=1000,heads_q=4,heads_kv=4",
        "head_dim=192,seqlen_q=1000,seqlen_k=1000,heads_q=4,heads_kv=4,dtype=fp16",
        "head_dim=128,seqlen_q=1000,seqlen_k=1000,heads_q=4,heads_kv=4,q_in_regs=1,num_warps=8",
        "head_dim=128,seqlen_q=1000,seqlen_k=1000,heads_q=4,heads_kv=4,stages=1",
        "head_dim=128,seqlen_q=1000,seqlen_k=1000,heads_q=4,heads_kv=4,stages=3,block_n=32",
    ],
    "fp8": [
        # dtype=fp8 on sm90: one tile, switches off; then the defaults, odd lengths, causal, GQA
        "dtype=fp8,head_dim=128,seqlen_q=128,seqlen_k=192,pingpong=0,intra_wg_overlap=0,persistent=0",
        "dtype=fp8,head_dim=128,seqlen_q=128,seqlen_k=192,pingpong=0,intra_wg_overlap=0,persistent=0,v_layout=transposed",
        "dtype=fp8,head_dim=128,seqlen_q=128,seqlen_k=768,pingpong=0,intra_wg_overlap=1,persistent=0",
        "dtype=fp8,head_dim=128,seqlen_q=1024,seqlen_k=1024,batch=2,heads_q=4,heads_kv=4",
        "dtype=fp8,head_dim=128,seqlen_q=1024,seqlen_k=1024,batch=2,heads_q=4,heads_kv=4,v_layout=transposed",
        "dtype=fp8,head_dim=128,seqlen_q=1000,seqlen_k=1000,batch=2,heads_q=4,heads_kv=2,descale=head",
        "dtype=fp8,head_dim=128,seqlen_q=17,seqlen_k=17",
        "dtype=fp8,head_dim=128,seqlen_q=1000,seqlen_k=1000,causal=1,heads_q=4,heads_kv=4",
        "dtype=fp8,head_dim=128,seqlen_q=300,seqlen_k=1000,causal=1,heads_q=2,heads_kv=1,v_layout=transposed",
        "dtype=fp8,head_dim=128,seqlen_q=1000,seqlen_k=300,causal=1,heads_q=2,heads_kv=2",
        "dtype=fp8,head_dim=64,seqlen_q=1000,seqlen_k=1000,heads_q=4,heads_kv=4",
        "dtype=fp8,head_dim=64,seqlen_q=1000,seqlen_k=1000,causal=1,heads_q=4,heads_kv=4,v_layout=transposed",
        "dtype=fp8,head_dim=256,seqlen_q=1000,seqlen_k=1000,heads_q=4,heads_kv=4",
        "dtype=fp8,head_dim=256,seqlen_q=1000,seqlen_k=1000,causal=1,heads_q=4,heads_kv=4,descale=head",
        "dtype=fp8,head_dim=192,seqlen_q=1000,seqlen_k=1000,heads_q=4,heads_kv=4",
        "dtype=fp8,head_dim=96,seqlen_q=1000,seqlen_k=1000,heads_q=4,heads_kv=4",
        "dtype=fp8,head_dim=128,seqlen_q=1000,seqlen_k=1000,heads_q=4,heads_kv=4,block_n=224",
        "dtype=fp8,head_dim=128,seqlen_q=1000,seqlen_k=1000,heads_q=4,heads_kv=4,out_dtype=fp16",
        "dtype=fp8,head_dim=128,seqlen_q=4096,seqlen_k=4096,batch=4,heads_q=16,heads_kv=16",
    ],
}


def parse_case(text: str, arch: str) -> tuple[dict, dict]:
    fields = {"arch": arch}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        fields[key] = value if key in ("arch", "dtype", "gpu", "out_dtype", "v_layout", "descale") else int(value)
    for key in ("causal", "pingpong", "intra_wg_overlap", "persistent", "q_in_regs"):
        if key in fields:
            fields[key] = bool(fields[key])
    shape = {"batch": 1, "seqlen_q": 128, "seqlen_k": 128, "heads_q": 1, "heads_kv": 1}
    for key in SHAPE_KEYS:
        if key in fields:
            shape[key] = fields.pop(key)
    return fields, shape


def run_one(fields: dict, shape: dict) -> dict:
    import torch

    if fields.get("dtype") == "fp8":
        return run_one_fp8(fields, shape)

    import facodegen
    from facodegen.verify.reference import attention_reference

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[fields.pop("dtype", "bf16")]
    causal = fields.pop("causal", False)
    arch = fields.pop("arch")
    head_dim = fields.pop("head_dim", 128)
    b, sq, sk, hq, hkv = (shape[k] for k in SHAPE_KEYS)
    g = torch.Generator(device="cuda").manual_seed(int(time.time() * 1e6) % 2**31)
    q = torch.randn(b, sq, hq, head_dim, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, sk, hkv, head_dim, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, sk, hkv, head_dim, device="cuda", dtype=dtype, generator=g)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, hq, sq), float("nan"), device="cuda", dtype=torch.float32)
    prepared = facodegen.prepare(q, k, v, causal=causal, return_lse=True, out=out, lse_out=lse, arch=arch,
                                 **fields)
    t0 = time.time()
    prepared()
    torch.cuda.synchronize()
    elapsed = time.time() - t0
    o_ref, lse_ref = attention_reference(q.float().cpu().numpy(), k.float().cpu().numpy(),
                                         v.float().cpu().numpy(), causal=causal)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    return compare(out, lse, o_ref, lse_ref, tol, prepared.spec.variant, elapsed)


def compare(out, lse, o_ref, lse_ref, tol: float, variant: str, elapsed: float, result: dict | None = None) -> dict:
    """The verdict line of a case: relative Frobenius error of O, NaNs, LSE error and -inf rows,
    and for a failure where the error sits (per 16 rows and 16 columns of batch 0, head 0; per head)."""
    import numpy as np

    o = out.float().cpu().numpy().astype(np.float64)
    l = lse.cpu().numpy().astype(np.float64)
    nan = int(np.isnan(o).sum())
    diff = np.nan_to_num(o - o_ref, nan=1e9)
    rel = float(np.linalg.norm(diff) / max(np.linalg.norm(o_ref), 1e-30))
    finite = np.isfinite(lse_ref)
    lse_ok = bool(np.all(np.isneginf(l[~finite]))) if (~finite).any() else True
    lse_err = float(np.nanmax(np.abs(l[finite] - lse_ref[finite]))) if finite.any() else 0.0
    result = dict(result or {}, variant=variant, rel=rel, nan=nan, lse_err=lse_err, lse_empty_ok=lse_ok,
                  seconds=round(elapsed, 4))
    result["ok"] = rel <= tol and nan == 0 and lse_err < 1e-2 and lse_ok
    if not result["ok"]:
        err = np.abs(diff[0, :, 0, :])  # first batch, first head: (seqlen_q, head_dim)
        result["err_by_16rows"] = [round(float(err[i:i + 16].max()), 3) for i in range(0, err.shape[0], 16)][:24]
        result["err_by_16cols"] = [round(float(err[:, j:j + 16].max()), 3) for j in range(0, err.shape[1], 16)]
        result["out_head"] = [round(float(x), 4) for x in o[0, 0, 0, :6]]
        result["ref_head"] = [round(float(x), 4) for x in o_ref[0, 0, 0, :6]]
        result["err_by_head"] = [round(float(np.abs(diff[:, :, h, :]).max()), 3) for h in range(o.shape[2])][:8]
    return result


def run_one_fp8(fields: dict, shape: dict) -> dict:
    """An e4m3 case: randn bf16 -> quantize_e4m3 (per tensor; descale=head: per-(batch, kv head)
    k/v descales on top), the kernel vs the float64 reference of the same dequantised inputs."""
    import numpy as np
    import torch

    import facodegen
    from facodegen.ops.quantize import quantize_e4m3
    from facodegen.verify.reference import FP8_TOLERANCE, attention_reference_fp8

    fields.pop("dtype")
    causal = fields.pop("causal", False)
    arch = fields.pop("arch")
    head_dim = fields.pop("head_dim", 128)
    descale_mode = fields.pop("descale", "tensor")
    v_layout = fields.get("v_layout", "row")
    b, sq, sk, hq, hkv = (shape[k] for k in SHAPE_KEYS)
    g = torch.Generator(device="cuda").manual_seed(int(time.time() * 1e6) % 2**31)
    q, k, v = (torch.randn(b, s, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
               for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    (q8, qd), (k8, kd), (v8, vd) = quantize_e4m3(q), quantize_e4m3(k), quantize_e4m3(v)
    if descale_mode == "head":
        spread = torch.rand(b, hkv, device="cuda", generator=g) + 0.5
        kd, vd = (kd * spread).contiguous(), (vd * spread.flip(-1)).contiguous()
    v_arg = facodegen.transpose_v(v8) if v_layout == "transposed" else v8
    out_name = fields.get("out_dtype", "bf16")
    out = torch.full((b, sq, hq, head_dim), float("nan"), device="cuda",
                     dtype=torch.bfloat16 if out_name == "bf16" else torch.float16)
    lse = torch.full((b, hq, sq), float("nan"), device="cuda", dtype=torch.float32)
    prepared = facodegen.prepare(q8, k8, v_arg, causal=causal, return_lse=True, out=out, lse_out=lse, arch=arch,
                                 q_descale=qd, k_descale=kd, v_descale=vd, **fields)
    t0 = time.time()
    prepared()
    torch.cuda.synchronize()
    elapsed = time.time() - t0
    o_ref, lse_ref = attention_reference_fp8(q8, k8, v8, qd, kd, vd, causal=causal)
    extra = {}
    try:   # FlashAttention-3's fp8 error on the same inputs, where it is installed
        from flash_attn_interface import flash_attn_func
        per_kv = lambda d: d.reshape(1, 1).expand(b, hkv).contiguous() if d.numel() == 1 else d  # noqa: E731
        fa3 = flash_attn_func(q8, k8, v8, causal=causal, q_descale=per_kv(qd), k_descale=per_kv(kd),
                              v_descale=per_kv(vd))
        fa3 = fa3[0] if isinstance(fa3, tuple) else fa3
        extra["fa3_rel"] = float(np.linalg.norm(fa3.float().cpu().numpy() - o_ref) / np.linalg.norm(o_ref))
    except Exception as err:  # noqa: BLE001
        extra["fa3_rel"] = f"n/a ({type(err).__name__})"
    return compare(out, lse, o_ref, lse_ref, FP8_TOLERANCE, prepared.spec.variant, elapsed, extra)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm90")
    parser.add_argument("--case", action="append", help="one case; repeatable (default: the ladder)")
    parser.add_argument("--timeout-s", type=float, default=40)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        fields, shape = json.loads(args.child)
        print(json.dumps(run_one(fields, shape)), flush=True)
        return 0
    cases = args.case or LADDER[args.arch]
    failures = 0
    for text in cases:
        fields, shape = parse_case(text, "sm90" if args.arch == "fp8" else args.arch)
        start = time.time()
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps([fields, shape])],
                                  capture_output=True, text=True, timeout=args.timeout_s, env=os.environ)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
            if proc.returncode or not lines:
                status = "ERROR " + (proc.stderr.strip().splitlines() or ["?"])[-1][:300]
            else:
                r = json.loads(lines[-1])
                status = ("ok   " if r["ok"] else "FAIL ") + json.dumps(r)
        except subprocess.TimeoutExpired:
            status = f"TIMEOUT after {args.timeout_s:.0f}s (hang?)"
        failures += not status.startswith("ok")
        print(f"[{time.time() - start:5.1f}s] {text}: {status}", flush=True)
    print(f"{len(cases) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
