#!/usr/bin/python3
"""The CUDA kernels read as machine code (issue 13, item 5): the objects nvcc built for the
CUDA backend are disassembled with cuobjdump for sm_89 and sm_90 and checked:

  1. no kernel spills to local memory (cuobjdump -res-usage: LOCAL:0 for every function, and no
     LDL/STL in its SASS: ptxas counts spilled registers in the stack frame, not in LOCAL);
  2. each rule below holds: every kernel whose name matches the rule's pattern contains the
     rule's instructions (the tensor-core attention kernels: HMMA, LDSM, LDGSTS; the bf16
     memory-bound vector kernels, the FP8 casts' among them: LDG.E.128 and STG.E.128; every
     FP8 cast: F2FP.SATFINITE for E4M3 and E5M2; the FP8 amax: LDG.E.128), and at least one
     kernel matches each rule (a rule that matches nothing would pass silently). An instruction is matched by its
     mnemonic ("LDG") or by its whole opcode with modifiers as cuobjdump prints it ("LDG.E.128").

It prints a table of registers, shared and local memory, and the static count of 128-bit global
loads and stores (LDG/STG with a .128 modifier) per kernel and architecture (the records in
benchmarks/RESULTS.md come from it).

Usage: check_sass.py OBJECT.o [OBJECT.o ...]
Exit 77 (skipped) where no cuobjdump is found: the toolkit's, or PyPI's nvidia-cuda-cuobjdump
with nvidia-cuda-nvdisasm beside it (scripts/install-test-references.sh installs both for
/usr/bin/python3).
"""
import collections
import glob
import os
import re
import shutil
import subprocess
import sys

SKIP = 77
ARCHS = ("sm_89", "sm_90")
# (what, pattern on the demangled kernel name, instructions every match must contain)
RULES = [
    ("bf16/f16 attention forward on tensor cores", r"attention_forward_mma_kernel<",
     ("HMMA", "LDSM", "LDGSTS")),
    ("bf16/f16 attention backward on tensor cores (dK/dV, dQ)",
     r"attention_(dkdv|dq)_mma_kernel<", ("HMMA", "LDSM", "LDGSTS")),
    # kernels/cuda/cuda_vector.cuh's users (elementwise, layernorm and RMSNorm rows): every
    # instantiation with a bf16 template argument moves data 128 bits at a time.
    ("bf16 memory-bound kernel with 128-bit global loads and stores",
     r"_vector_kernel<[^>]*__nv_bfloat16", ("LDG.E.128", "STG.E.128")),
    # The multi-tensor optimizer step (cuda_optim.cu): AdamW over every buffer in one launch,
    # 128 bits at a time where a buffer allows; the gradient check reads 128 bits at a time.
    ("multi-tensor AdamW with bf16 gradients, 128-bit loads and stores",
     r"adamw_multi_kernel<__nv_bfloat16", ("LDG.E.128", "STG.E.128")),
    ("multi-tensor gradient check (inf/NaN and squares) with 128-bit loads",
     r"gradient_partials_kernel", ("LDG.E.128",)),
    # The FP8 cast (cuda_fp8.cu): the hardware conversion with satfinite, both formats, on
    # sm_89 and sm_90 (the toolkit's software conversion only before sm_89).
    # Every cast kernel, scalar or 128-bit; the amax of the 128-bit path reads 128 bits at a time
    # (the casts' bf16 instantiations are held to 128-bit loads and stores by the rule above).
    ("FP8 cast by the hardware's saturating conversion",
     r"fp8_cast_(transpose_vector_|vector_)?kernel",
     ("F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C", "F2FP.SATFINITE.E5M2.F32.PACK_AB_MERGE_C")),
    ("FP8 amax of bf16 with 128-bit loads", r"fp8_amax_wide_kernel<__nv_bfloat16", ("LDG.E.128",)),
]


def find_cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    for pattern in ("/usr/local/cuda/bin/cuobjdump",
                    "/usr/local/lib/python3*/dist-packages/nvidia/*/bin/cuobjdump",
                    "/usr/lib/python3/dist-packages/nvidia/*/bin/cuobjdump"):
        for path in sorted(glob.glob(pattern)):
            if os.access(path, os.X_OK):
                return path
    return None


def demangle(names):
    if not names or not shutil.which("c++filt"):
        return dict(zip(names, names))
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return dict(zip(names, out))


def run(cuobjdump, *args):
    # cuobjdump -sass runs nvdisasm, looked up on PATH: PyPI's nvidia-cuda-nvdisasm puts it
    # beside PyPI's cuobjdump, the toolkit beside its own.
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(cuobjdump) + os.pathsep + env.get("PATH", "")
    result = subprocess.run([cuobjdump, *args], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"cuobjdump {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def resource_usage(cuobjdump, obj, arch):
    """{mangled kernel: {"REG": n, "SHARED": n, "LOCAL": n, ...}}"""
    usage, current = {}, None
    for line in run(cuobjdump, "-res-usage", "-arch", arch, obj).splitlines():
        match = re.match(r"\s*Function (\S+):", line)
        if match:
            current = match.group(1)
            continue
        if current and "REG:" in line:
            usage[current] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}
            current = None
    return usage


def sass_by_function(cuobjdump, obj, arch):
    """{mangled kernel: Counter of opcodes: each mnemonic ("LDG") and each whole opcode with its
    modifiers ("LDG.E.128"), with how often each occurs}"""
    functions, current = {}, None
    for line in run(cuobjdump, "-sass", "-arch", arch, obj).splitlines():
        match = re.match(r"\s*Function : (\S+)", line)
        if match:
            current = match.group(1)
            functions[current] = collections.Counter()
            continue
        match = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if current and match:
            opcode = match.group(1)
            functions[current].update({opcode.split(".")[0], opcode})
    return functions


def count_128(opcodes, mnemonic):
    """How many 128-bit `mnemonic` (LDG, STG) instructions a kernel's SASS holds."""
    return sum(n for op, n in (opcodes or {}).items()
               if op.startswith(mnemonic + ".") and "128" in op.split(".")[1:])


def short(name, width=70):
    name = name.replace("dstrain::cuda::", "").replace("(anonymous namespace)::", "")
    return name if len(name) <= width else name[:width - 3] + "..."


def main():
    objects = sys.argv[1:]
    if not objects:
        raise SystemExit("usage: check_sass.py OBJECT.o [OBJECT.o ...]")
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        print("no cuobjdump (the toolkit's or PyPI's nvidia-cuda-cuobjdump): skipped")
        return SKIP
    failures, rows, matched = [], [], {rule[0]: 0 for rule in RULES}
    for arch in ARCHS:
        for obj in objects:
            usage = resource_usage(cuobjdump, obj, arch)
            sass = sass_by_function(cuobjdump, obj, arch)
            names = demangle(sorted(set(usage) | set(sass)))
            for mangled, name in names.items():
                u = usage.get(mangled, {})
                rows.append((arch, short(name), u.get("REG", -1), u.get("SHARED", -1),
                             u.get("LOCAL", -1), count_128(sass.get(mangled), "LDG"),
                             count_128(sass.get(mangled), "STG")))
                if u.get("LOCAL", 0) != 0:
                    failures.append(f"{arch} {name}: {u['LOCAL']} bytes of local memory (spills)")
                # ptxas puts register spills in the stack frame (STACK, LOCAL stays 0): the
                # local loads and stores in the machine code are the proof.
                spills = sum(sass.get(mangled, {}).get(op, 0) for op in ("LDL", "STL"))
                if spills:
                    failures.append(f"{arch} {name}: {spills} local loads/stores (LDL/STL: "
                                    f"spilled registers, a {u.get('STACK', 0)}-byte stack frame)")
                for what, pattern, needed in RULES:
                    if not re.search(pattern, name):
                        continue
                    matched[what] += 1
                    missing = [op for op in needed if op not in sass.get(mangled, set())]
                    if missing:
                        failures.append(f"{arch} {name} ({what}) has no {', '.join(missing)}")
    for what, count in matched.items():
        if count == 0:
            failures.append(f"no kernel is a {what}: the rule matched nothing")
    print(f"{'arch':6} {'kernel':70} {'regs':>5} {'smem':>7} {'local':>6} {'ldg128':>6} "
          f"{'stg128':>6}")
    for arch, name, regs, smem, local, loads, stores in sorted(rows):
        print(f"{arch:6} {name:70} {regs:5} {smem:7} {local:6} {loads:6} {stores:6}")
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
