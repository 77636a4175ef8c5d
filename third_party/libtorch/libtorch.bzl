"""Exposes a libtorch directory (include/ + lib/) as Bazel targets.

The directory is $GDR_LIBTORCH (tools/setup.sh sets it to the unpacked PyPI wheel). A
missing or incomplete libtorch fails here with one line saying what to run, instead of a
compile error deep in the build.
"""

def _libtorch_repository_impl(rctx):
    root = rctx.os.environ.get("GDR_LIBTORCH", "")
    if not root:
        fail("GDR_LIBTORCH is not set: run tools/setup.sh first (it writes .bazelrc.generated)")
    for required in ["include/ATen/ATen.h", "lib/libtorch_cpu.so", "lib/libc10.so"]:
        if not rctx.path(root + "/" + required).exists:
            fail("libtorch at %s is incomplete (no %s): run tools/setup.sh again" % (root, required))
    rctx.symlink(root + "/include", "include")
    rctx.symlink(root + "/lib", "lib")
    lib = str(rctx.path(root + "/lib").realpath)
    rctx.template("BUILD.bazel", Label("//third_party/libtorch:libtorch.BUILD.tpl"), {
        "%{lib_dir}": lib,
    })

libtorch_repository = repository_rule(
    implementation = _libtorch_repository_impl,
    environ = ["GDR_LIBTORCH"],
    local = True,
)
