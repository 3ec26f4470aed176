"""Ran (offline, no GPU; no results file: its table is NOTES.md's "registers") at commit 9676666
(2026-12-01), as benchmarks/probes/registers.py; last changed at 4ab20dd (its kernel's row_class
argument); it imports modules by their paths at those commits — check one out there to run it again.
Registers and spills of every decode_linear autotune configuration, compiled offline for the
H100/H200 (sm_90a) — no GPU needed. Triton compiles each configuration to PTX, and the ptxas that
ships with Triton's NVIDIA backend (its newest one: `ptxas-blackwell`, which reads the PTX
version Triton >= 3.9 writes) assembles it with `-v`. The local Triton may be newer than the GPU
machine's, so counts can differ there by a few registers.
Run from the repo root:  PYTHONPATH=. python benchmarks/probes/registers.py"""
import os, re, subprocess, sys, tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import flashspec.decode_linear as dl

SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "nw_ptr": "*bf16", "r_ptr": "*bf16",
             "y_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "eps": "fp32", "x_sm": "i32", "w_sn": "i32",
             "row_class": "i32"}
# What a real launch on these models' matrices sees: 16-byte-aligned pointers, and N, K and the
# row strides multiples of 16 (M and eps are never specialised).
DIVISIBLE_BY_16 = ("x_ptr", "w_ptr", "b_ptr", "nw_ptr", "r_ptr", "y_ptr", "N", "K", "x_sm", "w_sn")
FORMS = {  # the three forms StaticLM can use
    "residual (o, down)": dict(HAS_BIAS=False, NORM=False, RESIDUAL=True, GATED=False),
    "norm + bias (qkv)": dict(HAS_BIAS=True, NORM=True, RESIDUAL=False, GATED=False),
    "norm + SiLU·up (gate_up)": dict(HAS_BIAS=False, NORM=True, RESIDUAL=False, GATED=True),
}


def usage(config, flags) -> tuple[int, int, str]:
    """(registers per thread, bytes of spill stores, how weights are loaded: ``cp.async`` into
    shared memory, or the widest vector of direct global loads) of one configuration and form on
    sm_90a."""
    constexprs = dict(flags, **config.kwargs, UPCAST=False)
    signature = dict(SIGNATURE, **{name: "constexpr" for name in constexprs})
    names = list(signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in DIVISIBLE_BY_16}
    source = ASTSource(fn=dl._decode_linear_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "kernel.ptx")
        open(ptx, "w").write(compiled.asm["ptx"])
        log = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(folder, "kernel.cubin")],
                             capture_output=True, text=True, check=True).stderr
    ptx = compiled.asm["ptx"]
    if "cp.async" in ptx:  # weights staged through shared memory (tensor-core tiles, num_stages > 1)
        widest = "cp.async"
    else:
        widest = max(set(re.findall(r"ld\.global(?:\.\w+)*\.(v\d)\.", ptx)), default="scalar")
    return (int(re.findall(r"Used (\d+) registers", log)[-1]), int(re.findall(r"(\d+) bytes spill stores", log)[-1]),
            widest)


def main() -> None:
    print(f"Triton {triton.__version__}, sm_90a")
    print("| inner product | BLOCK_N | BLOCK_K | warps | " + " | ".join(FORMS) + " |")
    print("|---|---|---|---|" + "---|" * len(FORMS))
    for config in dl._configs():
        cells = []
        for flags in FORMS.values():
            registers, spills, widest = usage(config, flags)
            cells.append(f"{registers} regs, loads {widest}" + (f", **{spills} B spilled**" if spills else ""))
        kind = "tensor cores" if config.kwargs["USE_DOT"] else "CUDA cores"
        print(f"| {kind} | {config.kwargs['BLOCK_N']} | {config.kwargs['BLOCK_K']} | {config.num_warps} | "
              + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
