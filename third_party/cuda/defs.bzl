"""cuda_library: compiles .cu files with nvcc into a cc_library (which carries CcInfo)."""

load("@local_cuda//:defs.bzl", "NVCC")

# sm_80 (A100), sm_86 (A6000/RTX 30), sm_90a (H100/H200) machine code + compute_90 PTX
# so newer GPUs can JIT. The H100/H200 code is built for sm_90a, the architecture-specific
# target, so that kernels may use wgmma (kernels/common/wgmma_tf32.cuh); its machine code runs on
# compute capability 9.0 only, which is what sm_90 code ran on too. The portable compute_90
# PTX has no wgmma: kernels keep an mma.sync path for it and for sm_80 / sm_86.
CUDA_GENCODE = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_86,code=sm_86",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_90,code=compute_90",
]

# `--define=cuda_archs=sm90` (tools/gpu/make_bundle.sh): H100/H200 machine code only. The
# GPU bundle links the kernels statically into every binary, and four architectures made
# it too big to carry to the GPU machine.
CUDA_GENCODE_SM90 = ["-gencode=arch=compute_90a,code=sm_90a"]

CUDA_COPTS = [
    "-std=c++17",
    "-O3",
    "--expt-relaxed-constexpr",
    "-Xcompiler=-fPIC",
    "-Xcompiler=-O3",
    "-lineinfo",
]

def _nvcc_cmd(src, gencode, copts):
    return " ".join([
        NVCC,
        "-ccbin $(CC)",
        " ".join(gencode),
        " ".join(CUDA_COPTS),
        " ".join(copts),
        "-I.",
        "-I$(GENDIR)",
        "-c $(location %s)" % src,
        "-o $@",
    ])

def cuda_library(name, srcs, hdrs = [], nvcc_hdrs = [], deps = [], copts = [], **kwargs):
    """A cc_library whose objects come from nvcc.

    Args:
      name: the cc_library's name.
      srcs: .cu files; each becomes one object (whole-program, no -rdc).
      hdrs: headers of this library, visible to dependents and the only headers (besides
            the CUDA toolkit's) that nvcc sees: each .cu compiles in a genrule whose inputs
            are the .cu and these, so a shared .cuh a kernel includes must be listed here.
      nvcc_hdrs: headers of other packages (labels) that nvcc sees but this library does
            not export (kernels/common's device helpers).
      deps: cc_library deps for dependents and the link; their headers do not reach nvcc
            (torch headers must not reach it anyway).
      copts: extra nvcc flags.
      **kwargs: passed to the cc_library (visibility, tags, ...).
    """
    objects = []
    for src in srcs:
        stem = src.replace("/", "_").rsplit(".", 1)[0]
        obj = "_objs_%s/%s.pic.o" % (name, stem)
        native.genrule(
            name = "%s_%s_nvcc" % (name, stem),
            srcs = [src] + hdrs + nvcc_hdrs,
            outs = [obj],
            cmd = select({
                "//third_party/cuda:sm90_only": _nvcc_cmd(src, CUDA_GENCODE_SM90, copts),
                "//conditions:default": _nvcc_cmd(src, CUDA_GENCODE, copts),
            }),
            toolchains = ["@bazel_tools//tools/cpp:current_cc_toolchain"],
            tags = ["cuda"],
        )
        objects.append(obj)
    native.cc_library(
        name = name,
        srcs = objects,
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:cudart"],
        linkstatic = True,
        alwayslink = True,
        **kwargs
    )
