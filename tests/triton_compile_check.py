"""Compile every variant of samba-hf's Triton kernels (the scans and the conv) that the Python side launches, with
Triton's real compiler, for CUDA targets (sm_80, sm_90), down to a cubin, on a machine without a GPU.

The interpreter that tests/test_kernels.py runs under checks what the kernels compute, but not whether the compiler
takes them: on the first H200 run (Triton 3.6) every variant failed to compile ("Inconsistent return types": a
helper returned a scalar from one constexpr branch and a tensor from the other), which the interpreter accepts.
Run without TRITON_INTERPRET (the interpreter replaces the kernels): `python tests/triton_compile_check.py` prints one
line per variant, "ok" with the registers a thread takes and what it spills, and ends with "failures N";
tests/test_kernels.py runs it."""

import importlib.util
import itertools
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "..", "src", "samba_hf", "triton_scan_samba.py")
CONV_SOURCE = os.path.join(HERE, "..", "src", "samba_hf", "triton_conv_samba.py")

# (name, head_dim, groups, a_per_head, d_inner, d_state): the layouts the models give _Layout
LAYOUTS = [
    ("Samba-1.3B", 1, 1, False, 4608, 16),
    ("Mamba-2-Hybrid 8B", 64, 8, True, 8192, 128),
    ("Mamba-2, groups spanning blocks", 4, 3, True, 24, 5),
]


def load_kernels(source=SOURCE):
    # a module of the samba_hf package (its relative imports need one), under a name of its own
    spec = importlib.util.spec_from_file_location("samba_hf." + os.path.basename(source)[:-3] + "_checked", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def conv_variants(c):
    """(kernel, description, pointer types, constexprs) for every launch of triton_conv_samba.py."""
    for dtype, has_bias in itertools.product(("bf16", "fp32"), (True, False)):
        constants = dict(K=4, HAS_BIAS=has_bias, BLOCK_T=c.BLOCK_T, BLOCK_D=c.BLOCK_D)
        bias = dtype if has_bias else None
        yield (
            c._conv_forward,
            f"conv forward {dtype} {constants}",
            dict(x_ptr=dtype, w_ptr=dtype, bias_ptr=bias, out_ptr=dtype),
            constants,
        )
        yield (
            c._conv_backward,
            f"conv backward {dtype} {constants}",
            dict(
                x_ptr=dtype,
                w_ptr=dtype,
                grad_ptr=dtype,
                grad_x_ptr=dtype,
                grad_w_ptr="fp32",
                grad_bias_ptr="fp32" if has_bias else None,
            ),
            constants,
        )


def resources(ptx: str, arch: int) -> str:
    """What a thread of the kernel takes, from ptxas -v on its PTX (Triton's own ptxas): registers, and the bytes it
    spills to memory where it runs out of them (a tile too large for its warps)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as file:
            file.write(ptx)
        arch_name = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"  # Triton's PTX for sm_90 targets sm_90a
        report = subprocess.run(
            [get_ptxas(arch).path, f"-arch={arch_name}", "-v", path, "-o", os.devnull], capture_output=True, text=True
        ).stderr
    registers = re.findall(r"Used (\d+) registers", report)
    spilled = re.findall(r"(\d+) bytes spill stores", report)
    if not registers:
        return "resources unknown"
    return f"{registers[-1]} registers, {spilled[-1] if spilled else '?'} bytes spilled"


# The constant of triton_scan_samba.py that sets each kernel's warps (the others launch with Triton's 4).
WARPS = {
    "_scan_forward": "NUM_WARPS",
    "_correct_segments": "NUM_WARPS",
    "_scan_backward": "NUM_WARPS",
    "_carry_segments": "NUM_WARPS",
    "_ssd_chunked_forward": "SSD_NUM_WARPS",
}


def compile_for(fn, target, pointers: dict, constants: dict, num_warps: int = 4) -> str:
    """Compile fn with these pointer element types (None: an absent optional tensor) and constexprs: "ok" with what
    each thread takes (`resources`), or why not."""
    signature, constexprs = {}, {}
    for name in fn.arg_names:
        if name in constants:
            signature[name], constexprs[name] = "constexpr", constants[name]
        elif name in pointers:
            if pointers[name] is None:
                signature[name], constexprs[name] = "constexpr", None
            else:
                signature[name] = "*" + pointers[name]
        else:
            signature[name] = "i32"
    try:
        kernel = triton.compile(ASTSource(fn, signature, constexprs), target=target, options={"num_warps": num_warps})
    except Exception as error:  # the compiler's message, last lines
        return "failed: " + " | ".join(str(error).strip().splitlines()[-3:])[:500]
    if not kernel.asm.get("cubin"):
        return "no cubin produced"
    return f"ok ({resources(kernel.asm['ptx'], target.arch)})"


def variants(t):
    """(kernel, description, pointer types, constexprs) for every launch `_forward` / `_backward` can make."""
    for (name, head_dim, groups, a_per_head, d_inner, d_state), dtype in itertools.product(LAYOUTS, ("bf16", "fp32")):
        layout = t._Layout(d_inner, d_state, head_dim, groups, a_per_head)
        base = layout.constants()
        mamba1 = not a_per_head
        for has_z, has_h0, keep, segmented in itertools.product(
            (mamba1, False), (False, True), (False, True), (False, True)
        ):
            constants = dict(base, HAS_D=True, HAS_Z=has_z, HAS_H0=has_h0, KEEP_CHECKPOINTS=keep, SEGMENTED=segmented)
            pointers = dict(
                u_ptr=dtype,
                dt_ptr="fp32",
                A_ptr="fp32",
                B_ptr=dtype,
                C_ptr=dtype,
                D_ptr="fp32",
                z_ptr=dtype if has_z else None,
                h0_ptr="fp32" if has_h0 else None,
                y_ptr=dtype,
                h_ptr="fp32",
                checkpoints_ptr="fp32" if keep else None,
                elapsed_ptr="fp32" if segmented else None,
            )
            if segmented:
                pointers["y_ptr"] = "fp32"  # _forward keeps y in float32 when it joins segments
            for tile in sorted({1, layout.tile}):  # one token (the decoding step), and the long prompts' step
                constants = dict(constants, TILE=tile)
                yield t._scan_forward, f"forward {name} {dtype} {constants}", pointers, constants
        for has_z in {mamba1, False}:
            constants = dict(base, HAS_D=True, HAS_Z=has_z, TILE=layout.tile)
            pointers = dict(
                u_ptr=dtype,
                dt_ptr="fp32",
                A_ptr="fp32",
                B_ptr=dtype,
                C_ptr=dtype,
                D_ptr="fp32",
                z_ptr=dtype if has_z else None,
                checkpoints_ptr="fp32",
                scratch_ptr="fp32",
                grad_y_ptr=dtype,
                carry_in_ptr="fp32",
                grad_u_ptr="fp32",
                grad_dt_ptr="fp32",
                grad_A_ptr="fp32",
                grad_B_ptr="fp32",
                grad_C_ptr="fp32",
                grad_D_ptr="fp32",
                grad_z_ptr="fp32" if has_z else None,
                grad_h0_ptr="fp32",
            )
            yield t._scan_backward, f"backward {name} {dtype} {constants}", pointers, constants
            constants = dict(
                HEAD_DIM=head_dim,
                A_PER_HEAD=a_per_head,
                ONE_GROUP=layout.one_group,
                HAS_Z=has_z,
                BLOCK_D=layout.block_d,
                BLOCK_N=layout.block_n,
                TILE=layout.tile,
            )
            pointers = dict(
                dt_ptr="fp32",
                A_ptr="fp32",
                C_ptr=dtype,
                z_ptr=dtype if has_z else None,
                grad_y_ptr=dtype,
                ends_ptr="fp32",
                elapsed_ptr="fp32",
            )
            yield t._carry_segments, f"carry segments {name} {dtype} {constants}", pointers, constants
        shared = dict(HEAD_DIM=head_dim, A_PER_HEAD=a_per_head, BLOCK_D=layout.block_d, BLOCK_N=layout.block_n)
        yield (
            t._join_segments,
            f"join {name}",
            dict(A_ptr="fp32", ends_ptr="fp32", elapsed_ptr="fp32", starts_ptr="fp32", h_ptr="fp32"),
            shared,
        )
        for has_z, keep in itertools.product({mamba1, False}, (False, True)):
            constants = dict(
                shared, ONE_GROUP=layout.one_group, HAS_Z=has_z, KEEP_CHECKPOINTS=keep, CHUNK=t.CHUNK, TILE=layout.tile
            )
            pointers = dict(
                dt_ptr="fp32",
                A_ptr="fp32",
                C_ptr=dtype,
                z_ptr=dtype if has_z else None,
                starts_ptr="fp32",
                y_ptr="fp32",
                checkpoints_ptr="fp32" if keep else None,
            )
            yield t._correct_segments, f"correct {name} {dtype} {constants}", pointers, constants


def ssd_variants(t):
    """(kernel, description, pointer types, constexprs) for every launch of the chunked SSD (`ssd_chunked_triton`):
    Mamba-2 layouts' head_dim and d_state, bf16 and fp16, from zero and from a state."""
    for (name, head_dim, groups, a_per_head, d_inner, d_state), dtype in itertools.product(LAYOUTS, ("bf16", "fp16")):
        if not a_per_head:
            continue
        block_p, block_n = t._ssd_blocks(head_dim, d_state)
        for has_h0 in (False, True):
            constants = dict(HAS_D=True, HAS_H0=has_h0, CHUNK=t.SSD_CHUNK, BLOCK_P=block_p, BLOCK_N=block_n)
            pointers = dict(
                x_ptr=dtype,
                dt_ptr="fp32",
                A_ptr="fp32",
                B_ptr=dtype,
                C_ptr=dtype,
                D_ptr="fp32",
                h0_ptr="fp32" if has_h0 else None,
                y_ptr=dtype,
                h_ptr="fp32",
            )
            yield t._ssd_chunked_forward, f"chunked SSD {name} {dtype} {constants}", pointers, constants


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("run without TRITON_INTERPRET=1: the interpreter replaces the kernels this compiles", file=sys.stderr)
        return 2
    t, c = load_kernels(), load_kernels(CONV_SOURCE)
    failures = 0
    for target in (GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32)):
        for fn, what, pointers, constants in itertools.chain(variants(t), ssd_variants(t), conv_variants(c)):
            warps = getattr(t, WARPS[fn.__name__]) if fn.__name__ in WARPS else 4
            outcome = compile_for(fn, target, pointers, constants, warps)
            failures += not outcome.startswith("ok")
            print(f"sm_{target.arch} {what}: {outcome}", flush=True)
    print(f"failures {failures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
