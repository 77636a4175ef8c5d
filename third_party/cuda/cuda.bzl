"""CUDA toolkit repository and a small nvcc-based cuda_library macro.

No rules_cuda download: nvcc is called by absolute path (through a label it cannot find
cicc), with the C++ toolchain's compiler as host compiler. Every build compiles the
kernels, so CUDA compile and link errors show on machines without a GPU too.
"""

def _cuda_repository_impl(rctx):
    root = rctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    nvcc = rctx.path(root + "/bin/nvcc")
    if not nvcc.exists:
        fail("no nvcc at %s: install the CUDA toolkit or set CUDA_PATH (tools/setup.sh)" % nvcc)
    rctx.symlink(root + "/include", "include")
    rctx.symlink(root + "/lib64", "lib64")
    rctx.file("defs.bzl", "NVCC = \"%s\"\nCUDA_LIB_DIR = \"%s\"\n" % (
        nvcc,
        rctx.path(root + "/lib64").realpath,
    ))
    rctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

exports_files(["defs.bzl"])

cc_library(
    name = "cuda_headers",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.cuh", "include/**/*.inl"]),
    includes = ["include"],
)

cc_library(
    name = "cudart",
    srcs = ["lib64/libcudart.so"],
    linkopts = ["-Wl,-rpath,%s", "-ldl", "-lpthread", "-lrt"],
    deps = [":cuda_headers"],
)

cc_library(
    name = "nccl",
    srcs = ["lib64/libnccl.so"],
    deps = [":cuda_headers"],
)
""" % rctx.path(root + "/lib64").realpath)

cuda_repository = repository_rule(
    implementation = _cuda_repository_impl,
    environ = ["CUDA_PATH"],
    local = True,
)
