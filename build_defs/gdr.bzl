"""gdr's rule shapes: a kernel family, an op with its CUDA registration, GPU tests.

Layering (Note [Layer visibility] in //:BUILD): each macro gives its targets the visibility
of its layer, so an upward include is a build error, not a review comment.
"""

load("//third_party/cuda:defs.bzl", "cuda_library")

# Who may depend on each layer (package groups in //:BUILD).
KERNELS_VISIBILITY = ["//:kernel_users"]
OPS_VISIBILITY = ["//:op_users"]
TESTS_ONLY = ["//tests:__subpackages__"]

def kernel_family(
        name,
        header,
        host_srcs = [],
        cuda_srcs = [],
        device_hdrs = [],
        host_deps = [],
        kernel_source = False,
        visibility = KERNELS_VISIBILITY):
    """One kernel family of kernels/: its host contract, its CUDA objects, its device source.

    Targets:
      <name>_host: the launcher header (plain C++, no CUDA headers) and host-side rules
                   (host_srcs: launch sizing, tile rules); what ops compile against.
      <name>_cuda: nvcc objects of cuda_srcs (cuda_library); nvcc sees the header,
                   device_hdrs and nothing else, so every .cuh a kernel includes
                   (kernels/common ones as labels) is listed in device_hdrs.
      <name>_kernel_source (kernel_source = True): device_hdrs as textual headers, for the
                   CPU emulation tests that compile a kernel body as host C++.

    Args:
      name: the family name (e.g. "rms_norm").
      header: the launcher header.
      host_srcs: plain C++ sources of the host side.
      cuda_srcs: .cu files.
      device_hdrs: the .cuh files the kernels include.
      host_deps: deps of the host side.
      kernel_source: also make <name>_kernel_source.
      visibility: of the host and CUDA targets.
    """
    local_hdrs = [h for h in device_hdrs if not h.startswith("//")]
    common_hdrs = [h for h in device_hdrs if h.startswith("//")]
    native.cc_library(
        name = name + "_host",
        srcs = host_srcs,
        hdrs = [header],
        deps = host_deps,
        visibility = visibility,
    )
    if cuda_srcs:
        cuda_library(
            name = name + "_cuda",
            srcs = cuda_srcs,
            hdrs = [header] + local_hdrs,
            nvcc_hdrs = common_hdrs,
            deps = [":" + name + "_host"],
            visibility = visibility,
        )
    if kernel_source:
        native.cc_library(
            name = name + "_kernel_source",
            textual_hdrs = local_hdrs,
            deps = [":" + name + "_host"] + (["//kernels/common:device_helpers"] if common_hdrs else []),
            visibility = TESTS_ONLY,
        )

def kernel_sources():
    """The package's .cu / .cuh files as `cuda_sources`, for //kernels:cuda_sources (the
    determinism manifest's check reads every CUDA source)."""
    native.filegroup(
        name = "cuda_sources",
        srcs = native.glob(["*.cu", "*.cuh"]),
        visibility = ["//kernels:__pkg__"],
    )

def op_library(
        name,
        srcs,
        hdrs,
        deps = [],
        internal_hdrs = [],
        cuda_srcs = [],
        cuda_deps = [],
        visibility = OPS_VISIBILITY):
    """One op of ops/: schema, checks, CPU implementation and autograd, plus its CUDA part.

    Targets:
      <name>: the op (alwayslink: it registers with the dispatcher); CPU binaries link it
              alone.
      <name>_internal (internal_hdrs): headers shared by the op's own sources and its
              tests only (argument checks, the CUDA part's helpers).
      <name>_cuda (cuda_srcs): the CUDA implementation's registration (alwayslink),
              reaching binaries through //ops:cuda_ops.

    Args:
      name: the op's target name.
      srcs: the op's .cc files.
      hdrs: its public headers.
      deps: deps of the op.
      internal_hdrs: headers private to the op and its tests.
      cuda_srcs: the CUDA registration's .cc files.
      cuda_deps: deps of the CUDA part besides the op (its kernel family's _cuda target).
      visibility: of the op and its CUDA part.
    """
    internal = []
    if internal_hdrs:
        native.cc_library(
            name = name + "_internal",
            hdrs = internal_hdrs,
            deps = ["@libtorch//:libtorch_cpu"],
            visibility = TESTS_ONLY,
        )
        internal = [":" + name + "_internal"]
    native.cc_library(
        name = name,
        srcs = srcs,
        hdrs = hdrs,
        alwayslink = True,
        deps = deps + internal + ["@libtorch//:libtorch_cpu"],
        visibility = visibility,
    )
    if cuda_srcs:
        native.cc_library(
            name = name + "_cuda",
            srcs = cuda_srcs,
            alwayslink = True,
            deps = [":" + name] + internal + cuda_deps + ["@libtorch//:libtorch_cuda"],
            visibility = ["//ops:__pkg__"] + TESTS_ONLY,
        )

def gdr_test(name, srcs, deps = [], gpu = False, size = "small", shard_count = None, tags = [], **kwargs):
    """A GoogleTest test; gpu = True tags it `gpu` (excluded on CPU machines, run on the GPU
    machine through tools/gpu/make_bundle.sh) and links the CUDA ops.

    Args:
      name: the test's name.
      srcs: its sources.
      deps: its deps (gtest_main is added).
      gpu: a GPU test.
      size: Bazel's size.
      shard_count: Bazel's shard_count.
      tags: extra tags.
      **kwargs: passed to cc_test (data, env, timeout, ...).
    """
    extra_deps = ["@googletest//:gtest_main"]
    if gpu:
        extra_deps = extra_deps + ["//ops:cuda_ops", "@libtorch//:libtorch_cuda"]
    native.cc_test(
        name = name,
        srcs = srcs,
        size = size,
        shard_count = shard_count,
        tags = tags + (["gpu"] if gpu else []),
        deps = deps + extra_deps,
        **kwargs
    )
