"""Exposes cuDNN's C++ frontend headers (from the PyPI nvidia-cudnn-frontend wheel) to Bazel.

The directory is $GDR_CUDNN_FRONTEND (tools/setup.sh unpacks the pinned wheel's include/
there). The frontend is header-only; it reaches libcudnn through dlopen at run time
(kernels/attention/cudnn_attention.cc), so nothing links against cuDNN here.
"""

def _cudnn_frontend_repository_impl(rctx):
    root = rctx.os.environ.get("GDR_CUDNN_FRONTEND", "")
    if not root:
        fail("GDR_CUDNN_FRONTEND is not set: run tools/setup.sh first (it writes .bazelrc.generated)")
    if not rctx.path(root + "/include/cudnn_frontend.h").exists:
        fail("cuDNN frontend at %s is incomplete (no include/cudnn_frontend.h): run tools/setup.sh again" % root)
    rctx.symlink(root + "/include", "include")
    rctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "headers",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp"]),
    includes = ["include"],
    # Dynamic loading: libcudnn.so.9 is opened at run time (the one libtorch_cuda loaded),
    # so binaries built against these headers run with whichever cuDNN 9 the GPU box has.
    defines = ["NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING"],
    linkopts = ["-ldl"],
)
""")

cudnn_frontend_repository = repository_rule(
    implementation = _cudnn_frontend_repository_impl,
    environ = ["GDR_CUDNN_FRONTEND"],
    local = True,
)
