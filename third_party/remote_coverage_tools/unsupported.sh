#!/bin/sh
echo "gdr: bazel coverage is not supported (offline build)" >&2
exit 1
