fail("gdr: the build is not set up: run `bash tools/setup.sh` first (it installs Bazel's rules and libtorch and writes .bazelrc.generated)")
